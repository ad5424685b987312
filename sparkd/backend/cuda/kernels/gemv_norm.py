"""Launchers of the skinny GEMM with its RMSNorm prologue (cukernels/gemv_norm.cu), at one row of x:

  residual' = x + residual (fp32; x itself when there is no residual), y = rmsnorm(residual') * norm_weight
  out = y @ weight^T (+ bias)                      gemv_norm
  out = silu(y @ gate^T) * (y @ up^T)              gemv_norm_silu_and_mul (weight = [gate | up])

A decode step of one sequence can run each of a layer's two norms inside the GEMV after it,
so that the norm's launch and its round trips overlap the GEMV's first weight loads
(`CudaOps.add_rmsnorm_linear`, while `CudaOps.fuse_norms` is on). y is the y of `norm.add_rmsnorm` (same fp32 formula, one
rounding), and the products are `gemv.gemv`'s on it.
"""

from __future__ import annotations

import numpy as np

from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream
from ..tensor import DeviceTensor
from . import ACCESS_BYTES, ELEMENT_TYPES, i32, overlaps, require
from .gemv import check_linear_operands

_SOURCE = "gemv_norm.cu"
_ROWS_PER_GROUP = 4  # kGemvRows: a plain group's weight rows; a gated group owns half as many columns
_MAX_WARPS = 8  # kGemvMaxWarps
CHUNK_COUNTS = (1, 2, 4)  # the kChunks instantiations: 16-byte x chunks a thread holds
# Groups of weight rows each block runs after computing the norm once. Not yet measured (a
# first guess: qkv's 1536 groups fill about two waves one a block; gate_up's 14336 would pay
# the norm 14336 times): `tools/bench_gemv_norm.py --groups ...` sweeps them.
GROUPS_PER_BLOCK = {"linear": 1, "silu_and_mul": 4}


def _spec(kind: str, dtype: DType, residual_dtype: DType, chunks: int) -> KernelSpec:
    kernel = "gemv_norm_kernel" if kind == "linear" else "gemv_norm_silu_and_mul_kernel"
    return KernelSpec(_SOURCE, f"{kernel}<{dtype.c_type}, {residual_dtype.c_type}, {chunks}>")


# The residual comes in the model dtype (the embedding, at the second layer's norm) or in fp32.
SPECS = [_spec(kind, dtype, residual_dtype, chunks) for kind in GROUPS_PER_BLOCK for dtype in ELEMENT_TYPES
         for residual_dtype in dict.fromkeys((dtype, DType.float32)) for chunks in CHUNK_COUNTS]


