"""Paged attention kernels: decode as a fraction of the copy bandwidth, prefill in TFLOP/s.

  python tools/bench_attention.py [--dtype bfloat16] [--iters 20]

Llama-3.1-8B attention: 32 query heads sharing 8 kv heads of 128, blocks of 16
tokens scattered over the cache. Decode (one token per sequence) at batch 1 and 64
with 1k to 32k contexts is bound by reading K and V: bytes read / time, divided by
the device-to-device copy rate of the same run (bytes read plus written), says how
much of the memory system it uses. Batch 1 at 128 tokens is bound by latency: it is
timed in graphs planned for 128, 8192 and 131072 keys (an engine's decode graphs are
planned for max_model_len), with 8 kv heads (Llama) and 4 (Qwen3-MoE).
Prefill is an 8k-token prompt (and 8 prompts of 1k), counted as 4 * Hq * D FLOPs per
(query, visible key) pair.
The last table times a decode step's RoPE + KV write + attention both ways:
rope_write_kv then decode_attention, and decode_attention_rope (one launch), at
batch 1 to 64, 128 and 4k tokens, 8 and 4 kv heads, with and without Qwen3's q/k
norm, in graphs planned for 8192 keys; the largest batch up to which every row saves
time is what attention.FUSED_ROPE_MAX_BATCH should be.
Each case cycles through enough caches to exceed twice the L2, as the layers of a
model do, and the timed launches are replayed from one CUDA graph.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import DeviceBench, bench_parser, copy_bandwidth, timed_graph  # noqa: E402
from cuda.bindings import driver  # noqa: E402

from sparkd.backend.cuda.attention_metadata import CudaAttentionMetadata  # noqa: E402
from sparkd.backend.cuda.driver import call  # noqa: E402
from sparkd.backend.cuda.kernels import attention, attention_plan, rope_kv  # noqa: E402
from sparkd.backend.cuda.kernels.rope_kv import rope_cos_sin  # noqa: E402
from sparkd.backend.dtypes import DType  # noqa: E402
from sparkd.models.config import rope_config  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
FUSED_ROPE_BATCHES = (1, 2, 4, 8, 16, 32, 64)


class Bench(DeviceBench):
    def __init__(self, dtype: DType, iters: int):
        super().__init__(dtype, iters)
        self.l2_bytes = call(driver.cuDeviceGetAttribute,
                             driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, self.device.handle)
        self.last_plan: attention_plan.DecodePlan | None = None  # the plan of the last decode case timed

    def step(self, query_lens: list[int], seq_lens: list[int],
             max_seq_len: int | None = None) -> tuple[CudaAttentionMetadata, int]:
        """Device metadata of one step whose sequences own scattered blocks, its decode plan made
        for max_seq_len keys (default: the longest sequence); and the blocks in use."""
        blocks_needed = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
        order = np.random.default_rng(0).permutation(sum(blocks_needed)).astype(np.int32)
        tables = np.zeros((len(seq_lens), max(blocks_needed)), np.int32)
        for s, start in enumerate(np.cumsum([0, *blocks_needed[:-1]])):
            tables[s, :blocks_needed[s]] = order[start:start + blocks_needed[s]]
        # The slots of each sequence's new tokens, its last query_len positions.
        positions = np.concatenate([np.arange(n - q, n) for q, n in zip(query_lens, seq_lens)])
        rows = np.repeat(np.arange(len(seq_lens)), query_lens)
        slots = tables[rows, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        arrays = (np.concatenate([[0], np.cumsum(query_lens)]), np.asarray(seq_lens), tables, slots)
        query_start_loc, lens, block_tables, slots = (self.upload(a, DType.int32) for a in arrays)
        meta = CudaAttentionMetadata(query_start_loc, lens, block_tables, slots, max(query_lens),
                                     max_seq_len or max(seq_lens))
        return meta, sum(blocks_needed)

    def caches(self, num_blocks: int, num_kv_heads: int) -> list:
        """(k_cache, v_cache) pairs, enough of them to be twice the L2 together."""
        shape = (num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM)
        pair_bytes = 2 * math.prod(shape) * self.dtype.itemsize
        return [(self.ones(shape), self.ones(shape)) for _ in range(math.ceil(2 * self.l2_bytes / pair_bytes))]

    def time(self, query_lens: list[int], seq_lens: list[int], decode: bool, num_kv_heads: int = NUM_KV_HEADS,
             max_seq_len: int | None = None) -> float:
        """Seconds per attention call over one step's sequences."""
        meta, num_blocks = self.step(query_lens, seq_lens, max_seq_len)
        q = self.ones((sum(query_lens), NUM_Q_HEADS, HEAD_DIM))
        out = self.allocator.empty(q.shape, self.dtype)
        caches = self.caches(num_blocks, num_kv_heads)
        rotation = itertools.cycle(caches)
        scale = HEAD_DIM ** -0.5
        if decode:
            numel = attention.decode_workspace_numel(q, caches[0][0], meta)
            workspace = self.allocator.empty((numel,), DType.float32) if numel else None
            self.last_plan = attention.decode_plan(q, caches[0][0], meta, workspace)
            seconds = timed_graph(self.stream, lambda: attention.decode_attention(
                out, q, *next(rotation), meta, scale, self.stream, workspace=workspace), self.iters)
        else:
            seconds = timed_graph(self.stream, lambda: attention.prefill_attention(
                out, q, *next(rotation), meta, scale, self.stream), self.iters)
        self.stream.synchronize()
        self.allocator.release_cached()  # the next case's caches need the room
        return seconds

    def time_rope_decode(self, batch: int, context: int, num_kv_heads: int, with_norm: bool, fused: bool,
                         max_seq_len: int) -> float:
        """Seconds per decode step of RoPE, the KV write and attention: rope_write_kv then
        decode_attention, or decode_attention_rope when fused."""
        meta, num_blocks = self.step([1] * batch, [context] * batch, max_seq_len)
        heads = (NUM_Q_HEADS, num_kv_heads, num_kv_heads)
        qkv = self.ones((batch, sum(heads) * HEAD_DIM))
        starts = np.cumsum([0, *heads[:-1]]) * HEAD_DIM
        q, k, v = (qkv.column_slice(int(start), n * HEAD_DIM).split_last(n, HEAD_DIM)
                   for start, n in zip(starts, heads))
        positions = self.upload(np.full(batch, context - 1), DType.int32)
        rope = rope_config({"rope_parameters": {"rope_theta": 1000000.0}}, HEAD_DIM)
        cos_sin = self.upload(rope_cos_sin(rope, max_seq_len), DType.float32)
        qk_norm = (self.ones((HEAD_DIM,)), self.ones((HEAD_DIM,)), 1e-6) if with_norm else None
        out, q_rotated = (self.allocator.empty(q.shape, self.dtype) for _ in range(2))
        caches = self.caches(num_blocks, num_kv_heads)
        rotation = itertools.cycle(caches)
        numel = attention.decode_workspace_numel(q, caches[0][0], meta, fused_rope=fused)
        workspace = self.allocator.empty((numel,), DType.float32) if numel else None
        self.last_plan = attention.decode_plan(q, caches[0][0], meta, workspace, fused_rope=fused)
        scale = HEAD_DIM ** -0.5

        def two_launches() -> None:
            k_cache, v_cache = next(rotation)
            rope_kv.rope_write_kv(q_rotated, q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping,
                                  self.stream, qk_norm)
            attention.decode_attention(out, q_rotated, k_cache, v_cache, meta, scale, self.stream, workspace)

        def one_launch() -> None:
            attention.decode_attention_rope(out, q, k, v, positions, cos_sin, *next(rotation), meta, scale,
                                            self.stream, workspace, qk_norm)

        seconds = timed_graph(self.stream, one_launch if fused else two_launches, self.iters)
        self.stream.synchronize()
        self.allocator.release_cached()
        return seconds


