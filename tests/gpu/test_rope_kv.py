"""RoPE + paged KV write kernel vs NumpyOps.rope_write_kv, plain and with the fused
per-head q/k RMSNorm (vs NumpyOps.rmsnorm on q and k, then NumpyOps.rope_write_kv);
and bit for bit against a numpy twin of its exact arithmetic (rope_common.cuh's, which
the fused decode attention shares: fma sums of squares over lanes_per_head lanes and
their butterfly, IEEE division, square root and reciprocal, separate multiplies for the
norm, fma for the rotation).

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
from sparkd.backend.dtypes import DType, decode, encode
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


@dataclasses.dataclass
class Step:
    """One rope_write_kv launch on random inputs (heads scaled 0.05..20x with the norm, so
    it matters; the first token at the table's last position, the last a padding token
    when T > 1) and the device inputs and caches as they were before it, on the host."""

    qkv_host: np.ndarray  # [T, (Hq + 2 Hkv) D]
    k_cache: np.ndarray
    v_cache: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    cos_sin: np.ndarray
    norm_weights: list  # [q_norm, k_norm] on the host, or empty
    q_out: np.ndarray  # the launch's results
    k_cache_out: np.ndarray
    v_cache_out: np.ndarray
    width: int  # the launch's vector width


def _launch(gpu, dtype, rng, tokens, q_heads, kv_heads, head_dim, block_size, rope: RopeConfig,
            with_norm: bool) -> Step:
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
    k_before, v_before, qkv_host = gpu.download(k_cache), gpu.download(v_cache), gpu.download(qkv)
    norm_weights = [gpu.upload((1.0 + 0.5 * rng.standard_normal(head_dim)).astype(np.float32), dtype)
                    for _ in range(2)] if with_norm else []

    q_width, kv_width = q_heads * head_dim, kv_heads * head_dim
    views = [qkv.column_slice(start, heads * head_dim).split_last(heads, head_dim)
             for start, heads in ((0, q_heads), (q_width, kv_heads), (q_width + kv_width, kv_heads))]
    q_out = gpu.empty((tokens, q_heads, head_dim), dtype)
    cos_sin = _cos_sin(rope, MAX_POSITION)
    cos_sin_device = gpu.upload(cos_sin)
    rope_kv.rope_write_kv(q_out, *views, gpu.upload(positions), cos_sin_device, k_cache, v_cache, gpu.upload(slots),
                          gpu.stream, (*norm_weights, EPS) if with_norm else None)
    width = rope_kv.access_width(q_out, *views, k_cache, v_cache, cos_sin_device, tuple(norm_weights))
    return Step(qkv_host, k_before, v_before, positions, slots, cos_sin,
                [gpu.download(weight) for weight in norm_weights],
                gpu.download(q_out), gpu.download(k_cache), gpu.download(v_cache), width)


def _check_against_numpy(gpu, rel_error, tolerance, dtype, rng, tokens, q_heads, kv_heads, head_dim, block_size,
                         rope: RopeConfig, with_norm: bool) -> None:
    """Runs the kernel on random inputs and compares rotated q, both whole caches and the
    v copy with NumpyOps."""
    step = _launch(gpu, dtype, rng, tokens, q_heads, kv_heads, head_dim, block_size, rope, with_norm)
    ops = NumpyOps()
    q, k, v = ops.split_heads(step.qkv_host, q_heads, kv_heads, head_dim)
    if with_norm:  # the unfused reference: two rmsnorms, then the plain rotation
        q_norm, k_norm = step.norm_weights
        q, k = ops.rmsnorm(q, q_norm, EPS), ops.rmsnorm(k, k_norm, EPS)
    meta = AttentionMetadata(
        query_start_loc=np.arange(tokens + 1, dtype=np.int32), seq_lens=step.positions + 1,
        block_tables=np.zeros((tokens, 1), np.int32), slot_mapping=step.slots, max_query_len=1,
        max_seq_len=int(step.positions.max()) + 1)
    k_ref, v_ref = step.k_cache.copy(), step.v_cache.copy()
    q_ref = ops.rope_write_kv(q, k, v, step.positions, rope, k_ref, v_ref, ops.prepare_attention(meta))
    assert rel_error(step.q_out, q_ref) <= tolerance[dtype]
    assert rel_error(step.k_cache_out, k_ref) <= tolerance[dtype]
    np.testing.assert_array_equal(step.v_cache_out, v_ref)  # v is copied, untouched slots stay


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


# ---- bit for bit: a numpy twin of the kernel's arithmetic ----

def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once, as __fmaf_rn: the product of two float32 is exact in
    float64; the sum is rounded to odd there (the exact error by TwoSum), and 53 bits
    >= 24 + 2 make rounding that to float32 correct."""
    product, addend = a.astype(np.float64) * b.astype(np.float64), c.astype(np.float64)
    total = product + addend
    back = total - product
    error = (product - (total - back)) + (addend - back)
    even = (total.view(np.int64) & 1) == 0
    towards = np.where(error > 0, np.inf, -np.inf)
    return np.where((error != 0) & even, np.nextafter(total, towards), total).astype(np.float32)


