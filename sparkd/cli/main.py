"""The `sparkd` command: `serve`, `generate`, `--version`, and `kernels` where that module exists."""

from __future__ import annotations

import os

# The numpy backend runs one forward at a time beside the event loop. OpenBLAS's
# own thread pool spins against that loop and, on a shared or small machine,
# made prefill 10-25x slower in our measurements (docs/benchmarks.md). It must be
# set before numpy loads; an explicit setting by the user wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

from .. import __version__  # noqa: E402
from . import generate, kernels, serve  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparkd",
                                     description="An LLM inference server with an OpenAI-compatible API.")
    parser.add_argument("--version", action="version", version=f"sparkd {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(subparsers)
    generate.add_parser(subparsers)
    kernels.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
