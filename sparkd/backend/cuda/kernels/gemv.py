"""Skinny GEMM launchers (cukernels/gemv.cu): out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), M <= 16,
and the same with the gated MLP's SiLU-and-mul in its epilogue.

At decode batch sizes a GEMM only streams its weight; this kernel does that with
16-byte loads, many in flight, and split-K across warps where K is long. It
runs M rows of x in one pass over the weight, on the smallest M tile >= M.
`sparkd.backend.cuda.gemm` decides per shape, from measured tables, whether it or
cuBLASLt runs a product; `check_linear_operands` states the operand rules both share.
"""

from __future__ import annotations

import numpy as np

from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream
from ..tensor import DeviceTensor
from . import ACCESS_BYTES, ELEMENT_TYPES, i32, require, row_stride

_SOURCE = "gemv.cu"
M_TILES = (1, 2, 4, 8, 16)  # the kM instantiations
MAX_M = M_TILES[-1]
_ROWS_PER_BLOCK = 4  # kGemvRows
_MAX_WARPS = 8  # kGemvMaxWarps
# GemvPass<kM>::kUnroll of the M tile 1: a chunk of each row per thread and pass; the other tiles
# size their warps as if by four (kGemvLoads over kGemvRows), as the GEMM table measured them.
_CHUNKS_PER_THREAD = {1: 1}
_DEFAULT_CHUNKS_PER_THREAD = 4


def _spec(dtype: DType, out_dtype: DType, tile: int) -> KernelSpec:
    return KernelSpec(_SOURCE, f"gemv_kernel<{dtype.c_type}, {out_dtype.c_type}, {tile}>")


def _silu_spec(dtype: DType, tile: int) -> KernelSpec:
    return KernelSpec(_SOURCE, f"gemv_silu_and_mul_kernel<{dtype.c_type}, {tile}>")


# Output in the input dtype, or fp32 (logits).
SPECS = [_spec(dtype, out_dtype, tile) for dtype in ELEMENT_TYPES for out_dtype in dict.fromkeys((dtype, DType.float32))
         for tile in M_TILES] + [_silu_spec(dtype, tile) for dtype in ELEMENT_TYPES for tile in M_TILES]


def m_tile(m: int) -> int:
    """The M tile that runs m rows of x (1 <= m <= MAX_M): the smallest instantiated one >= m."""
    require(1 <= m <= MAX_M, f"gemv runs 1 to {MAX_M} rows of x, got M = {m}")
    return next(tile for tile in M_TILES if tile >= m)


def check_linear_operands(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor,
                          bias: DeviceTensor | None) -> tuple[int, int, int]:
    """(M, N, K) of out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), or a ValueError naming the operand.

    The rules of every implementation: x and weight of one float dtype; out in that
    dtype or float32, as bias; unit column strides (x's rows may be spaced) and a
    contiguous weight."""
    # Plain ifs, not require(): the messages format tensors, and this runs on every GEMM.
    if x.ndim != 2 or weight.ndim != 2 or out.ndim != 2:
        raise ValueError(f"gemm wants 2-D operands, got x {x.shape}, weight {weight.shape}, out {out.shape}")
    (m, k), (n, k_w) = x.shape, weight.shape
    if k != k_w or out.shape != (m, n):
        raise ValueError(f"gemm shapes do not match: x {x.shape} @ weight {weight.shape}^T -> out {out.shape}")
    if x.dtype is not weight.dtype or x.dtype not in ELEMENT_TYPES:
        raise ValueError(f"gemm needs x and weight of one float dtype, got {x.dtype.name} and {weight.dtype.name}")
    if out.dtype not in (x.dtype, DType.float32):
        raise ValueError(f"gemm output must be {x.dtype.name} or float32, got {out.dtype.name}")
    if not (weight.is_contiguous and x.strides[1] == 1 and out.strides[1] == 1):
        raise ValueError(f"gemm needs unit column strides and a contiguous weight: x {x}, weight {weight}, out {out}")
    if bias is not None and (bias.shape != (n,) or bias.dtype is not out.dtype):
        raise ValueError(f"bias must be [{n}] {out.dtype.name}, got {bias.shape} {bias.dtype.name}")
    return m, n, k


def unsupported_reason(x: DeviceTensor, weight: DeviceTensor) -> str | None:
    """Why gemv cannot run x [M, K] @ weight [N, K]^T (operands that passed
    `check_linear_operands`), or None when it can."""
    m, k = x.shape
    chunk = ACCESS_BYTES // x.dtype.itemsize
    if not 1 <= m <= MAX_M:
        return f"gemv runs 1 to {MAX_M} rows of x, got M = {m}"
    if k % chunk or row_stride(x) % chunk:
        return (f"gemv reads 16-byte chunks: K ({k}) and x's row stride ({row_stride(x)}) must be multiples "
                f"of {chunk} for {x.dtype.name}")
    if x.ptr % ACCESS_BYTES or weight.ptr % ACCESS_BYTES:
        return f"gemv needs x and weight 16-byte aligned, got x at 0x{x.ptr:x}, weight at 0x{weight.ptr:x}"
    return None


def gemv(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor | None,
         stream: Stream) -> None:
    """out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]); fp32 accumulation, out in x's dtype or fp32.

    x's rows may be spaced and out's too (unit column strides); the launch is graph-capturable."""
    m, n, k = check_linear_operands(out, x, weight, bias)
    if m == 0 or n == 0:
        return
    reason = unsupported_reason(x, weight)
    require(reason is None, reason)
    args = [out, x, weight, bias if bias is not None else np.uint64(0), i32(m), i32(n), i32(k),
            np.int64(row_stride(x)), np.int64(out.row_stride)]
    get_kernel(_spec(x.dtype, out.dtype, m_tile(m))).launch(-(-n // _ROWS_PER_BLOCK), _threads(x), args,
                                                            stream=stream)


def gemv_silu_and_mul(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor | None,
                      stream: Stream) -> None:
    """out [M, I] = silu(x @ gate^T) * (x @ up^T), weight = [gate | up] [2I, K], bias [2I];
    out contiguous in x's dtype. Each half rounded to x's dtype before the activation, as
    `gemv` then `silu_and_mul` would; the launch is graph-capturable."""
    m, k = x.shape
    n = weight.shape[0]
    require(n % 2 == 0 and out.shape == (m, n // 2) and out.dtype is x.dtype and out.is_contiguous,
            f"out must be a contiguous [{m}, {n // 2}] {x.dtype.name} for weight {weight.shape}, got {out}")
    check_linear_operands(DeviceTensor(out.ptr, (m, n), out.dtype), x, weight, bias)  # out's strides do not matter
    if m == 0 or n == 0:
        return
    reason = unsupported_reason(x, weight)
    require(reason is None, reason)
    inter = n // 2
    args = [out, x, weight, bias if bias is not None else np.uint64(0), i32(m), i32(inter), i32(k),
            np.int64(row_stride(x))]
    blocks = -(-inter // (_ROWS_PER_BLOCK // 2))  # a gate and an up row per output column
    get_kernel(_silu_spec(x.dtype, m_tile(m))).launch(blocks, _threads(x), args, stream=stream)


def _threads(x: DeviceTensor) -> int:
    """Warps splitting K: enough that one pass of the M tile covers a row, at most kGemvMaxWarps."""
    chunks = x.shape[1] // (ACCESS_BYTES // x.dtype.itemsize)
    per_thread = _CHUNKS_PER_THREAD.get(m_tile(x.shape[0]), _DEFAULT_CHUNKS_PER_THREAD)
    return 32 * min(_MAX_WARPS, max(1, -(-chunks // (32 * per_thread))))
