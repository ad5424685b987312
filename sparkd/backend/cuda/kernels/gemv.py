"""Skinny GEMM launcher (cukernels/gemv.cu): out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), M <= 16.

At decode batch sizes a GEMM only streams its weight; this kernel does that with
16-byte loads, many in flight, and split-K across warps where K is long. It
runs M rows of x in one pass over the weight, on the smallest M tile >= M.
Two variants of the same kernel:
- split-K across blocks (`gemv(..., split_k=SplitKWorkspace)`): each block takes a
  short K slice, so short grids still fill every SM to the end; the slices' sums
  meet in the workspace, deterministically;
- `silu_mul_gemv`: the down projection of a gated MLP with silu(gate) * up
  computed while x is loaded, bit for bit as `silu_and_mul` stores it.
`sparkd.backend.cuda.gemm` decides per shape, from measured tables, which
implementation runs a product; `check_linear_operands` states the operand rules all share.
"""

from __future__ import annotations

import numpy as np
from cuda.bindings import driver

from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream, call
from ..memory import DeviceAllocator
from ..tensor import DeviceTensor
from . import ACCESS_BYTES, ELEMENT_TYPES, i32, require

_SOURCE = "gemv.cu"
M_TILES = (1, 2, 4, 8, 16)  # the kM instantiations
MAX_M = M_TILES[-1]
# Those of the fused SiLU variant: with 8 or 16 rows of x its activation math makes ptxas
# spill, so larger M runs silu_and_mul and the product apart.
SILU_MUL_M_TILES = (1, 2, 4)
SILU_MUL_MAX_M = SILU_MUL_M_TILES[-1]
_ROWS_PER_BLOCK = 4  # kGemvRows
_MAX_WARPS = 8  # kGemvMaxWarps
_CHUNKS_PER_THREAD = 4  # per row: with kGemvRows rows, the kGemvLoads loads of one pass
# Split-K across blocks: a K slice is one pass of two warps (at M <= 4), so a
# 4096-long bf16 row makes 2 slices and a 14336-long one 7.
_SLICE_CHUNKS = 2 * 32 * _CHUNKS_PER_THREAD
_MAX_SPLITS = 16
_SPLIT_PARTIAL_BYTES = 4 << 20  # fp32 partial sums [splits, M, N]
_SPLIT_ROW_GROUPS = 1 << 15  # counters: N up to 131072 (a 128256 vocabulary)


def _spec(dtype: DType, out_dtype: DType, tile: int, silu_mul: bool = False) -> KernelSpec:
    flag = "true" if silu_mul else "false"
    return KernelSpec(_SOURCE, f"gemv_kernel<{dtype.c_type}, {out_dtype.c_type}, {tile}, {flag}>")


# Output in the input dtype, or fp32 (logits); the fused MLP down projection outputs the input dtype.
SPECS = [
    *(_spec(dtype, out_dtype, tile) for dtype in ELEMENT_TYPES for out_dtype in dict.fromkeys((dtype, DType.float32))
      for tile in M_TILES),
    *(_spec(dtype, dtype, tile, silu_mul=True) for dtype in ELEMENT_TYPES for tile in SILU_MUL_M_TILES),
]


