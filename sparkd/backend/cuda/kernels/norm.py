"""RMSNorm launchers (cukernels/norm.cu): plain, per-head (q/k norm) and fused
with the residual add; fp32 math whatever the storage type, and an fp32 residual stream."""

from __future__ import annotations

import numpy as np

from ..compiler import KernelSpec, get_kernel
from ..driver import Stream
from ...dtypes import DType
from ..tensor import DeviceTensor
from . import (
    ELEMENT_TYPES,
    i32,
    require,
    require_contiguous,
    require_dtype,
    round_up,
    vector_width,
    vector_widths,
)

_SOURCE = "norm.cu"

def _name(kernel: str, dtype: DType, input_dtype: DType, width: int) -> str:
    return f"{kernel}<{dtype.c_type}, {input_dtype.c_type}, {width}>"


# Each kernel reads one input in the element type or in fp32: rmsnorm its x (the fp32
# residual stream before the final norm), add_rmsnorm its residual (the first layer's,
# the embedding, comes in the element type).
SPECS = [KernelSpec(_SOURCE, _name(kernel, dtype, input_dtype, width))
         for kernel in ("rmsnorm_kernel", "add_rmsnorm_kernel") for dtype in ELEMENT_TYPES
         for input_dtype in dict.fromkeys((dtype, DType.float32)) for width in vector_widths(dtype)]

_MAX_ELEMS_PER_THREAD = 16  # kMaxElemsPerThread in norm.cu: a thread keeps its row slice in registers
_MAX_THREADS_PER_ROW = 1024
MAX_DIM = _MAX_ELEMS_PER_THREAD * _MAX_THREADS_PER_ROW
_THREADS_PER_BLOCK = 256  # short rows share a block, one row group each


def rmsnorm(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, eps: float, stream: Stream) -> None:
    """out = x / sqrt(mean(x^2) + eps) * weight over the last dim D.

    x: [R, D] or [T, H, D] whose last dim is contiguous while rows may be spaced
    (head views of a fused qkv output), in weight's dtype or float32; weight [D]; out:
    x's shape in weight's dtype, contiguous, not overlapping x."""
    require(x.ndim in (2, 3), f"x must be [R, D] or [T, H, D], got shape {x.shape}")
    require(x.strides[-1] == 1, f"x's last dim must be contiguous, got strides {x.strides}")
    if x.ndim == 2:
        inner_rows, stride_outer, stride_inner = 1, x.strides[0], 0
    else:
        inner_rows, stride_outer, stride_inner = x.shape[1], x.strides[0], x.strides[1]
    require(x.dtype in (out.dtype, DType.float32), f"x must be in out's dtype ({out.dtype.name}) or float32, got {x}")
    _check_operands(out, x, weight, x.shape)
    dim = x.shape[-1]
    rows = out.numel // max(dim, 1)
    width = vector_width(out.dtype, (out, x, weight), (dim, stride_outer, stride_inner))
    args = [out, x, weight, i32(rows), i32(inner_rows), np.int64(stride_outer), np.int64(stride_inner), i32(dim),
            np.float32(eps)]
    _launch(KernelSpec(_SOURCE, _name("rmsnorm_kernel", out.dtype, x.dtype, width)), width, rows, dim, args, stream)


def add_rmsnorm(out: DeviceTensor, residual_out: DeviceTensor, residual: DeviceTensor, x: DeviceTensor,
                weight: DeviceTensor, eps: float, stream: Stream, out_fp32: DeviceTensor | None = None) -> None:
    """residual_out = x + residual in fp32 (no rounding); out = rmsnorm(residual_out) * weight,
    and out_fp32 the same unrounded when given.

    out, x: [R, D] in one dtype; residual [R, D] in x's dtype or float32; residual_out
    [R, D] float32, which may be residual itself (then updated in place); out_fp32 None or
    [R, D] float32; weight [D]. All contiguous, outputs distinct from the inputs."""
    require(x.ndim == 2, f"x must be [R, D], got shape {x.shape}")
    require(residual.shape == x.shape and residual.dtype in (x.dtype, DType.float32),
            f"residual must be {x.shape} in {x.dtype.name} or float32, got {residual.shape} {residual.dtype.name}")
    require(residual_out.shape == x.shape and residual_out.dtype is DType.float32,
            f"residual_out must be {x.shape} float32, got {residual_out.shape} {residual_out.dtype.name}")
    require(residual_out.ptr == residual.ptr or not _overlap(residual_out, residual),
            "residual_out must be the residual itself or not overlap it")
    for name, tensor in (("x", x), ("residual", residual), ("residual_out", residual_out)):
        require_contiguous(name, tensor)
    require(out.ptr not in (residual.ptr, residual_out.ptr), "out must not be a residual buffer")
    require(out_fp32 is None or (out_fp32.shape == x.shape and out_fp32.dtype is DType.float32
                                 and out_fp32.is_contiguous and out_fp32.ptr not in (residual.ptr, residual_out.ptr)),
            f"out_fp32 must be a {x.shape} float32 buffer of its own, got {out_fp32}")
    require(x.dtype is out.dtype, f"x must be in out's dtype ({out.dtype.name}), got {x}")
    _check_operands(out, x, weight, x.shape)
    rows, dim = x.shape
    # The fp32 residual moves the same elements per access as x (two 16-byte accesses for bf16's eight).
    outputs = (out, residual_out) if out_fp32 is None else (out, residual_out, out_fp32)
    width = vector_width(x.dtype, (*outputs, residual, x, weight), (dim,))
    args = [out, out_fp32 if out_fp32 is not None else np.uint64(0), residual_out, residual, x, weight, i32(rows),
            i32(dim), np.float32(eps)]
    name = _name("add_rmsnorm_kernel", x.dtype, residual.dtype, width)
    _launch(KernelSpec(_SOURCE, name), width, rows, dim, args, stream)


def _overlap(a: DeviceTensor, b: DeviceTensor) -> bool:
    return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


def _check_operands(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, shape: tuple) -> None:
    """The rules both kernels share; the caller has checked x's dtype against out's."""
    require_dtype("out", out, *ELEMENT_TYPES)
    require(out.shape == shape, f"out must be {shape}, got {out.shape}")
    require_contiguous("out", out)
    require(out.ptr != x.ptr, "out must not be x: the kernel reads x while other rows are written")
    require(weight.shape == (shape[-1],) and weight.dtype is out.dtype,
            f"weight must be [{shape[-1]}] {out.dtype.name}, got {weight.shape} {weight.dtype.name}")
    require(0 < shape[-1] <= MAX_DIM, f"the normalised dim must be in [1, {MAX_DIM}], got {shape[-1]}")


def _launch(spec: KernelSpec, width: int, rows: int, dim: int, args: list, stream: Stream) -> None:
    if rows == 0:
        return
    # One row group per row, a thread per 16-byte chunk where the row allows.
    threads_per_row = min(_MAX_THREADS_PER_ROW, round_up(-(-dim // width), 32))
    rows_per_block = max(1, _THREADS_PER_BLOCK // threads_per_row)
    kernel = get_kernel(spec)
    kernel.launch(-(-rows // rows_per_block), (threads_per_row, rows_per_block), args, stream=stream)