def _launch_shape(k: int, dtype: DType) -> tuple[int, int | None]:
    """(threads, kChunks) for K of `dtype`: gemv's one-row launch (a thread per 16-byte chunk,
    at most _MAX_WARPS warps), and the instantiated chunk count that covers K, or None."""
    chunks = k // (ACCESS_BYTES // dtype.itemsize)
    threads = 32 * min(_MAX_WARPS, max(1, -(-chunks // 32)))
    per_thread = -(-chunks // threads)
    return threads, next((c for c in CHUNK_COUNTS if c >= per_thread), None)


def unsupported_reason(x: DeviceTensor, residual: DeviceTensor | None, norm_weight: DeviceTensor,
                       weight: DeviceTensor) -> str | None:
    """Why the fused kernels cannot run rmsnorm(x + residual) @ weight^T (operands of `linear`
    otherwise valid), or None when they can."""
    m, k = x.shape
    if m != 1:
        return f"the fused norm runs one row of x, got M = {m}"
    if not x.is_contiguous or (residual is not None and not residual.is_contiguous):
        return "the fused norm reads x and the residual contiguous"
    if residual is not None and (residual.shape != x.shape or residual.dtype not in (x.dtype, DType.float32)):
        return f"residual must be {x.shape} in {x.dtype.name} or float32, got {residual}"
    if norm_weight.shape != (k,) or norm_weight.dtype is not x.dtype:
        return f"norm weight must be [{k}] {x.dtype.name}, got {norm_weight}"
    chunk = ACCESS_BYTES // x.dtype.itemsize
    if k % chunk:
        return f"the fused norm reads 16-byte chunks: K ({k}) must be a multiple of {chunk} for {x.dtype.name}"
    if _launch_shape(k, x.dtype)[1] is None:
        return f"K = {k} is longer than the fused norm's {CHUNK_COUNTS[-1]} chunks a thread hold"
    tensors = [x, norm_weight, weight] + ([residual] if residual is not None else [])
    if any(t.ptr % ACCESS_BYTES for t in tensors):
        return "the fused norm needs x, the residual, the norm weight and the weight 16-byte aligned"
    return None


def gemv_norm(out: DeviceTensor, residual_out: DeviceTensor | None, x: DeviceTensor, residual: DeviceTensor | None,
              norm_weight: DeviceTensor, eps: float, weight: DeviceTensor, bias: DeviceTensor | None, stream: Stream,
              groups_per_block: int | None = None) -> None:
    """out [1, N] = rmsnorm(x + residual) @ weight [N, K]^T (+ bias [N]), out in x's dtype, contiguous.

    x [1, K] in the model dtype; residual [1, K] in x's dtype or float32, or None (y = rmsnorm(x));
    residual_out [1, K] float32 gets x + residual (None with no residual), apart from x and
    residual. Graph-capturable."""
    check_linear_operands(out, x, weight, bias)
    require(out.dtype is x.dtype and out.is_contiguous, f"out must be contiguous in {x.dtype.name}, got {out}")
    _launch("linear", out, residual_out, x, residual, norm_weight, eps, weight, bias, weight.shape[0],
            -(-weight.shape[0] // _ROWS_PER_GROUP), stream, groups_per_block)


def gemv_norm_silu_and_mul(out: DeviceTensor, residual_out: DeviceTensor | None, x: DeviceTensor,
                           residual: DeviceTensor | None, norm_weight: DeviceTensor, eps: float,
                           weight: DeviceTensor, bias: DeviceTensor | None, stream: Stream,
                           groups_per_block: int | None = None) -> None:
    """out [1, I] = silu(y @ gate^T) * (y @ up^T), y = rmsnorm(x + residual), weight = [gate | up]
    [2I, K], bias [2I]; out contiguous in x's dtype. Each half rounded to x's dtype before the
    activation, as `gemv.gemv_silu_and_mul`. The other operands as `gemv_norm`."""
    n = weight.shape[0]
    require(n % 2 == 0 and out.shape == (1, n // 2) and out.dtype is x.dtype and out.is_contiguous,
            f"out must be a contiguous [1, {n // 2}] {x.dtype.name} for weight {weight.shape}, got {out}")
    check_linear_operands(DeviceTensor(out.ptr, (1, n), out.dtype), x, weight, bias)
    _launch("silu_and_mul", out, residual_out, x, residual, norm_weight, eps, weight, bias, n // 2,
            -(-(n // 2) // (_ROWS_PER_GROUP // 2)), stream, groups_per_block)


def _launch(kind: str, out: DeviceTensor, residual_out: DeviceTensor | None, x: DeviceTensor,
            residual: DeviceTensor | None, norm_weight: DeviceTensor, eps: float, weight: DeviceTensor,
            bias: DeviceTensor | None, width: int, num_groups: int, stream: Stream,
            groups_per_block: int | None) -> None:
    """Checks what both kernels share, then launches `kind` over num_groups groups; width: N or I."""
    reason = unsupported_reason(x, residual, norm_weight, weight)
    require(reason is None, reason)
    if residual is None:
        require(residual_out is None, "with no residual there is no residual_out: the residual stays x")
    else:
        require(residual_out is not None and residual_out.shape == x.shape and residual_out.dtype is DType.float32
                and residual_out.is_contiguous and residual_out.ptr % ACCESS_BYTES == 0,
                f"residual_out must be a contiguous, 16-byte aligned {x.shape} float32, got {residual_out}")
        require(not any(overlaps(residual_out, t) for t in (x, residual)),
                "residual_out must not overlap x or the residual: other blocks still read them")
    if width == 0:
        return
    per_block = groups_per_block or GROUPS_PER_BLOCK[kind]
    require(per_block >= 1, f"groups_per_block must be at least 1, got {per_block}")
    threads, chunks = _launch_shape(x.shape[1], x.dtype)
    residual_dtype = residual.dtype if residual is not None else x.dtype
    args = [out, residual_out if residual_out is not None else np.uint64(0), x,
            residual if residual is not None else np.uint64(0), norm_weight, np.float32(eps), weight,
            bias if bias is not None else np.uint64(0), i32(width), i32(x.shape[1]), i32(per_block)]
    get_kernel(_spec(kind, x.dtype, residual_dtype, chunks)).launch(-(-num_groups // per_block), threads, args,
                                                                    stream=stream)