def _inv_rms(heads: np.ndarray, width: int, eps: float) -> np.ndarray:
    """[N, D] float32 -> [N] float32 as head_inv_rms: lane l of lanes_per_head(D / width)
    adds chunks l, l + lanes, ... (fma, value by value), a butterfly over the lanes, then
    1 / sqrt(sum / D + eps), each step rounded once in float32."""
    num_heads, head_dim = heads.shape
    chunks = head_dim // width
    lanes = min(32, 1 << (chunks - 1).bit_length())
    sums = np.zeros((num_heads, lanes), np.float32)
    for first in range(0, chunks, lanes):  # lane l adds chunk first + l
        count = min(lanes, chunks - first)
        for i in range(width):
            values = heads[:, (first + np.arange(count)) * width + i]
            sums[:, :count] = _fma(values, values, sums[:, :count])
    offset = lanes // 2
    while offset:
        sums = sums + sums[:, np.arange(lanes) ^ offset]
        offset //= 2
    return np.float32(1) / np.sqrt(sums[:, 0] / np.float32(head_dim) + np.float32(eps))


def _rotate(heads: np.ndarray, cos_sin_rows: np.ndarray) -> np.ndarray:
    """[N, D] float32 at cos_sin_rows [N, rotary_dim]: x * cos -+ fma partner * sin."""
    half = cos_sin_rows.shape[1] // 2
    cos, sin = cos_sin_rows[:, :half], cos_sin_rows[:, half:]
    first, second = heads[:, :half], heads[:, half:2 * half]
    out = heads.copy()
    out[:, :half] = _fma(first, cos, -(second * sin))
    out[:, half:2 * half] = _fma(second, cos, first * sin)
    return out


def _kernel_twin(step: Step, dtype: str, q_heads: int, kv_heads: int, head_dim: int) -> tuple[np.ndarray, ...]:
    """(q_out, k_cache, v_cache) as rope_write_kv_kernel computes them, from the step's inputs."""
    storage = DType.parse(dtype)

    def stored(x: np.ndarray) -> np.ndarray:
        return np.asarray(decode(encode(x, storage), storage), np.float32)

    tokens = len(step.positions)
    rows = step.cos_sin[step.positions]
    heads = step.qkv_host.astype(np.float32).reshape(tokens, -1, head_dim)

    def rope(x: np.ndarray, norm_weight: np.ndarray | None) -> np.ndarray:
        flat = x.reshape(-1, head_dim)
        if norm_weight is not None:
            flat = stored((flat * _inv_rms(flat, step.width, EPS)[:, None]) * norm_weight.astype(np.float32))
        return stored(_rotate(flat, np.repeat(rows, x.shape[1], axis=0))).reshape(x.shape)

    q_norm, k_norm = step.norm_weights or (None, None)
    q_out = rope(heads[:, :q_heads], q_norm)
    k_rotated = rope(heads[:, q_heads:q_heads + kv_heads], k_norm)
    k_cache, v_cache = step.k_cache.copy(), step.v_cache.copy()
    block_size = k_cache.shape[2]
    for token in np.flatnonzero(step.slots >= 0):
        block, offset = divmod(int(step.slots[token]), block_size)
        k_cache[block, :, offset] = k_rotated[token]
        v_cache[block, :, offset] = heads[token, q_heads + kv_heads:]
    return q_out, k_cache, v_cache


