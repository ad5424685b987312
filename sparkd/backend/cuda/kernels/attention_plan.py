"""The decode split plan: how a decode attention launch cuts its keys, and how much
shared memory and workspace it needs (plus the prefill tiles its shared memory comes from).

Host arithmetic on the sizes only (no device, no tensors): attention.py checks the
operands, asks plan_decode for a plan with the device's numbers and launches it.
The constants and tiles mirror the kernels (attention_decode.cu, attention_prefill.cu,
attention_split.cuh, attention_fp32.cuh, attention_rope.cuh).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...dtypes import DType

SPLIT_ALIGN = 64  # kSplitAlign (attention_split.cuh): split lengths are multiples of it
MIN_SPLIT_KEYS = 128  # a multiple of SPLIT_ALIGN
MAX_SPLITS = 128  # a multiple of DECODE_CLUSTER
DECODE_COUNTERS = 4096  # kMaxDecodeCounters (attention_decode.cu): unsplit blocks a split launch may have
DECODE_HEADS_PER_BLOCK = 16  # query heads of one kv head that a decode block serves
DECODE_CLUSTER = 8  # kDecodeCluster: splits a bf16 / fp16 thread-block cluster merges on chip
MAX_CLUSTER_PARTS = 4  # see plan_decode
FULL_BATCH_MAX_SPLITS = 4  # see plan_decode

_RESERVED_SMEM = 1024  # shared memory the driver reserves per block (and once per SM)


@dataclass(frozen=True)
class _Tile:
    """A kernel's tile: query rows per block, keys per pipeline stage, stages in flight."""

    rows: int
    keys: int
    stages: int

    def smem_bytes(self, head_dim: int, dtype: DType) -> int:
        """The query tile plus a K and a V tile per stage; rows padded by 16 bytes (smem_ld)."""
        return (self.rows + 2 * self.stages * self.keys) * (head_dim * dtype.itemsize + 16)


# These mirror PrefillTile<D> (attention_prefill.cu), kDecodeRows / kDecodeKeys /
# decode_stages<D> (attention_decode.cu) and kFp32Rows / kFp32Keys (attention_fp32.cuh).
PREFILL_TILES = {64: _Tile(128, 64, 2), 128: _Tile(128, 32, 2), 256: _Tile(64, 32, 1)}
_DECODE_TILES = {64: _Tile(16, 64, 2), 128: _Tile(16, 64, 2), 256: _Tile(16, 64, 1)}
FP32_TILE = _Tile(16, 32, 1)


def _decode_merge_bytes(head_dim: int) -> int:
    """Shared memory the bf16 / fp16 decode kernel's final merges reuse (DecodeMergeSmem)."""
    return (64 * head_dim + 352) * 4


def _rope_scratch_bytes(head_dim: int, dtype: DType) -> int:
    """Shared memory the fused RoPE kernels add after the tiles (rope_scratch_bytes in attention_rope.cuh)."""
    return 2 * (head_dim * dtype.itemsize + 16) + (DECODE_HEADS_PER_BLOCK + 1) * 4


@dataclass(frozen=True)
class AttentionSizes:
    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_seqs: int
    dtype: DType
    fused_rope: bool = False  # the decode kernel rotates q and k itself (decode_attention_rope)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def choose_num_splits(num_blocks: int, max_seq_len: int, num_sms: int, blocks_per_sm: int = 2,
                      step: int = 1, min_split_keys: int = MIN_SPLIT_KEYS, max_splits: int = MAX_SPLITS) -> int:
    """How many splits of its keys each decode block gets (flash-attention 2's wave heuristic).

    num_blocks: blocks without splitting (sequences x kv heads x head chunks), of which
    blocks_per_sm fit on an SM at once. Candidates are 1 and the multiples of `step`,
    none shorter than min_split_keys; the fewest splits whose waves are at least 85%
    as full as the best candidate's win, so a batch that fills its waves stays whole."""
    slots = num_sms * blocks_per_sm
    limit = max(1, min(max_splits, slots, math.ceil(max_seq_len / min_split_keys)))
    candidates = [1, *range(step, limit + 1, step)] if step > 1 else list(range(1, limit + 1))
    efficiency = [n * num_blocks / slots / math.ceil(n * num_blocks / slots) for n in candidates]
    best = max(efficiency)
    return next(n for n, e in zip(candidates, efficiency) if e >= 0.85 * best)


@dataclass(frozen=True)
class DecodePlan:
    """How decode_attention cuts each sequence's keys.

    num_splits blocks share a sequence's keys (grid.x = head chunks x num_splits);
    `cluster` consecutive splits form a part, merged on chip by a thread-block cluster
    (1: no cluster). The parts go through the workspace, and the block that stores the
    last of a sequence's parts merges them, in the same launch. A split holds at least
    min_split_keys keys, so a sequence shorter than the plan's max_seq_len uses fewer
    splits (the rest of the grid exits at once), and one that fits in one part is
    written directly."""

    num_splits: int
    cluster: int
    min_split_keys: int = MIN_SPLIT_KEYS

    @property
    def num_parts(self) -> int:
        return self.num_splits // self.cluster

    def parts_used(self, seq_len: int) -> int:
        """Parts that hold keys of a sequence of seq_len keys, as the kernels cut it
        (decode_split in attention_split.cuh); 1: written directly, no merge."""
        even = math.ceil(math.ceil(seq_len / self.num_splits) / SPLIT_ALIGN) * SPLIT_ALIGN
        return math.ceil(seq_len / (max(even, self.min_split_keys) * self.cluster))


