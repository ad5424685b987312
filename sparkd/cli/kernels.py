"""`sparkd kernels build [--arch sm_90 ...] [--jobs N]`: compile every registered kernel into the cache.

Needs NVRTC and the CUDA headers (pip extra `kernels`), not a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

DEFAULT_ARCH = "sm_90"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `kernels`; a parsed command runs as `sys.exit(args.func(args))`."""
    parser = subparsers.add_parser("kernels", help="manage the NVRTC-compiled CUDA kernels")
    actions = parser.add_subparsers(dest="kernels_command", required=True)
    build = actions.add_parser("build", help="compile every kernel into the on-disk cache (no GPU needed)")
    build.add_argument("--arch", action="append", metavar="SM",
                       help=f"target architecture, repeatable (default: this GPU's, else {DEFAULT_ARCH})")
    build.add_argument("--jobs", type=int, default=os.cpu_count(), metavar="N",
                       help="sources compiled at once, in separate processes (default: the CPU count)")
    build.set_defaults(func=run_build)
    return parser


def run_build(args: argparse.Namespace) -> int:
    from ..backend.cuda.compiler import all_kernel_specs, cache_dir, specs_by_source

    archs = args.arch or [_local_arch()]
    grouped = sorted(specs_by_source(all_kernel_specs()).items())
    if not grouped:
        print("no kernels are registered", file=sys.stderr)
        return 1
    jobs = [(arch, source, names) for arch in archs for source, names in grouped]
    # NVRTC compiles one program on one thread: separate processes compile sources side by side.
    workers = max(1, min(getattr(args, "jobs", None) or 1, len(jobs)))
    with ProcessPoolExecutor(workers) as pool:
        outcomes = list(pool.map(_compile_one, jobs)) if workers > 1 else [_compile_one(job) for job in jobs]
    failures = 0
    for (arch, source, names), (status, error) in zip(jobs, outcomes):
        if error is not None:
            failures += len(names)
            print(error, file=sys.stderr)
        for name in names:
            print(f"{status:<7} {arch}  {source}  {name}")
    total = len(jobs) and sum(len(names) for _, _, names in jobs)
    print(f"{total - failures}/{total} kernels built into {cache_dir()}")
    return 1 if failures else 0


def _compile_one(job: tuple[str, str, list[str]]) -> tuple[str, str | None]:
    """(status: "ok", "cached" or "FAIL", the error's text on failure) of one source for one arch."""
    from ..backend.cuda.compiler import CompileError, compile_specs

    arch, source, names = job
    try:
        module = compile_specs(source, names, arch)
    except (CompileError, ValueError) as err:
        return "FAIL", str(err)
    return ("cached" if module.from_cache else "ok"), None


def _local_arch() -> str:
    from ..backend.cuda.driver import cuda_driver_available, device_arch

    return device_arch() if cuda_driver_available() else DEFAULT_ARCH