class SplitKWorkspace:
    """The fixed scratch of split-K launches on one stream: fp32 partial sums and one
    counter per row group, zero between launches (the kernel's last block of a row
    group resets its counter), so launches replay from CUDA graphs."""

    def __init__(self, allocator: DeviceAllocator, stream: Stream):
        self.partials = allocator.empty((_SPLIT_PARTIAL_BYTES // 4,), DType.float32)
        self.counters = allocator.empty((_SPLIT_ROW_GROUPS,), DType.int32)
        call(driver.cuMemsetD32Async, self.counters.ptr, 0, self.counters.numel, stream.handle)

    def splits(self, m: int, n: int, chunks: int) -> int:
        """K slices for out [m, n] over `chunks` 16-byte chunks of K: one per _SLICE_CHUNKS,
        as many as the workspace holds; 1 (no split) where it holds none."""
        if -(-n // _ROWS_PER_BLOCK) > self.counters.numel:
            return 1
        wanted = min(_MAX_SPLITS, -(-chunks // _SLICE_CHUNKS))
        return max(1, min(wanted, self.partials.numel // (m * n)))


def m_tile(m: int, tiles: tuple[int, ...] = M_TILES) -> int:
    """The M tile that runs m rows of x (1 <= m <= MAX_M): the smallest of `tiles` >= m."""
    require(1 <= m <= MAX_M, f"gemv runs 1 to {MAX_M} rows of x, got M = {m}")
    return next(tile for tile in tiles if tile >= m)


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


def x_row_stride(x: DeviceTensor) -> int:
    """Elements between x's rows; a single row has none to honour."""
    return x.row_stride if x.shape[0] > 1 else x.shape[1]


def unsupported_reason(x: DeviceTensor, weight: DeviceTensor) -> str | None:
    """Why gemv cannot run x [M, K] @ weight [N, K]^T (operands that passed
    `check_linear_operands`), or None when it can."""
    m, k = x.shape
    chunk = ACCESS_BYTES // x.dtype.itemsize
    if not 1 <= m <= MAX_M:
        return f"gemv runs 1 to {MAX_M} rows of x, got M = {m}"
    if k % chunk or x_row_stride(x) % chunk:
        return (f"gemv reads 16-byte chunks: K ({k}) and x's row stride ({x_row_stride(x)}) must be multiples "
                f"of {chunk} for {x.dtype.name}")
    if x.ptr % ACCESS_BYTES or weight.ptr % ACCESS_BYTES:
        return f"gemv needs x and weight 16-byte aligned, got x at 0x{x.ptr:x}, weight at 0x{weight.ptr:x}"
    return None


def gemv(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor | None,
         stream: Stream, split_k: SplitKWorkspace | None = None) -> None:
    """out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]); fp32 accumulation, out in x's dtype or fp32.

    x's rows may be spaced and out's too (unit column strides); the launch is graph-capturable.
    With `split_k`, K is split across blocks too (the workspace must stay this stream's)."""
    _launch(out, x, weight, bias, stream, split_k, silu_mul=False)


def silu_mul_gemv(out: DeviceTensor, gate_up: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor | None,
                  stream: Stream, split_k: SplitKWorkspace | None = None) -> None:
    """out [M, N] = (silu(gate) * up) @ weight [N, I]^T (+ bias [N]) for gate_up [M, 2I] = [gate | up]:
    `silu_and_mul` fused into the product, its values rounded to the dtype exactly as it stores them.

    out in gate_up's dtype; gate_up's rows may be spaced; otherwise as `gemv`."""
    require(gate_up.ndim == 2 and weight.ndim == 2 and gate_up.shape[1] == 2 * weight.shape[1],
            f"gate_up must be [M, 2I] for weight [N, I] = {weight.shape}, got {gate_up.shape}")
    require(out.dtype is gate_up.dtype, f"out must be {gate_up.dtype.name}, got {out.dtype.name}")
    require(gate_up.shape[0] <= SILU_MUL_MAX_M,
            f"the fused SiLU gemv runs 1 to {SILU_MUL_MAX_M} rows, got M = {gate_up.shape[0]}")
    # The kernel reads the gate half as x [M, I] and finds up I elements further along each row.
    _launch(out, gate_up.column_slice(0, weight.shape[1]), weight, bias, stream, split_k, silu_mul=True)


def _launch(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor | None, stream: Stream,
            split_k: SplitKWorkspace | None, silu_mul: bool) -> None:
    m, n, k = check_linear_operands(out, x, weight, bias)
    if m == 0 or n == 0:
        return
    reason = unsupported_reason(x, weight)
    require(reason is None, reason)
    chunks = k // (ACCESS_BYTES // x.dtype.itemsize)
    splits = split_k.splits(m, n, chunks) if split_k is not None else 1
    slice_chunks = -(-chunks // splits)
    warps = min(_MAX_WARPS, max(1, -(-slice_chunks // (32 * _CHUNKS_PER_THREAD))))
    tile = m_tile(m, SILU_MUL_M_TILES if silu_mul else M_TILES)
    kernel = get_kernel(_spec(x.dtype, out.dtype, tile, silu_mul))
    scratch = (split_k.partials, split_k.counters) if splits > 1 else (np.uint64(0), np.uint64(0))
    args = [out, x, weight, bias if bias is not None else np.uint64(0), *scratch, i32(m), i32(n), i32(k),
            np.int64(x_row_stride(x)), np.int64(out.row_stride)]
    kernel.launch((-(-n // _ROWS_PER_BLOCK), splits), 32 * warps, args, stream=stream)
