"""RMSNorm launchers (cukernels/norm.cu): plain, per-head (q/k norm) and fused
with the residual add; fp32 math whatever the storage type."""

from __future__ import annotations

import numpy as np

from ..compiler import KernelSpec, get_kernel
from ..driver import Stream
from ..tensor import DeviceTensor
from . import (
    ELEMENT_TYPES,
    element_name,
    element_specs,
    i32,
    require,
    require_contiguous,
    require_dtype,
    round_up,
    vector_width,
)

_SOURCE = "norm.cu"
SPECS = element_specs(_SOURCE, "rmsnorm_kernel") + element_specs(_SOURCE, "add_rmsnorm_kernel")

_MAX_ELEMS_PER_THREAD = 16  # kMaxElemsPerThread in norm.cu: a thread keeps its row slice in registers
_MAX_THREADS_PER_ROW = 1024
MAX_DIM = _MAX_ELEMS_PER_THREAD * _MAX_THREADS_PER_ROW
_THREADS_PER_BLOCK = 256  # short rows share a block, one row group each


def rmsnorm(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, eps: float, stream: Stream) -> None:
    """out = x / sqrt(mean(x^2) + eps) * weight over the last dim D.

    x: [R, D] or [T, H, D] whose last dim is contiguous while rows may be spaced
    (the q/k head views of the fused qkv output); weight [D]; out: x's shape,
    contiguous, not overlapping x."""
    require(x.ndim in (2, 3), f"x must be [R, D] or [T, H, D], got shape {x.shape}")
    require(x.strides[-1] == 1, f"x's last dim must be contiguous, got strides {x.strides}")
    if x.ndim == 2:
        inner_rows, stride_outer, stride_inner = 1, x.strides[0], 0
    else:
        inner_rows, stride_outer, stride_inner = x.shape[1], x.strides[0], x.strides[1]
    _check_operands(out, x, weight, x.shape)
    dim = x.shape[-1]
    rows = out.numel // max(dim, 1)
    width = vector_width(x.dtype, (out, x, weight), (dim, stride_outer, stride_inner))
    args = [out, x, weight, i32(rows), i32(inner_rows), np.int64(stride_outer), np.int64(stride_inner), i32(dim),
            np.float32(eps)]
    _launch("rmsnorm_kernel", x, width, rows, dim, args, stream)


def add_rmsnorm(out: DeviceTensor, residual: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, eps: float,
                stream: Stream) -> None:
    """residual += x (in place, rounded to its dtype); out = rmsnorm(residual) * weight.

    out, residual, x: [R, D] contiguous, out distinct from both; weight [D]."""
    require(x.ndim == 2, f"x must be [R, D], got shape {x.shape}")
    require(residual.shape == x.shape and residual.dtype is x.dtype,
            f"residual must match x {x.shape} {x.dtype.name}, got {residual.shape} {residual.dtype.name}")
    require_contiguous("x", x)
    require_contiguous("residual", residual)
    require(out.ptr != residual.ptr, "out must not be the residual buffer")
    _check_operands(out, x, weight, x.shape)
    rows, dim = x.shape
    width = vector_width(x.dtype, (out, residual, x, weight), (dim,))
    args = [out, residual, x, weight, i32(rows), i32(dim), np.float32(eps)]
    _launch("add_rmsnorm_kernel", x, width, rows, dim, args, stream)


def _check_operands(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, shape: tuple) -> None:
    require_dtype("x", x, *ELEMENT_TYPES)
    require(out.shape == shape and out.dtype is x.dtype, f"out must be {shape} {x.dtype.name}, got {out.shape} {out.dtype.name}")
    require_contiguous("out", out)
    require(out.ptr != x.ptr, "out must not be x: the kernel reads x while other rows are written")
    require(weight.shape == (shape[-1],) and weight.dtype is x.dtype,
            f"weight must be [{shape[-1]}] {x.dtype.name}, got {weight.shape} {weight.dtype.name}")
    require(0 < shape[-1] <= MAX_DIM, f"the normalised dim must be in [1, {MAX_DIM}], got {shape[-1]}")


def _launch(kernel_name: str, x: DeviceTensor, width: int, rows: int, dim: int, args: list, stream: Stream) -> None:
    if rows == 0:
        return
    # One row group per row, a thread per 16-byte chunk where the row allows.
    threads_per_row = min(_MAX_THREADS_PER_ROW, round_up(-(-dim // width), 32))
    rows_per_block = max(1, _THREADS_PER_BLOCK // threads_per_row)
    kernel = get_kernel(KernelSpec(_SOURCE, element_name(kernel_name, x.dtype, width)))
    kernel.launch(-(-rows // rows_per_block), (threads_per_row, rows_per_block), args, stream=stream)