def _decode_blocks(sizes: AttentionSizes) -> int:
    return sizes.num_seqs * sizes.num_kv_heads * math.ceil(sizes.group / DECODE_HEADS_PER_BLOCK)


def part_numel(sizes: AttentionSizes) -> int:
    """Workspace floats one part needs: the normalised output and its log-sum-exp per head."""
    return sizes.num_seqs * sizes.num_q_heads * (sizes.head_dim + 1)


def decode_smem_bytes(sizes: AttentionSizes) -> int:
    scratch = _rope_scratch_bytes(sizes.head_dim, sizes.dtype) if sizes.fused_rope else 0
    if sizes.dtype is DType.float32:
        return FP32_TILE.smem_bytes(sizes.head_dim, sizes.dtype) + scratch
    return max(_DECODE_TILES[sizes.head_dim].smem_bytes(sizes.head_dim, sizes.dtype) + scratch,
               _decode_merge_bytes(sizes.head_dim))


def blocks_per_sm(smem_bytes: int, max_shared_per_block: int) -> int:
    """Blocks that fit an SM by shared memory: the SM holds the per-block maximum plus
    the 1 KiB the driver reserves, and each block takes its own 1 KiB too."""
    return max(1, (max_shared_per_block + _RESERVED_SMEM) // (smem_bytes + _RESERVED_SMEM))


def plan_decode(sizes: AttentionSizes, max_seq_len: int, num_sms: int, max_shared_per_block: int,
                workspace_numel: int) -> DecodePlan:
    """The splits that fill the GPU best, as far as `workspace_numel` floats hold the parts.

    Rules measured on the H200 and the H100 (docs/benchmarks.md, bf16, D 128):
    - A batch whose unsplit blocks give every SM one but fit in one wave is not split (nor
      one with more than DECODE_COUNTERS, the kernels' arrival counters): its blocks all
      run at once (H100, batch 32: 2-4 splits 0.58-0.73 of the copy rate against 0.73-0.91
      unsplit). Past one wave the last, ragged one runs few blocks, each bound by its own
      loads in flight, so the batch splits in at most FULL_BATCH_MAX_SPLITS by the wave
      rule of choose_num_splits (H100, batch 64 at 1k / 4k keys: 2 splits 0.82 / 0.90
      against 0.76 / 0.79 unsplit). Few splits keep at least MIN_SPLIT_KEYS keys each
      at the contexts the graph replays: a decode graph's plan is fixed at its context
      bound (max_model_len; small batches also have a graph for 1024 keys,
      decode_slots.py), and many splits sat empty for short sequences (batch 64 at 1k keys
      in a graph planned for 8k with every split of a cluster plan: 0.43 of the roofline
      against 0.69 unsplit).
    - bf16 / fp16 splits merged on chip by a cluster of DECODE_CLUSTER pay off while a
      sequence needs at most MAX_CLUSTER_PARTS clusters (1k-4k keys at batch 1: 7.3 us
      against 12.2 us at 1k); past that, plain splits merged through the workspace are
      faster (measured when a second kernel merged the parts).
    - A plan of one cluster splits at SPLIT_ALIGN keys, not MIN_SPLIT_KEYS: batch-1 decode at
      129-192 keys in graphs planned for 1024 keys then runs 3 blocks of a cluster, not 2
      (Llama-3.1-8B forward 240.8 -> 242.1 tok/s, served 238.3 -> 240.3; Qwen3-30B-A3B forward
      603.3 -> 604.4). With more parts, shorter splits would make a context use more of them.
    fp32 always splits one by one."""
    blocks = _decode_blocks(sizes)
    if blocks >= DECODE_COUNTERS:
        return DecodePlan(1, 1)
    per_sm = blocks_per_sm(decode_smem_bytes(sizes), max_shared_per_block)
    max_parts = max(1, workspace_numel // part_numel(sizes))
    if blocks >= num_sms:
        if blocks <= num_sms * per_sm:
            return DecodePlan(1, 1)  # one wave, every block at once
        wanted = choose_num_splits(blocks, max_seq_len, num_sms, per_sm, max_splits=FULL_BATCH_MAX_SPLITS)
        return DecodePlan(min(wanted, max_parts), 1)
    clustered = None
    if sizes.dtype is not DType.float32:
        wanted = choose_num_splits(blocks, max_seq_len, num_sms, per_sm, DECODE_CLUSTER)
        parts = wanted // DECODE_CLUSTER
        if parts >= 1:
            num_parts = min(parts, max_parts)
            # One part merges every context on chip whatever its split length, so the shortest
            # splits (SPLIT_ALIGN keys) only spread a short context over more of its blocks.
            min_keys = SPLIT_ALIGN if num_parts == 1 else MIN_SPLIT_KEYS
            clustered = DecodePlan(DECODE_CLUSTER * num_parts, DECODE_CLUSTER, min_keys)
            if parts <= MAX_CLUSTER_PARTS:
                return clustered
    wanted = choose_num_splits(blocks, max_seq_len, num_sms, per_sm, 1)
    if clustered is not None and max_parts < wanted:
        return clustered  # short of workspace, a cluster still splits 8 ways without any
    return DecodePlan(min(wanted, max_parts), 1)

