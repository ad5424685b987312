"""The `sparkd` command: `serve`, `generate`, `--version`, and `kernels` where that module exists."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys

from .. import __version__
from . import generate, serve

# Subcommands owned elsewhere, plugged in when their module is present: each
# module provides add_parser(subparsers), which sets `func` with set_defaults.
_OPTIONAL_COMMANDS = ("sparkd.cli.kernels",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparkd",
                                     description="An LLM inference server with an OpenAI-compatible API.")
    parser.add_argument("--version", action="version", version=f"sparkd {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(subparsers)
    generate.add_parser(subparsers)
    for name in _OPTIONAL_COMMANDS:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
