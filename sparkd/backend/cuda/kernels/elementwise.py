"""Launcher for elementwise ops (cukernels/elementwise.cu): add."""

from __future__ import annotations

import numpy as np

from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream, current_device
from ..tensor import DeviceTensor
from . import ELEMENT_TYPES, require, require_contiguous, require_dtype, vector_width, vector_widths


def _add_name(dtype: DType, y_dtype: DType, width: int) -> str:
    return f"add_kernel<{dtype.c_type}, {y_dtype.c_type}, {width}>"


# y in the element type, or fp32 (the residual stream).
SPECS: list[KernelSpec] = [KernelSpec("elementwise.cu", _add_name(dtype, y_dtype, width))
                           for dtype in ELEMENT_TYPES for y_dtype in dict.fromkeys((dtype, DType.float32))
                           for width in vector_widths(dtype)]

_THREADS = 256
_BLOCKS_PER_SM = 8  # a grid-stride loop: enough resident blocks to cover memory latency


def add(out: DeviceTensor, x: DeviceTensor, y: DeviceTensor, stream: Stream | None) -> None:
    """out = x + y; all three contiguous, of one shape; y in x's dtype or float32, out in y's."""
    for name, tensor in (("out", out), ("x", x), ("y", y)):
        require_contiguous(name, tensor)
        require_dtype(name, tensor, *ELEMENT_TYPES)
    require(out.shape == x.shape == y.shape, f"add needs equal shapes, got {out.shape} = {x.shape} + {y.shape}")
    require(y.dtype in (x.dtype, DType.float32) and out.dtype is y.dtype,
            f"add needs y in x's dtype or float32 and out in y's, got out {out.dtype.name}, x {x.dtype.name}, "
            f"y {y.dtype.name}")
    if out.numel == 0:
        return
    width = vector_width(x.dtype, (out, x, y), (out.numel,))
    chunks = out.numel // width
    grid = max(1, min(-(-chunks // _THREADS), current_device().sm_count * _BLOCKS_PER_SM))
    get_kernel(KernelSpec("elementwise.cu", _add_name(x.dtype, y.dtype, width))).launch(
        grid, _THREADS, [out, x, y, np.int64(out.numel)], stream=stream)
