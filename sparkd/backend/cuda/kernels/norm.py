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
    overlaps,
    require,
    require_contiguous,
    require_dtype,
    round_up,
    row_stride,
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
         for kernel in ("rmsnorm_kernel", "add_rmsnorm_kernel", "combine_add_rmsnorm_kernel") for dtype in ELEMENT_TYPES
         for input_dtype in dict.fromkeys((dtype, DType.float32)) for width in vector_widths(dtype)]

_MAX_ELEMS_PER_THREAD = 16  # kMaxElemsPerThread in norm.cu: a thread keeps its row slice in registers
_MAX_THREADS_PER_ROW = 1024
MAX_DIM = _MAX_ELEMS_PER_THREAD * _MAX_THREADS_PER_ROW
_THREADS_PER_BLOCK = 256  # short rows share a block, one row group each
_COMBINE_NORM_THREADS = 512  # kCombineNormThreads: combine_add_rmsnorm_kernel's launch bound


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
                weight: DeviceTensor, eps: float, stream: Stream, out_lo: DeviceTensor | None = None) -> None:
    """residual_out = x + residual in fp32 (no rounding); out = rmsnorm(residual_out) * weight,
    rounded to out's dtype, and out_lo (bf16 / fp16 only) what that rounding lost, in the same
    dtype: out + out_lo is the unrounded row to ~2^-16 of it in bf16 (a MoE router's input).

    x: [R, D] in out's dtype; residual [R, D] in x's dtype or float32; residual_out [R, D]
    float32, which may be residual itself (then updated in place); weight [D]; these contiguous.
    out [R, D], rows possibly spaced (e.g. the first half of [R, 2D]); out_lo None or [R, D]
    at out's row stride. Outputs distinct from the inputs."""
    require(x.ndim == 2 and x.shape == residual.shape,
            f"x must be [R, D] like residual {residual.shape}, got shape {x.shape}")
    require_contiguous("x", x)
    require(x.dtype is out.dtype, f"x must be in out's dtype ({out.dtype.name}), got {x}")
    ld_out = row_stride(out)
    if out_lo is not None:
        require(out.dtype is not DType.float32, "out_lo is for bf16 / fp16 outputs: an fp32 out loses nothing")
        require(out_lo.shape == x.shape and out_lo.dtype is out.dtype and row_stride(out_lo) == ld_out
                and out_lo.rows_contiguous and not _overlap_rows(out, out_lo, x.shape[1], ld_out),
                f"out_lo must be {x.shape} {out.dtype.name} at out's row stride {ld_out}, apart from out, got {out_lo}")
    outputs = (out, residual_out) if out_lo is None else (out, residual_out, out_lo)
    _launch_add_rmsnorm("add_rmsnorm_kernel", out, residual_out, residual, weight, eps, stream, outputs, (x,),
                        [out, out_lo if out_lo is not None else np.uint64(0), np.int64(ld_out), residual_out, residual,
                         x, weight])


def combine_add_rmsnorm(out: DeviceTensor, residual_out: DeviceTensor, residual: DeviceTensor,
                        expert_out: DeviceTensor, weights: DeviceTensor, row_of_pair: DeviceTensor,
                        weight: DeviceTensor, eps: float, stream: Stream) -> None:
    """`add_rmsnorm` of x = the MoE combine (moe_routing.moe_combine) of expert_out [P, D] in out's
    dtype by weights [R, k] float32 and row_of_pair [P] int32 (P = R * k; a `MoeAlignment`'s), all
    contiguous: the combine's sums rounded to out's dtype as it stores them, so that out and
    residual_out are moe_combine then add_rmsnorm's bit for bit, in one launch and without x."""
    require(weights.ndim == 2 and residual.ndim == 2 and residual.shape[0] == weights.shape[0],
            f"weights must be [R, k] for residual [R, D], got {weights.shape} and {residual.shape}")
    (rows, top_k), dim = weights.shape, residual.shape[1]
    require(expert_out.shape == (rows * top_k, dim) and expert_out.dtype is out.dtype,
            f"expert_out must be [R*k, D] = {(rows * top_k, dim)} {out.dtype.name}, got {expert_out}")
    require(row_of_pair.shape == (rows * top_k,), f"row_of_pair must be [R*k] = [{rows * top_k}], got {row_of_pair}")
    require_dtype("weights", weights, DType.float32)
    require_dtype("row_of_pair", row_of_pair, DType.int32)
    for name, tensor in (("expert_out", expert_out), ("weights", weights), ("row_of_pair", row_of_pair)):
        require_contiguous(name, tensor)
    reason = combine_unsupported_reason(out, residual_out, residual, expert_out, weight)
    require(reason is None, reason)
    _launch_add_rmsnorm("combine_add_rmsnorm_kernel", out, residual_out, residual, weight, eps, stream,
                        (out, residual_out), (expert_out,),
                        [out, np.int64(row_stride(out)), residual_out, residual, expert_out, weights, row_of_pair,
                         i32(top_k), weight])


