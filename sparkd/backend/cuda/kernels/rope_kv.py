"""RoPE fused with the paged KV-cache write (cukernels/rope_kv.cu)."""

from __future__ import annotations

import numpy as np

from ...dtypes import DType
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

_SOURCE = "rope_kv.cu"
SPECS = element_specs(_SOURCE, "rope_write_kv_kernel")
_MAX_THREADS = 256
QKNorm = tuple[DeviceTensor, DeviceTensor, float]  # (q_norm [D], k_norm [D], eps)


def rope_write_kv(q_out: DeviceTensor, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, positions: DeviceTensor,
                  cos_sin: DeviceTensor, k_cache: DeviceTensor, v_cache: DeviceTensor, slot_mapping: DeviceTensor,
                  stream: Stream, qk_norm: QKNorm | None = None) -> None:
    """Neox RoPE on q and k at `positions`, rotated k and v written to the paged caches;
    with `qk_norm`, each q and k head is RMS-normalised over D first (rmsnorm's
    arithmetic, rounded to q's dtype before the rotation), all in one launch.

    q: [T, Hq, D], k, v: [T, Hkv, D], each with contiguous heads inside a token
      row (strides (row, D, 1): views of the fused qkv output are fine).
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
    norm_weights = _check_qk_norm(qk_norm, q.dtype, head_dim)
    if num_tokens == 0:
        return

    row_strides = (q.strides[0], k.strides[0], v.strides[0])
    # The rotation pairs dim i with i + rotary_dim/2, so a vector may not straddle the half.
    width = vector_width(q.dtype, (q_out, q, k, v, k_cache, v_cache, cos_sin, *norm_weights),
                         (head_dim, rotary_dim // 2, *row_strides))
    chunks = (num_q_heads + 2 * num_kv_heads) * head_dim // width
    kernel = get_kernel(KernelSpec(_SOURCE, element_name("rope_write_kv_kernel", q.dtype, width)))
    if qk_norm is None:
        norm_args, shared_mem = [np.uint64(0), np.uint64(0), np.float32(0)], 0
    else:  # the kernel keeps one inverse RMS per q and k head in shared memory
        norm_args, shared_mem = [*norm_weights, np.float32(qk_norm[2])], (num_q_heads + num_kv_heads) * 4
    args = [q_out, k_cache, v_cache, q, k, v, positions, slot_mapping, cos_sin, *norm_args, i32(num_q_heads),
            i32(num_kv_heads), i32(head_dim), i32(rotary_dim), i32(cache_shape[2]), *(np.int64(s) for s in row_strides)]
    kernel.launch(num_tokens, min(_MAX_THREADS, round_up(chunks, 32)), args, shared_mem=shared_mem, stream=stream)


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
