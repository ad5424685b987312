"""`sparkd kernels build [--arch sm_90 ...]`: compile every registered kernel into the cache.

Needs NVRTC and the CUDA headers (pip extra `kernels`), not a GPU.
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_ARCH = "sm_90"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `kernels`; a parsed command runs as `sys.exit(args.func(args))`."""
    parser = subparsers.add_parser("kernels", help="manage the NVRTC-compiled CUDA kernels")
    actions = parser.add_subparsers(dest="kernels_command", required=True)
    build = actions.add_parser("build", help="compile every kernel into the on-disk cache (no GPU needed)")
    build.add_argument("--arch", action="append", metavar="SM",
                       help=f"target architecture, repeatable (default: this GPU's, else {DEFAULT_ARCH})")
    build.set_defaults(func=run_build)
    return parser


def run_build(args: argparse.Namespace) -> int:
    from ..backend.cuda.compiler import CompileError, all_kernel_specs, cache_dir, compile_specs, specs_by_source

    archs = args.arch or [_local_arch()]
    grouped = specs_by_source(all_kernel_specs())
    if not grouped:
        print("no kernels are registered", file=sys.stderr)
        return 1
    failures = 0
    for arch in archs:
        for source, names in sorted(grouped.items()):
            try:
                module = compile_specs(source, names, arch)
            except (CompileError, ValueError) as err:
                failures += len(names)
                for name in names:
                    print(f"FAIL    {arch}  {source}  {name}")
                print(err, file=sys.stderr)
                continue
            status = "cached" if module.from_cache else "ok"
            for name in names:
                print(f"{status:<7} {arch}  {source}  {name}")
    total = len(archs) * sum(len(names) for names in grouped.values())
    print(f"{total - failures}/{total} kernels built into {cache_dir()}")
    return 1 if failures else 0


def _local_arch() -> str:
    from ..backend.cuda.driver import cuda_driver_available, device_arch

    return device_arch() if cuda_driver_available() else DEFAULT_ARCH
