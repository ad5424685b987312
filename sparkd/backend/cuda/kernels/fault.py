"""A trapping kernel (cukernels/fault.cu), TEST-ONLY.

With SPARKD_TEST_DEVICE_FAULT=1 in the environment, CudaOps launches it before
the first draw, so the step fails with a real sticky device error: the process
cannot use the GPU any more and must exit. Tests use it to prove that it does.
"""

from __future__ import annotations

import os

from ..compiler import KernelSpec, get_kernel
from ..driver import Stream

DEVICE_FAULT_ENV = "SPARKD_TEST_DEVICE_FAULT"
SPECS = [KernelSpec("fault.cu", "trap_kernel")]


def fault_requested() -> bool:
    return os.environ.get(DEVICE_FAULT_ENV, "0") not in ("", "0")


def launch_trap(stream: Stream) -> None:
    get_kernel(SPECS[0]).launch(1, 1, [], stream=stream)