def _bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """The stored bits of values held as `dtype` (bf16 as float32, whose low half is zero)."""
    x = np.ascontiguousarray(x, np.float16 if dtype == "float16" else np.float32)
    return x.view(np.uint16 if dtype == "float16" else np.uint32)


BIT_CASES = [  # tokens, q heads, kv heads, head dim, rotary dim, norm
    (5, 4, 2, 64, 64, True),
    (33, 32, 4, 128, 128, True),  # Qwen3-30B-A3B heads
    (7, 8, 8, 128, 128, False),
    (9, 32, 4, 128, 64, True),  # partial rotary: partners by shuffle, 640+ threads: blocks share a token
    (3, 7, 1, 256, 256, True),  # fp32: 64 vectors a head, 2 a lane
    (6, 4, 2, 256, 64, False),
    (5, 2, 1, 36, 20, True),  # scalar: 36 values on 32 lanes
    (4, 3, 1, 36, 36, False),  # scalar, full rotary: partners in another register of another lane
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim,rotary_dim,with_norm", BIT_CASES)
def test_bits_equal_the_arithmetic_twin(gpu, dtype, tokens, q_heads, kv_heads, head_dim, rotary_dim, with_norm):
    """q_out and both whole caches (untouched slots too) equal the twin's bit for bit."""
    rng = np.random.default_rng(tokens * 100 + head_dim + rotary_dim)
    rope = RopeConfig(rotary_dim, 1.0 / 10000.0 ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim),
                      attention_scaling=0.9)
    step = _launch(gpu, dtype, rng, tokens, q_heads, kv_heads, head_dim, 16, rope, with_norm)
    for actual, expected in zip((step.q_out, step.k_cache_out, step.v_cache_out),
                                _kernel_twin(step, dtype, q_heads, kv_heads, head_dim)):
        np.testing.assert_array_equal(_bits(actual, dtype), _bits(expected, dtype))


def _write_one_token(gpu, cos_sin_width: int, qk_norm=None, head_dim: int = 8) -> None:
    """rope_write_kv on one token (2 q heads, 1 kv head, fp32) with a cos/sin table of
    `cos_sin_width` columns: what the precondition tests vary."""
    q, k = gpu.empty((1, 2, head_dim), "float32"), gpu.empty((1, 1, head_dim), "float32")
    cache = gpu.empty((1, 1, 4, head_dim), "float32")
    ids = gpu.upload(np.zeros(1, np.int32))
    rope_kv.rope_write_kv(gpu.empty((1, 2, head_dim), "float32"), q, k, k, ids,
                          gpu.empty((4, cos_sin_width), "float32"), cache, cache, ids, gpu.stream, qk_norm)


def test_rejects_odd_rotary_dim(gpu):
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        _write_one_token(gpu, cos_sin_width=3)


def test_rejects_norm_weight_of_wrong_size(gpu):
    with pytest.raises(ValueError, match="k_norm must be"):
        _write_one_token(gpu, cos_sin_width=8, qk_norm=(gpu.empty((8,), "float32"), gpu.empty((4,), "float32"), 1e-6))


def test_rejects_heads_longer_than_a_thread_holds(gpu):
    with pytest.raises(ValueError, match="head_dim must be at most 256"):
        _write_one_token(gpu, cos_sin_width=264, head_dim=264)
