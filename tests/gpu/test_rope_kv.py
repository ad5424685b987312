"""RoPE + paged KV write kernel vs NumpyOps.rope_write_kv, plain and with the fused
per-head q/k RMSNorm (vs NumpyOps.rmsnorm on q and k, then NumpyOps.rope_write_kv).

q, k and v are views of one fused qkv buffer, as the model passes them. The
caches start with random contents so that untouched slots are checked too.
Relative error: max |gpu - ref| / max |ref|."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sparkd.backend.base import AttentionMetadata, RopeConfig
from sparkd.backend.cpu.ops import NumpyOps
from sparkd.backend.cuda.kernels import rope_kv
from sparkd.models.config import rope_config

pytestmark = pytest.mark.gpu
DTYPES = ["float32", "bfloat16", "float16"]
NUM_BLOCKS, MAX_POSITION, EPS = 6, 5000, 1e-6
CASES = [  # tokens, q heads, kv heads, head dim, rotary dim, block size, scaling
    (1, 4, 2, 64, 64, 16, 1.0),
    (7, 8, 8, 128, 128, 16, 1.0),
    (33, 6, 2, 128, 64, 32, 0.9),  # partial rotary, scaled cos/sin
    (5, 2, 1, 36, 20, 8, 1.0),  # rotary half 10: no vector access fits, scalar path
    (64, 32, 8, 128, 128, 16, 1.0),  # Llama-3-8B shaped
]
LLAMA3_SCALING = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
NORM_CASES = [  # tokens, q heads, kv heads, head dim, block size, rope parameters (transformers 5 layout)
    (1, 32, 4, 128, 16, {"rope_theta": 1000000.0}),  # Qwen3-30B-A3B decode: 36 heads, several norm passes
    (70, 32, 4, 128, 16, {"rope_theta": 1000000.0}),  # its prefill
    (1, 3, 1, 64, 8, {"rope_theta": 10000.0}),  # odd head counts
    (9, 9, 3, 128, 16, LLAMA3_SCALING),
    (17, 5, 5, 128, 32, {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    (6, 7, 1, 256, 16, {"rope_theta": 10000.0, "partial_rotary_factor": 0.25}),  # more chunks than a warp per head
    (5, 2, 1, 36, 8, {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}),  # rotary half 9: scalar path
]


def _cos_sin(rope: RopeConfig, num_positions: int) -> np.ndarray:
    """[P, rotary_dim] float32: cos | sin of position * inv_freq, times the attention scaling."""
    angles = np.arange(num_positions, dtype=np.float64)[:, None] * rope.inv_freq[None, :]
    return (np.concatenate([np.cos(angles), np.sin(angles)], axis=1) * rope.attention_scaling).astype(np.float32)


def _check_against_numpy(gpu, rel_error, tolerance, dtype, rng, tokens, q_heads, kv_heads, head_dim, block_size,
                         rope: RopeConfig, with_norm: bool) -> None:
    """Runs the kernel on random inputs (heads scaled 0.05..20x so the norm matters) and
    compares rotated q, both whole caches and the v copy with the numpy twin."""
    positions = rng.integers(0, MAX_POSITION, size=tokens).astype(np.int32)
    positions[0] = MAX_POSITION - 1  # the last row of the table
    slots = rng.permutation(NUM_BLOCKS * block_size)[:tokens].astype(np.int32)
    if tokens > 1:
        slots[-1] = -1  # a padding token: no cache write
    num_heads = q_heads + 2 * kv_heads
    head_scales = rng.uniform(0.05, 20.0, size=(tokens, num_heads, 1)) if with_norm else 1.0
    qkv_rows = (rng.standard_normal((tokens, num_heads, head_dim)) * head_scales).reshape(tokens, -1)
    qkv = gpu.upload(qkv_rows.astype(np.float32), dtype)
    cache_shape = (NUM_BLOCKS, kv_heads, block_size, head_dim)
    k_cache = gpu.upload(rng.standard_normal(cache_shape, dtype=np.float32), dtype)
    v_cache = gpu.upload(rng.standard_normal(cache_shape, dtype=np.float32), dtype)
    k_ref, v_ref, qkv_host = gpu.download(k_cache), gpu.download(v_cache), gpu.download(qkv)
    norm_weights = [gpu.upload((1.0 + 0.5 * rng.standard_normal(head_dim)).astype(np.float32), dtype)
                    for _ in range(2)] if with_norm else []

    q_width, kv_width = q_heads * head_dim, kv_heads * head_dim
    views = [qkv.column_slice(start, heads * head_dim).split_last(heads, head_dim)
             for start, heads in ((0, q_heads), (q_width, kv_heads), (q_width + kv_width, kv_heads))]
    q_out = gpu.empty((tokens, q_heads, head_dim), dtype)
    rope_kv.rope_write_kv(q_out, *views, gpu.upload(positions), gpu.upload(_cos_sin(rope, MAX_POSITION)),
                          k_cache, v_cache, gpu.upload(slots), gpu.stream,
                          (*norm_weights, EPS) if with_norm else None)

    ops = NumpyOps()
    q, k, v = ops.split_heads(qkv_host, q_heads, kv_heads, head_dim)
    if with_norm:  # the unfused reference: two rmsnorms, then the plain rotation
        q_norm, k_norm = (gpu.download(weight) for weight in norm_weights)
        q, k = ops.rmsnorm(q, q_norm, EPS), ops.rmsnorm(k, k_norm, EPS)
    meta = AttentionMetadata(
        query_start_loc=np.arange(tokens + 1, dtype=np.int32), seq_lens=positions + 1,
        block_tables=np.zeros((tokens, 1), np.int32), slot_mapping=slots, max_query_len=1,
        max_seq_len=int(positions.max()) + 1)
    q_ref = ops.rope_write_kv(q, k, v, positions, rope, k_ref, v_ref, ops.prepare_attention(meta))
    assert rel_error(gpu.download(q_out), q_ref) <= tolerance[dtype]
    assert rel_error(gpu.download(k_cache), k_ref) <= tolerance[dtype]
    np.testing.assert_array_equal(gpu.download(v_cache), v_ref)  # v is copied, untouched slots stay


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim,rotary_dim,block_size,scaling", CASES)
def test_rope_write_kv_matches_numpy(gpu, rel_error, tolerance, dtype, tokens, q_heads, kv_heads, head_dim,
                                     rotary_dim, block_size, scaling):
    rng = np.random.default_rng(tokens * 1000 + head_dim + rotary_dim)
    rope = RopeConfig(rotary_dim, 1.0 / 500000.0 ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim),
                      attention_scaling=scaling)
    _check_against_numpy(gpu, rel_error, tolerance, dtype, rng, tokens, q_heads, kv_heads, head_dim, block_size,
                         rope, with_norm=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim,block_size,rope_parameters", NORM_CASES)
def test_fused_qk_norm_matches_rmsnorm_then_rope(gpu, rel_error, tolerance, dtype, tokens, q_heads, kv_heads,
                                                 head_dim, block_size, rope_parameters):
    rng = np.random.default_rng(tokens * 1000 + q_heads * 10 + head_dim)
    rope = rope_config({"rope_parameters": rope_parameters, "max_position_embeddings": MAX_POSITION}, head_dim)
    _check_against_numpy(gpu, rel_error, tolerance, dtype, rng, tokens, q_heads, kv_heads, head_dim, block_size,
                         rope, with_norm=True)


def test_fused_qk_norm_with_attention_scaling(gpu, rel_error, tolerance):
    """Scaled cos/sin with the norm: the scaling applies to the normalised values."""
    rope = dataclasses.replace(rope_config({"rope_parameters": {"rope_theta": 10000.0}}, 64), attention_scaling=0.9)
    _check_against_numpy(gpu, rel_error, tolerance, "float32", np.random.default_rng(5), 4, 4, 2, 64, 16, rope,
                         with_norm=True)


def _write_one_token(gpu, cos_sin_width: int, qk_norm=None) -> None:
    """rope_write_kv on one token (2 q heads, 1 kv head, D 8, fp32) with a cos/sin table of
    `cos_sin_width` columns: what the precondition tests vary."""
    q, k = gpu.empty((1, 2, 8), "float32"), gpu.empty((1, 1, 8), "float32")
    cache = gpu.empty((1, 1, 4, 8), "float32")
    ids = gpu.upload(np.zeros(1, np.int32))
    rope_kv.rope_write_kv(gpu.empty((1, 2, 8), "float32"), q, k, k, ids, gpu.empty((4, cos_sin_width), "float32"),
                          cache, cache, ids, gpu.stream, qk_norm)


def test_rejects_odd_rotary_dim(gpu):
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        _write_one_token(gpu, cos_sin_width=3)


def test_rejects_norm_weight_of_wrong_size(gpu):
    with pytest.raises(ValueError, match="k_norm must be"):
        _write_one_token(gpu, cos_sin_width=8, qk_norm=(gpu.empty((8,), "float32"), gpu.empty((4,), "float32"), 1e-6))
