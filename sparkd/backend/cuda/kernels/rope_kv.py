"""RoPE fused with the paged KV-cache write (cukernels/rope_kv.cu)."""

from __future__ import annotations

import numpy as np

from ...base import RopeConfig
from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream
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

_SOURCE = "rope_kv.cu"
_MAX_THREADS = 512  # kRopeMaxThreads
MAX_HEAD_DIM = 256  # kRopeMaxHeadDim: a thread holds its chunks of a head in registers
# The kernel's layouts (rope_kv.cu): a thread holds 1 lane of head_inv_rms's (plain),
# or 4 (split: full rotary with as many vectors in a head as lanes).
_PLAIN, _SPLIT = 1, 4
QKNorm = tuple[DeviceTensor, DeviceTensor, float]  # (q_norm [D], k_norm [D], eps)


def rope_cos_sin(rope: RopeConfig, num_positions: int) -> np.ndarray:
    """The kernels' rotation table, [num_positions, rotary_dim] float32: cos(p * inv_freq) |
    sin(p * inv_freq), times attention_scaling."""
    angles = np.arange(num_positions, dtype=np.float64)[:, None] * np.asarray(rope.inv_freq, np.float64)[None, :]
    return (np.concatenate([np.cos(angles), np.sin(angles)], axis=1) * rope.attention_scaling).astype(np.float32)


def _kernel_name(dtype: DType, width: int, lanes_per_thread: int) -> str:
    return f"rope_write_kv_kernel<{dtype.c_type}, {width}, {lanes_per_thread}>"


SPECS = [KernelSpec(_SOURCE, _kernel_name(dtype, width, lanes_per_thread)) for dtype in ELEMENT_TYPES
         for width in vector_widths(dtype) for lanes_per_thread in (_PLAIN, _SPLIT)]


