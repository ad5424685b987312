"""Paged attention kernels against numpy: an independent dense formula in float64, and
the numpy backend's paged_attention.

Relative error is max |out - ref| / max |ref| over the whole output: <= 1e-5 in fp32,
<= 1e-2 in bf16/fp16. Inputs are rounded to the dtype first, so the reference sees
what the device holds. Unused cache slots are poisoned (NaN or a large value), so a
kernel that reads past a sequence, or through a wrong block, fails loudly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pytest

from sparkd.backend.base import AttentionMetadata
from sparkd.backend.dtypes import DType

attention = pytest.importorskip("sparkd.backend.cuda.kernels.attention")
from cuda.bindings import driver

from sparkd.backend.cuda.attention_metadata import CudaAttentionMetadata
from sparkd.backend.cuda.driver import call
from sparkd.backend.cuda.graphs import capture
from sparkd.backend.cuda.kernels.attention_plan import FULL_BATCH_MAX_SPLITS, SPLIT_ALIGN, DecodePlan
from sparkd.backend.cuda.transfer import copy_to_device

from .attention_plans import h200_plan

DTYPES = ["float32", "bfloat16", "float16"]


@dataclass
class Batch:
    """One step on the host: q [T, Hq, D], caches [NB, Hkv, BS, D], and its metadata."""

    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    meta: AttentionMetadata


def make_batch(rng, query_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size,
               poison=np.nan) -> Batch:
    """Sequences whose blocks are scattered over the cache; every slot that is not a key is `poison`."""
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3  # spare blocks hold only poison
    order = rng.permutation(num_blocks)
    block_tables = np.zeros((len(seq_lens), max(blocks_needed)), np.int32)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache, v_cache = np.full(shape, poison, np.float32), np.full(shape, poison, np.float32)
    slots, used = [], 0
    for s, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        block_tables[s, :blocks_needed[s]] = order[used:used + blocks_needed[s]]
        used += blocks_needed[s]
        pos = np.arange(seq_len)
        blocks, offsets = block_tables[s, pos // block_size], pos % block_size
        k_cache[blocks, :, offsets] = rng.standard_normal((seq_len, num_kv_heads, head_dim))
        v_cache[blocks, :, offsets] = rng.standard_normal((seq_len, num_kv_heads, head_dim))
        slots.append(blocks[seq_len - query_len:] * block_size + offsets[seq_len - query_len:])
    # A scale of 3 makes the softmax peaked, so the output is O(1) even over 32k keys.
    q = 3 * rng.standard_normal((sum(query_lens), num_q_heads, head_dim)).astype(np.float32)
    meta = AttentionMetadata(
        query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32),
        seq_lens=np.asarray(seq_lens, np.int32), block_tables=block_tables,
        slot_mapping=np.concatenate(slots).astype(np.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    return Batch(q, k_cache, v_cache, meta)


def dense_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> np.ndarray:
    """softmax(q k^T * scale, causal) v per sequence, in float64, keys gathered from the blocks."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    # Query head h reads kv head h // group.
    q_grouped = q.astype(np.float64).reshape(num_tokens, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = np.zeros(q_grouped.shape)
    for s, seq_len in enumerate(meta.seq_lens):
        start, end = meta.query_start_loc[s], meta.query_start_loc[s + 1]
        pos = np.arange(seq_len)
        blocks, offsets = meta.block_tables[s, pos // block_size], pos % block_size
        keys = k_cache[blocks, :, offsets].astype(np.float64)  # [L, Hkv, D]
        values = v_cache[blocks, :, offsets].astype(np.float64)
        scores = np.einsum("tkgd,lkd->kgtl", q_grouped[start:end], keys) * scale
        query_pos = seq_len - (end - start) + np.arange(end - start)
        scores[..., pos[None, :] > query_pos[:, None]] = -np.inf
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out[start:end] = np.einsum("kgtl,lkd->tkgd", probs, values)
    return out.reshape(q.shape)


def upload_meta(gpu, meta: AttentionMetadata, max_seq_len: int | None = None) -> CudaAttentionMetadata:
    def up(array):
        return gpu.upload(np.ascontiguousarray(array, np.int32), DType.int32)

    return CudaAttentionMetadata(up(meta.query_start_loc), up(meta.seq_lens), up(meta.block_tables),
                                 up(meta.slot_mapping), meta.max_query_len, max_seq_len or meta.max_seq_len)


def run(gpu, batch: Batch, dtype: str, scale: float, decode: bool, max_seq_len: int | None = None,
        workspace: bool = True):
    """(device output, (q, k_cache, v_cache) as the device holds them), as float32 host arrays."""
    q, k_cache, v_cache = (gpu.upload(a, dtype) for a in (batch.q, batch.k_cache, batch.v_cache))
    meta = upload_meta(gpu, batch.meta, max_seq_len)
    out = gpu.empty(q.shape, q.dtype)
    if decode:
        numel = attention.decode_workspace_numel(q, k_cache, meta) if workspace else 0
        space = gpu.empty((numel,), DType.float32) if numel else None
        attention.decode_attention(out, q, k_cache, v_cache, meta, scale, gpu.stream, workspace=space)
    else:
        attention.prefill_attention(out, q, k_cache, v_cache, meta, scale, gpu.stream)
    return gpu.download(out), tuple(gpu.download(t).astype(np.float32) for t in (q, k_cache, v_cache))


# query lengths and contexts of one mixed step: a single token, a fresh odd prompt, a chunk
# after cached context, a decode riding along, a chunk ending on a block boundary, a long prompt.
MIXED = ([1, 7, 17, 1, 48, 300], [1, 7, 40, 301, 64, 300])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,block_size", [(8, 2, 16), (7, 7, 5), (12, 1, 32)])
def test_prefill_matches_dense(gpu, rel_error, tolerance, dtype, head_dim, num_q_heads, num_kv_heads, block_size):
    rng = np.random.default_rng(head_dim + num_q_heads)
    batch = make_batch(rng, *MIXED, num_q_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim ** -0.5
    out, (q, k_cache, v_cache) = run(gpu, batch, dtype, scale, decode=False)
    assert rel_error(out, dense_attention(q, k_cache, v_cache, batch.meta, scale)) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_matches_numpy_backend(gpu, rel_error, tolerance, dtype):
    from sparkd.backend.cpu.attention import paged_attention, plan_attention

    # The numpy backend reads padded positions and zeroes them by probability, so poison must be finite.
    batch = make_batch(np.random.default_rng(1), *MIXED, 8, 2, 128, 16, poison=1e4)
    out, (q, k_cache, v_cache) = run(gpu, batch, dtype, 0.1, decode=False)
    expected = paged_attention(q, k_cache, v_cache, plan_attention(batch.meta), 0.1)
    assert rel_error(out, expected) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_matches_dense(gpu, rel_error, tolerance, dtype, head_dim):
    seq_lens = [1, 15, 16, 17, 100, 1000, 4097]
    batch = make_batch(np.random.default_rng(head_dim), [1] * len(seq_lens), seq_lens, 8, 2, head_dim, 16)
    scale = head_dim ** -0.5
    out, (q, k_cache, v_cache) = run(gpu, batch, dtype, scale, decode=True)
    assert rel_error(out, dense_attention(q, k_cache, v_cache, batch.meta, scale)) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_split_k_over_32k_context(gpu, rel_error, tolerance, dtype):
    seq_lens = [32768, 20001]
    assert h200_plan(2, 8, 2, 128, dtype, 32768).num_parts > 1  # the case really merges parts through the workspace
    batch = make_batch(np.random.default_rng(2), [1, 1], seq_lens, 8, 2, 128, 16)
    out, (q, k_cache, v_cache) = run(gpu, batch, dtype, 128 ** -0.5, decode=True)
    assert rel_error(out, dense_attention(q, k_cache, v_cache, batch.meta, 128 ** -0.5)) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("max_seq_len", [32768, 131072])
def test_decode_with_loose_max_seq_len_as_in_a_graph(gpu, rel_error, tolerance, dtype, max_seq_len):
    """A captured graph sizes its grid for the longest context it serves; shorter ones must still be exact."""
    seq_lens = [3, 129, 700, 2500, 1, 128]
    batch = make_batch(np.random.default_rng(3), [1] * len(seq_lens), seq_lens, 16, 4, 128, 16)
    out, (q, k_cache, v_cache) = run(gpu, batch, dtype, 0.125, decode=True, max_seq_len=max_seq_len)
    assert rel_error(out, dense_attention(q, k_cache, v_cache, batch.meta, 0.125)) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_group_over_16_heads(gpu, rel_error, tolerance, dtype):
    batch = make_batch(np.random.default_rng(4), [1] * 3, [5, 333, 2000], 40, 2, 64, 16)
    out, (q, k_cache, v_cache) = run(gpu, batch, dtype, 0.125, decode=True)
    assert rel_error(out, dense_attention(q, k_cache, v_cache, batch.meta, 0.125)) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_without_workspace_matches_split(gpu, rel_error, tolerance, dtype):
    batch = make_batch(np.random.default_rng(5), [1] * 2, [3000, 77], 8, 8, 128, 16)
    split, _ = run(gpu, batch, dtype, 0.1, decode=True)
    single, (q, k_cache, v_cache) = run(gpu, batch, dtype, 0.1, decode=True, workspace=False)
    expected = dense_attention(q, k_cache, v_cache, batch.meta, 0.1)
    assert rel_error(split, expected) <= tolerance[dtype]
    assert rel_error(single, expected) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_of_short_contexts_runs_unsplit(gpu, rel_error, tolerance, dtype):
    """Contexts of at most MIN_SPLIT_KEYS take the plain kernel (no cluster) on any GPU."""
    seq_lens = [1, 5, 16, 17, 64, 100, 128]
    batch = make_batch(np.random.default_rng(8), [1] * len(seq_lens), seq_lens, 12, 4, 128, 16)
    assert h200_plan(len(seq_lens), 12, 4, 128, dtype, max(seq_lens)) == DecodePlan(1, 1)
    out, (q, k_cache, v_cache) = run(gpu, batch, dtype, 0.1, decode=True)
    assert rel_error(out, dense_attention(q, k_cache, v_cache, batch.meta, 0.1)) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_of_many_sequences_of_mixed_length(gpu, rel_error, tolerance, dtype):
    """A batch just short of filling the GPU: on the H200, bf16 splits in single clusters
    (no merge through the workspace), and the shorter sequences use fewer of the 8 splits."""
    rng = np.random.default_rng(9)
    seq_lens = [1, 1100, *rng.integers(1, 1100, 30)]
    batch = make_batch(rng, [1] * len(seq_lens), seq_lens, 16, 4, 64, 16)
    if dtype == "bfloat16":
        assert h200_plan(len(seq_lens), 16, 4, 64, dtype, 1100) == DecodePlan(8, 8, SPLIT_ALIGN)
    out, (q, k_cache, v_cache) = run(gpu, batch, dtype, 0.125, decode=True)
    assert rel_error(out, dense_attention(q, k_cache, v_cache, batch.meta, 0.125)) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,num_seqs", [("float32", 96), ("bfloat16", 64)])
def test_decode_of_a_batch_past_one_wave_splits_a_few_ways(gpu, rel_error, tolerance, dtype, num_seqs):
    """More (sequence, kv head) blocks than an H200 holds at once: the keys split a few ways,
    merged through the workspace; sequences of at most MIN_SPLIT_KEYS keys use one part."""
    rng = np.random.default_rng(10)
    seq_lens = [1, 128, 129, 700, *rng.integers(1, 700, num_seqs - 4)]
    batch = make_batch(rng, [1] * num_seqs, seq_lens, 32, 8, 128, 16)
    plan = h200_plan(num_seqs, 32, 8, 128, dtype, 700)
    assert plan.cluster == 1 and 1 < plan.num_splits <= FULL_BATCH_MAX_SPLITS
    out, (q, k_cache, v_cache) = run(gpu, batch, dtype, 0.1, decode=True)
    assert rel_error(out, dense_attention(q, k_cache, v_cache, batch.meta, 0.1)) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_and_prefill_kernels_agree_on_a_decode_batch(gpu, rel_error, tolerance, dtype):
    batch = make_batch(np.random.default_rng(6), [1] * 5, [1, 2, 63, 64, 65], 4, 2, 128, 16)
    by_decode, _ = run(gpu, batch, dtype, 0.1, decode=True)
    by_prefill, _ = run(gpu, batch, dtype, 0.1, decode=False)
    assert rel_error(by_decode, by_prefill) <= tolerance[dtype]


# ---- one graph, planned for long contexts, replayed with any context ----

_NAN_BITS = {"float32": (32, 0x7FC00000), "bfloat16": (16, 0x7FC0), "float16": (16, 0x7E00)}


class ReplayedDecode:
    """decode_attention captured once in a graph whose plan is for plan_len keys (as the
    engine's decode graphs are, for max_model_len), over caches that hold `capacity` keys
    per sequence. replay(seq_lens) rewrites the device seq_lens, fills out with NaN (so a
    row the kernel fails to write shows), replays and returns out as float32."""

    def __init__(self, gpu, dtype: str, num_seqs: int, num_kv_heads: int, capacity: int, plan_len: int, seed: int):
        self.gpu, self.dtype = gpu, dtype
        self.batch = make_batch(np.random.default_rng(seed), [1] * num_seqs, [capacity] * num_seqs, 32,
                                num_kv_heads, 128, 16)
        self.q, self.k_cache, self.v_cache = (gpu.upload(a, dtype) for a in
                                              (self.batch.q, self.batch.k_cache, self.batch.v_cache))
        self.held = tuple(gpu.download(t).astype(np.float32) for t in (self.q, self.k_cache, self.v_cache))
        self.meta = upload_meta(gpu, self.batch.meta, max_seq_len=plan_len)
        numel = attention.decode_workspace_numel(self.q, self.k_cache, self.meta)
        self.workspace = gpu.empty((numel,), DType.float32) if numel else None
        self.plan = attention.decode_plan(self.q, self.k_cache, self.meta, self.workspace)
        self.out = gpu.empty(self.q.shape, self.q.dtype)
        self._launch()  # eagerly first: loads the kernels outside the capture
        self.graph, _ = capture(gpu.stream, self._launch)

    def _launch(self) -> None:
        attention.decode_attention(self.out, self.q, self.k_cache, self.v_cache, self.meta, 128 ** -0.5,
                                   self.gpu.stream, workspace=self.workspace)

    def replay(self, seq_lens) -> np.ndarray:
        copy_to_device(self.meta.seq_lens, np.asarray(seq_lens, np.int32), self.gpu.stream)
        width, bits = _NAN_BITS[self.dtype]
        memset = driver.cuMemsetD32Async if width == 32 else driver.cuMemsetD16Async
        call(memset, self.out.ptr, bits, self.out.numel, self.gpu.stream.handle)
        self.graph.replay(self.gpu.stream)
        return self.gpu.download(self.out)

    def expected(self, seq_lens) -> np.ndarray:
        meta = dataclasses.replace(self.batch.meta, seq_lens=np.asarray(seq_lens, np.int32),
                                   max_seq_len=max(seq_lens))
        return dense_attention(*self.held, meta, 128 ** -0.5)

    def check(self, steps, rel_error, tolerance) -> None:
        """Replays every step; a step equal to the one before must give the same bits."""
        previous_lens, previous_out = None, None
        for seq_lens in steps:
            out = self.replay(seq_lens)
            error = rel_error(out, self.expected(seq_lens))
            assert error <= tolerance[self.dtype], (seq_lens, error)
            if seq_lens == previous_lens:
                assert np.array_equal(out, previous_out), seq_lens
            previous_lens, previous_out = seq_lens, out

    def close(self) -> None:
        self.graph.destroy()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_kv_heads", [8, 4])
@pytest.mark.parametrize("plan_len", [4096, 8192, 131072])
def test_decode_graph_planned_for_long_contexts_replays_any_context(gpu, rel_error, tolerance, dtype, num_kv_heads,
                                                                    plan_len):
    """Batch 1, 32 query heads: a short context is written by its one part, a long one merges
    its parts in the launch; repeated replays prove the arrival counters start from zero each
    time and that the merge's order does not depend on which block finishes last. bf16 at
    4096 plans thread-block clusters on the H200, the others plain splits."""
    decode = ReplayedDecode(gpu, dtype, 1, num_kv_heads, 8192, plan_len, seed=plan_len + num_kv_heads)
    try:
        assert decode.plan.parts_used(128) == 1 < decode.plan.parts_used(8192)
        steps = [[128], [128], [1], [8192], [8192], [8192], [129], [4097], [17], [128]]
        decode.check(steps, rel_error, tolerance)
    finally:
        decode.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_graph_of_a_mixed_batch_replays_any_contexts(gpu, rel_error, tolerance, dtype):
    """Three sequences, each with its own counter per kv head, in one graph planned for 128k keys."""
    decode = ReplayedDecode(gpu, dtype, 3, 8, 5000, 131072, seed=11)
    try:
        assert decode.plan.num_parts > 1
        steps = [[128, 1, 5000], [5000, 128, 1], [5000, 128, 1], [3000, 3000, 3000], [1, 1, 1], [4999, 17, 2048]]
        decode.check(steps, rel_error, tolerance)
    finally:
        decode.close()


def test_the_two_references_agree():
    """The dense formula and the numpy backend are independent; agreeing, either can judge the kernels."""
    from sparkd.backend.cpu.attention import paged_attention, plan_attention

    batch = make_batch(np.random.default_rng(7), *MIXED, 12, 4, 64, 5, poison=1e4)
    expected = dense_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.1)
    actual = paged_attention(batch.q, batch.k_cache, batch.v_cache, plan_attention(batch.meta), 0.1)
    assert np.max(np.abs(actual - expected)) <= 1e-5 * np.max(np.abs(expected))
