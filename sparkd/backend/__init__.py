"""Backend selection. `engine/` receives an `Ops` from here and never imports a backend directly."""

from __future__ import annotations

import logging

from .base import Ops

log = logging.getLogger("sparkd.backend")


def cuda_available() -> bool:
    """True when cuda-python is installed and a CUDA device answers."""
    try:
        from .cuda.driver import cuda_driver_available
    except ImportError:
        return False
    return cuda_driver_available()


def create_backend(device: str = "auto", dtype: str = "auto", checkpoint_dtype: str = "float32") -> Ops:
    """device: auto | cpu | cuda. dtype auto means the checkpoint's dtype on CUDA.

    The numpy backend always computes in float32 (it is the reference)."""
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cuda":
        if not cuda_available():
            raise RuntimeError("--device cuda was asked for, but no CUDA device or cuda-python was found "
                               "(install with `pip install sparkd[cuda]`)")
        from .cuda.ops import CudaOps

        return CudaOps(dtype=checkpoint_dtype if dtype == "auto" else dtype)
    if dtype not in ("auto", "float32"):
        log.warning("the CPU backend computes in float32; --dtype %s only applies on CUDA", dtype)
    from .cpu.ops import NumpyOps

    return NumpyOps()