def rope_write_kv(q_out: DeviceTensor, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, positions: DeviceTensor,
                  cos_sin: DeviceTensor, k_cache: DeviceTensor, v_cache: DeviceTensor, slot_mapping: DeviceTensor,
                  stream: Stream, qk_norm: QKNorm | None = None) -> None:
    """Neox RoPE on q and k at `positions`, rotated k and v written to the paged caches;
    with `qk_norm`, each q and k head is RMS-normalised over D first (rmsnorm's
    arithmetic, rounded to q's dtype before the rotation), all in one launch.

    q: [T, Hq, D], k, v: [T, Hkv, D] (D <= MAX_HEAD_DIM), each with contiguous heads
      inside a token row (strides (row, D, 1): views of the fused qkv output are fine).
    positions, slot_mapping: [T] int32; a negative slot skips that token's cache write.
    cos_sin: [P, rotary_dim] float32 = cos | sin of position * inv_freq, times the
      attention scaling (llama3 scaling already in inv_freq); rotary_dim even,
      <= D. Only the first rotary_dim dims rotate. Positions must be < P.
    k_cache, v_cache: [NB, Hkv, BS, D] contiguous; slot = block * BS + offset.
    q_out: [T, Hq, D] contiguous, gets rotated q.
    qk_norm: None, or (q_norm [D], k_norm [D], eps) with the weights contiguous in q's dtype."""
    require(q.ndim == 3, f"q must be [T, Hq, D], got shape {q.shape}")
    num_tokens, num_q_heads, head_dim = q.shape
    require(k.ndim == 3 and v.shape == k.shape and k.shape[0] == num_tokens and k.shape[2] == head_dim,
            f"k and v must be [T={num_tokens}, Hkv, D={head_dim}], got {k.shape} and {v.shape}")
    num_kv_heads = k.shape[1]
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        require(tensor.dtype is q.dtype, f"{name} dtype {tensor.dtype.name} differs from q's {q.dtype.name}")
        require(tensor.strides[1:] == (head_dim, 1) or tensor.numel == 0,
                f"{name} heads must be contiguous inside a token row, got strides {tensor.strides}")
    require_dtype("q", q, *ELEMENT_TYPES)
    require(q_out.shape == q.shape and q_out.dtype is q.dtype, f"q_out must be {q.shape} {q.dtype.name}, got {q_out}")
    cache_shape = k_cache.shape
    require(len(cache_shape) == 4 and cache_shape[1] == num_kv_heads and cache_shape[3] == head_dim,
            f"k_cache must be [NB, Hkv={num_kv_heads}, BS, D={head_dim}], got {cache_shape}")
    require(v_cache.shape == cache_shape, f"v_cache {v_cache.shape} must match k_cache {cache_shape}")
    for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache)):
        require(tensor.dtype is q.dtype, f"{name} must be {q.dtype.name} like q, got {tensor.dtype.name}")
    for name, tensor in (("q_out", q_out), ("k_cache", k_cache), ("v_cache", v_cache), ("cos_sin", cos_sin),
                         ("positions", positions), ("slot_mapping", slot_mapping)):
        require_contiguous(name, tensor)
    for name, tensor in (("positions", positions), ("slot_mapping", slot_mapping)):
        require_dtype(name, tensor, DType.int32)
        require(tensor.shape == (num_tokens,), f"{name} must be [T={num_tokens}], got {tensor.shape}")
    require_dtype("cos_sin", cos_sin, DType.float32)
    require(cos_sin.ndim == 2, f"cos_sin must be [positions, rotary_dim], got {cos_sin.shape}")
    rotary_dim = cos_sin.shape[1]
    require(rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim,
            f"rotary_dim must be even and in [2, D={head_dim}], got {rotary_dim}")
    require(head_dim <= MAX_HEAD_DIM, f"head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")
    norm_weights = _check_qk_norm(qk_norm, q.dtype, head_dim)
    if num_tokens == 0:
        return

    row_strides = (q.strides[0], k.strides[0], v.strides[0])
    width = access_width(q_out, q, k, v, k_cache, v_cache, cos_sin, norm_weights)
    lanes_per_thread, group = _layout(head_dim // width, rotary_dim == head_dim)
    kernel = get_kernel(KernelSpec(_SOURCE, _kernel_name(q.dtype, width, lanes_per_thread)))
    norm_args = [*norm_weights, np.float32(qk_norm[2])] if qk_norm else [np.uint64(0), np.uint64(0), np.float32(0)]
    args = [q_out, k_cache, v_cache, q, k, v, positions, slot_mapping, cos_sin, *norm_args, i32(num_q_heads),
            i32(num_kv_heads), i32(head_dim), i32(rotary_dim), i32(cache_shape[2]), *(np.int64(s) for s in row_strides)]
    kernel.launch(*_token_grid((num_q_heads + 2 * num_kv_heads) * group, num_tokens), args, stream=stream)


def access_width(q_out: DeviceTensor, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, k_cache: DeviceTensor,
                 v_cache: DeviceTensor, cos_sin: DeviceTensor, norm_weights: tuple[DeviceTensor, ...]) -> int:
    """Elements per access of rope_write_kv on these operands (its kVec: the sums of
    squares go chunk by chunk of this width). The rotation pairs dim i with
    i + rotary_dim/2, so a vector may not straddle the half."""
    return vector_width(q.dtype, (q_out, q, k, v, k_cache, v_cache, cos_sin, *norm_weights),
                        (q.shape[2], cos_sin.shape[1] // 2, q.strides[0], k.strides[0], v.strides[0]))


def _layout(chunks: int, full_rotary: bool) -> tuple[int, int]:
    """(lanes per thread, threads per head) for heads of `chunks` vectors: the split
    layout where a head has as many vectors as the norm's lanes (lanes_per_head in
    rope_common.cuh: the next power of two, at most 32) and rotates whole, else plain."""
    lanes = min(32, 1 << (chunks - 1).bit_length())
    lanes_per_thread = _SPLIT if full_rotary and chunks == lanes >= _SPLIT else _PLAIN
    return lanes_per_thread, lanes // lanes_per_thread


def _token_grid(threads_per_token: int, num_tokens: int) -> tuple[tuple[int, int], int]:
    """(grid, block) giving each token threads_per_token threads (whole warps) in
    blocks of at most _MAX_THREADS: grid (T, parts)."""
    parts = -(-threads_per_token // _MAX_THREADS)
    return (num_tokens, parts), round_up(-(-threads_per_token // parts), 32)


def _check_qk_norm(qk_norm: QKNorm | None, dtype: DType, head_dim: int) -> tuple[DeviceTensor, ...]:
    """The norm weights (none without qk_norm) after checking them against q."""
    if qk_norm is None:
        return ()
    q_norm, k_norm, _ = qk_norm
    for name, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        require(weight.shape == (head_dim,) and weight.dtype is dtype,
                f"{name} must be [D={head_dim}] {dtype.name} like q, got {weight.shape} {weight.dtype.name}")
        require_contiguous(name, weight)
    return q_norm, k_norm