def causal_flops(query_lens: list[int], seq_lens: list[int]) -> float:
    """4 * Hq * D per (query, visible key): 2 for q.k, 2 for p.v."""
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens))
    return 4.0 * NUM_Q_HEADS * HEAD_DIM * pairs


def print_fused_rope_table(bench: Bench, planned: int = 8192) -> None:
    """rope_write_kv + decode_attention against decode_attention_rope, in graphs planned for
    `planned` keys, and the largest batch up to which the one launch saves time: in every
    row, and over the rows together. "blocks": those that do not exit at once (every split of
    a used part), against the 396 of one wave on an H200 (3 per SM)."""
    print("\n| RoPE + KV write + decode attention | batch | kv heads | context | q/k norm | splits / cluster / parts "
          "(used) | blocks | rope_write_kv + decode_attention us | decode_attention_rope us | saved us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    saved = {batch: [] for batch in FUSED_ROPE_BATCHES}  # us, per row
    for batch, num_kv_heads, context, with_norm in itertools.product(FUSED_ROPE_BATCHES, (NUM_KV_HEADS, 4),
                                                                    (128, 4096), (False, True)):
        two, one = (bench.time_rope_decode(batch, context, num_kv_heads, with_norm, fused, planned) * 1e6
                    for fused in (False, True))
        saved[batch].append(two - one)
        plan = bench.last_plan
        head_chunks = math.ceil(NUM_Q_HEADS // num_kv_heads / attention_plan.DECODE_HEADS_PER_BLOCK)
        blocks = batch * num_kv_heads * head_chunks * plan.parts_used(context) * plan.cluster
        print(f"| planned for {planned} | {batch} | {num_kv_heads} | {context} | {'yes' if with_norm else 'no'} | "
              f"{plan.num_splits} / {plan.cluster} / {plan.num_parts} ({plan.parts_used(context)}) | {blocks} | "
              f"{two:.1f} | {one:.1f} | {two - one:.1f} |", flush=True)

    def largest_paying(pays) -> int:
        return max(itertools.takewhile(lambda batch: pays(saved[batch]), FUSED_ROPE_BATCHES), default=0)

    print(f"\nThe one launch saves in every row up to batch {largest_paying(lambda rows: min(rows) > 0)}, over "
          f"the rows together up to batch {largest_paying(lambda rows: sum(rows) > 0)} "
          f"(attention.FUSED_ROPE_MAX_BATCH is {attention.FUSED_ROPE_MAX_BATCH}).", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, 20, ("bfloat16", "float16"))
    args = parser.parse_args(argv)

    bench = Bench(DType.parse(args.dtype), args.iters)
    copy_rate = copy_bandwidth(bench.allocator, bench.stream)
    print(f"# {bench.device.name} ({bench.device.arch}), {args.dtype}, Hq {NUM_Q_HEADS}, Hkv {NUM_KV_HEADS}, "
          f"D {HEAD_DIM}, block {BLOCK_SIZE}; device-to-device copy {copy_rate / 1e12:.2f} TB/s (read + written)")
    print("| decode batch | context | splits / cluster / parts | us/call | KV TB/s | fraction of copy |")
    print("| --- | --- | --- | --- | --- | --- |")
    for batch in (1, 64):
        for context in (1024, 4096, 16384, 32768):
            seconds = bench.time([1] * batch, [context] * batch, decode=True)
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * bench.dtype.itemsize
            plan = bench.last_plan
            print(f"| {batch} | {context} | {plan.num_splits} / {plan.cluster} / {plan.num_parts} | "
                  f"{seconds * 1e6:.1f} | {kv_bytes / seconds / 1e12:.2f} | {kv_bytes / seconds / copy_rate:.2f} |",
                  flush=True)
    print("\n| batch-1 decode | kv heads | context | graph planned for | splits / cluster / parts (used) | us/call |")
    print("| --- | --- | --- | --- | --- | --- |")
    context = 128
    for num_kv_heads in (NUM_KV_HEADS, 4):
        for planned in (context, 8192, 131072):
            seconds = bench.time([1], [context], decode=True, num_kv_heads=num_kv_heads, max_seq_len=planned)
            plan = bench.last_plan
            print(f"| 1 | {num_kv_heads} | {context} | {planned} | {plan.num_splits} / {plan.cluster} / "
                  f"{plan.num_parts} ({plan.parts_used(context)}) | {seconds * 1e6:.1f} |", flush=True)
    print_fused_rope_table(bench)
    print("\n| prefill | tokens | ms/call | TFLOP/s |")
    print("| --- | --- | --- | --- |")
    for name, query_lens in (("one prompt", [8192]), ("8 prompts", [1024] * 8)):
        seconds = bench.time(query_lens, query_lens, decode=False)
        flops = causal_flops(query_lens, query_lens)
        print(f"| {name} | {sum(query_lens)} | {seconds * 1e3:.2f} | {flops / seconds / 1e12:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