def combine_unsupported_reason(out: DeviceTensor, residual_out: DeviceTensor, residual: DeviceTensor,
                               expert_out: DeviceTensor, weight: DeviceTensor) -> str | None:
    """Why combine_add_rmsnorm cannot norm these rows (operands it otherwise accepts), or None. Its
    threads keep a batch of expert rows in flight besides their row slice, so a row may have at
    most kCombineNormThreads of them; and it has exactly add_rmsnorm's, for the same sums."""
    dim = residual.shape[-1]
    width = _add_rmsnorm_width(out, (out, residual_out), residual, (expert_out,), weight)
    if _threads_per_row(dim, width) > _COMBINE_NORM_THREADS:
        return (f"combine_add_rmsnorm runs rows of at most {_COMBINE_NORM_THREADS} threads of {width} elements, "
                f"got D = {dim}")
    return None


def _launch_add_rmsnorm(kernel: str, out: DeviceTensor, residual_out: DeviceTensor, residual: DeviceTensor,
                        weight: DeviceTensor, eps: float, stream: Stream, outputs: tuple, x_rows: tuple,
                        args: list) -> None:
    """The checks both add_rmsnorm launchers share and the launch: `args` are the kernel's
    arguments before (rows, dim, eps); x_rows the tensors its x rows come from, read at its width."""
    require(residual.ndim == 2 and residual.dtype in (out.dtype, DType.float32),
            f"residual must be [R, D] in {out.dtype.name} or float32, got {residual.shape} {residual.dtype.name}")
    require(residual_out.shape == residual.shape and residual_out.dtype is DType.float32,
            f"residual_out must be {residual.shape} float32, got {residual_out.shape} {residual_out.dtype.name}")
    require(residual_out.ptr == residual.ptr or not overlaps(residual_out, residual),
            "residual_out must be the residual itself or not overlap it")
    for name, tensor in (("residual", residual), ("residual_out", residual_out)):
        require_contiguous(name, tensor)
    require(out.ptr not in (residual.ptr, residual_out.ptr), "out must not be a residual buffer")
    (rows, dim), ld_out = residual.shape, row_stride(out)
    _check_operands(out, x_rows[0], weight, residual.shape, row_stride=ld_out)
    width = _add_rmsnorm_width(out, outputs, residual, x_rows, weight)
    spec = KernelSpec(_SOURCE, _name(kernel, out.dtype, residual.dtype, width))
    _launch(spec, width, rows, dim, [*args, i32(rows), i32(dim), np.float32(eps)], stream)


def _add_rmsnorm_width(out: DeviceTensor, outputs: tuple, residual: DeviceTensor, x_rows: tuple,
                       weight: DeviceTensor) -> int:
    """Elements per access of an add_rmsnorm launch: the fp32 residual moves as many as x (two 16-byte
    accesses for bf16's eight)."""
    return vector_width(out.dtype, (*outputs, residual, *x_rows, weight), (residual.shape[-1], row_stride(out)))


def _overlap_rows(a: DeviceTensor, b: DeviceTensor, dim: int, row_stride: int) -> bool:
    """Whether any row of a (dim elements each) shares memory with a row of b, both of shape
    [R, dim] with rows row_stride elements apart."""
    size, pitch = dim * a.dtype.itemsize, row_stride * a.dtype.itemsize
    if a.shape[0] == 1:
        return abs(b.ptr - a.ptr) < size
    offset = (b.ptr - a.ptr) % pitch  # where b's rows start within a's row pitch
    return offset < size or offset > pitch - size


def _check_operands(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, shape: tuple,
                    row_stride: int | None = None) -> None:
    """The rules both kernels share; the caller has checked x's dtype against out's. out is
    contiguous, or with row_stride given, rows that far apart (at least the row's length)."""
    require_dtype("out", out, *ELEMENT_TYPES)
    require(out.shape == shape, f"out must be {shape}, got {out.shape}")
    if row_stride is None:
        require_contiguous("out", out)
    else:
        require(out.rows_contiguous and row_stride >= shape[-1],
                f"out's rows must be contiguous and apart by at least their length, got strides {out.strides}")
    require(out.ptr != x.ptr, "out must not be x: the kernel reads x while other rows are written")
    require(weight.shape == (shape[-1],) and weight.dtype is out.dtype,
            f"weight must be [{shape[-1]}] {out.dtype.name}, got {weight.shape} {weight.dtype.name}")
    require(0 < shape[-1] <= MAX_DIM, f"the normalised dim must be in [1, {MAX_DIM}], got {shape[-1]}")


def _threads_per_row(dim: int, width: int) -> int:
    """One row group per row, a thread per 16-byte chunk where the row allows."""
    return min(_MAX_THREADS_PER_ROW, round_up(-(-dim // width), 32))


def _launch(spec: KernelSpec, width: int, rows: int, dim: int, args: list, stream: Stream) -> None:
    if rows == 0:
        return
    threads_per_row = _threads_per_row(dim, width)
    rows_per_block = max(1, _THREADS_PER_BLOCK // threads_per_row)
    kernel = get_kernel(spec)
    kernel.launch(-(-rows // rows_per_block), (threads_per_row, rows_per_block), args, stream=stream)
