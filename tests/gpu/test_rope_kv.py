"""RoPE + paged KV write kernel vs NumpyOps.rope_write_kv.

q, k and v are views of one fused qkv buffer, as the model passes them. The
caches start with random contents so that untouched slots are checked too.
Relative error: max |gpu - ref| / max |ref|."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.base import AttentionMetadata, RopeConfig
from sparkd.backend.cpu.ops import NumpyOps
from sparkd.backend.cuda.kernels import rope_kv

pytestmark = pytest.mark.gpu
DTYPES = ["float32", "bfloat16", "float16"]
CASES = [  # tokens, q heads, kv heads, head dim, rotary dim, block size, scaling
    (1, 4, 2, 64, 64, 16, 1.0),
    (7, 8, 8, 128, 128, 16, 1.0),
    (33, 6, 2, 128, 64, 32, 0.9),  # partial rotary, scaled cos/sin
    (5, 2, 1, 36, 20, 8, 1.0),  # rotary half 10: no vector access fits, scalar path
    (64, 32, 8, 128, 128, 16, 1.0),  # Llama-3-8B shaped
]


def _cos_sin(rope: RopeConfig, num_positions: int) -> np.ndarray:
    """[P, rotary_dim] float32: cos | sin of position * inv_freq, times the attention scaling."""
    angles = np.arange(num_positions, dtype=np.float64)[:, None] * rope.inv_freq[None, :]
    return (np.concatenate([np.cos(angles), np.sin(angles)], axis=1) * rope.attention_scaling).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim,rotary_dim,block_size,scaling", CASES)
def test_rope_write_kv_matches_numpy(gpu, rel_error, tolerance, dtype, tokens, q_heads, kv_heads, head_dim,
                                     rotary_dim, block_size, scaling):
    rng = np.random.default_rng(tokens * 1000 + head_dim + rotary_dim)
    num_blocks, max_position = 6, 5000
    rope = RopeConfig(rotary_dim, 1.0 / 500000.0 ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim),
                      attention_scaling=scaling)
    positions = rng.integers(0, max_position, size=tokens).astype(np.int32)
    positions[0] = max_position - 1  # the last row of the table
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(np.int32)
    if tokens > 1:
        slots[-1] = -1  # a padding token: no cache write
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = gpu.upload(rng.standard_normal((tokens, width), dtype=np.float32), dtype)
    cache_shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = gpu.upload(rng.standard_normal(cache_shape, dtype=np.float32), dtype)
    v_cache = gpu.upload(rng.standard_normal(cache_shape, dtype=np.float32), dtype)
    k_ref, v_ref, qkv_host = gpu.download(k_cache), gpu.download(v_cache), gpu.download(qkv)

    q_width, kv_width = q_heads * head_dim, kv_heads * head_dim
    views = [qkv.column_slice(start, heads * head_dim).split_last(heads, head_dim)
             for start, heads in ((0, q_heads), (q_width, kv_heads), (q_width + kv_width, kv_heads))]
    q_out = gpu.empty((tokens, q_heads, head_dim), dtype)
    rope_kv.rope_write_kv(q_out, *views, gpu.upload(positions), gpu.upload(_cos_sin(rope, max_position)),
                          k_cache, v_cache, gpu.upload(slots), gpu.stream)

    q, k, v = NumpyOps().split_heads(qkv_host, q_heads, kv_heads, head_dim)
    meta = AttentionMetadata(
        query_start_loc=np.arange(tokens + 1, dtype=np.int32), seq_lens=positions + 1,
        block_tables=np.zeros((tokens, 1), np.int32), slot_mapping=slots, max_query_len=1,
        max_seq_len=int(positions.max()) + 1)
    ops = NumpyOps()
    q_ref = ops.rope_write_kv(q, k, v, positions, rope, k_ref, v_ref, ops.prepare_attention(meta))
    assert rel_error(gpu.download(q_out), q_ref) <= tolerance[dtype]
    assert rel_error(gpu.download(k_cache), k_ref) <= tolerance[dtype]
    np.testing.assert_array_equal(gpu.download(v_cache), v_ref)  # v is copied, untouched slots stay


def test_rejects_odd_rotary_dim(gpu):
    q = gpu.empty((1, 2, 8), "float32")
    k = gpu.empty((1, 1, 8), "float32")
    cache = gpu.empty((1, 1, 4, 8), "float32")
    ids = gpu.upload(np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        rope_kv.rope_write_kv(gpu.empty((1, 2, 8), "float32"), q, k, k, ids, gpu.empty((4, 3), "float32"),
                              cache, cache, ids, gpu.stream)
