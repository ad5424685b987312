"""Launchers for paged causal attention with GQA: varlen prefill and split-K decode.

Kernels: cukernels/attention_prefill.cu and attention_decode.cu (shared pieces in
attention_common.cuh, attention_mma.cuh, attention_fp32.cuh, attention_split.cuh,
attention_rope.cuh). bf16 and fp16 run on tensor cores with fp32 softmax and
accumulators; fp32 runs on CUDA cores with plain FMAs (no TF32), exact to rounding.
decode_attention_rope is rope_write_kv and decode_attention in one launch.

  q, out [T, Hq, D] contiguous        k_cache, v_cache [NB, Hkv, BS, D]
  meta: CudaAttentionMetadata (device query_start_loc [B+1], seq_lens [B],
        block_tables [B, max_blocks] int32; host bounds max_query_len, max_seq_len)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...dtypes import DType
from ..attention_metadata import CudaAttentionMetadata
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream, current_device
from ..tensor import DeviceTensor
from . import ACCESS_BYTES, vector_width
from .rope_kv import QKNorm

HEAD_DIMS = (64, 128, 256)
DTYPES = (DType.bfloat16, DType.float16, DType.float32)
SPLIT_ALIGN = 64  # kSplitAlign (attention_split.cuh): split lengths are multiples of it
MIN_SPLIT_KEYS = 128  # a multiple of SPLIT_ALIGN
MAX_SPLITS = 128  # a multiple of DECODE_CLUSTER
DECODE_COUNTERS = 4096  # kMaxDecodeCounters (attention_decode.cu): unsplit blocks a split launch may have
DECODE_HEADS_PER_BLOCK = 16  # query heads of one kv head that a decode block serves
DECODE_CLUSTER = 8  # kDecodeCluster: splits a bf16 / fp16 thread-block cluster merges on chip
MAX_CLUSTER_PARTS = 4  # see plan_decode
FUSED_ROPE_MAX_BATCH = 2  # see use_fused_rope

_THREADS = 128
_LOG2E = 1.4426950408889634
_RESERVED_SMEM = 1024  # shared memory the driver reserves per block (and once per SM)
_MAX_GRID_YZ = 65535


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
_PREFILL_TILES = {64: _Tile(128, 64, 2), 128: _Tile(128, 32, 2), 256: _Tile(64, 32, 1)}
_DECODE_TILES = {64: _Tile(16, 64, 2), 128: _Tile(16, 64, 2), 256: _Tile(16, 64, 1)}
_FP32_TILE = _Tile(16, 32, 1)


def _decode_merge_bytes(head_dim: int) -> int:
    """Shared memory the bf16 / fp16 decode kernel's final merges reuse (DecodeMergeSmem)."""
    return (64 * head_dim + 352) * 4


def _prefill_spec(dtype: DType, head_dim: int) -> KernelSpec:
    if dtype is DType.float32:
        return KernelSpec("attention_prefill.cu", f"prefill_attention_fp32_kernel<{head_dim}>")
    return KernelSpec("attention_prefill.cu", f"prefill_attention_kernel<{dtype.c_type}, {head_dim}>")


def _rope_scratch_bytes(head_dim: int, dtype: DType) -> int:
    """Shared memory the fused RoPE kernels add after the tiles (rope_scratch_bytes in attention_rope.cuh)."""
    return 2 * (head_dim * dtype.itemsize + 16) + (DECODE_HEADS_PER_BLOCK + 1) * 4


def _decode_spec(dtype: DType, head_dim: int, cluster: int, fused_rope: bool = False) -> KernelSpec:
    prefix = "decode_attention_rope" if fused_rope else "decode_attention"
    if dtype is DType.float32:
        return KernelSpec("attention_decode.cu", f"{prefix}_fp32_kernel<{head_dim}>")
    name = f"{prefix}_cluster_kernel" if cluster > 1 else f"{prefix}_kernel"
    return KernelSpec("attention_decode.cu", f"{name}<{dtype.c_type}, {head_dim}>")


SPECS = [
    *(_prefill_spec(dtype, head_dim) for dtype in DTYPES for head_dim in HEAD_DIMS),
    *(_decode_spec(dtype, head_dim, cluster, fused_rope) for dtype in DTYPES for head_dim in HEAD_DIMS
      for cluster in ((1,) if dtype is DType.float32 else (1, DECODE_CLUSTER)) for fused_rope in (False, True)),
]


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


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _sizes(q: DeviceTensor, k_cache: DeviceTensor, meta: CudaAttentionMetadata,
           fused_rope: bool = False) -> AttentionSizes:
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    return AttentionSizes(num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, meta.num_seqs, q.dtype,
                          fused_rope)


def _check(out: DeviceTensor, q: DeviceTensor, k_cache: DeviceTensor, v_cache: DeviceTensor,
           meta: CudaAttentionMetadata, fused_rope: bool = False) -> AttentionSizes:
    """The sizes, after checking the operands; with fused_rope q may be a row-strided view."""
    _require(q.ndim == 3, f"q must be [T, Hq, D], got shape {q.shape}")
    _require(k_cache.ndim == 4 and k_cache.shape == v_cache.shape,
             f"k_cache and v_cache must both be [NB, Hkv, BS, D], got {k_cache.shape} and {v_cache.shape}")
    sizes = _sizes(q, k_cache, meta, fused_rope)
    _require(sizes.head_dim in HEAD_DIMS, f"head_dim {sizes.head_dim} is not supported; expected one of {HEAD_DIMS}")
    _require(q.dtype in DTYPES, f"q dtype {q.dtype.name} is not supported; expected one of {[d.name for d in DTYPES]}")
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        _require(t.is_contiguous or (fused_rope and name == "q"), f"{name} must be contiguous, got {t}")
        _require(t.ptr % 16 == 0, f"{name} must be 16-byte aligned for vector loads, got {t}")
        _require(t.dtype is q.dtype, f"{name} dtype {t.dtype.name} differs from q's {q.dtype.name}")
    _require(out.shape == q.shape, f"out shape {out.shape} must equal q shape {q.shape}")
    _require(k_cache.shape[3] == sizes.head_dim, f"cache head_dim {k_cache.shape[3]} differs from q's {sizes.head_dim}")
    _require(sizes.num_q_heads % sizes.num_kv_heads == 0,
             f"num_q_heads {sizes.num_q_heads} must be a multiple of num_kv_heads {sizes.num_kv_heads}")
    _require(sizes.num_seqs <= _MAX_GRID_YZ and sizes.num_kv_heads <= _MAX_GRID_YZ,
             f"{sizes.num_seqs} sequences x {sizes.num_kv_heads} kv heads exceed the grid limit {_MAX_GRID_YZ}")
    for name, t, shape in (("query_start_loc", meta.query_start_loc, (sizes.num_seqs + 1,)),
                           ("seq_lens", meta.seq_lens, (sizes.num_seqs,)),
                           ("block_tables", meta.block_tables, (sizes.num_seqs, meta.block_tables.shape[-1]))):
        _require(t.dtype is DType.int32 and t.shape == shape and t.is_contiguous,
                 f"meta.{name} must be contiguous int32 of shape {shape}, got {t}")
    return sizes


def _meta_args(meta: CudaAttentionMetadata, sizes: AttentionSizes, scale: float) -> list:
    """The kernels' arguments after the caches, up to the split plan."""
    return [meta.query_start_loc, meta.seq_lens, meta.block_tables, np.int32(meta.block_tables.shape[1]),
            np.int32(sizes.num_q_heads), np.int32(sizes.num_kv_heads), np.int32(sizes.block_size),
            np.float32(scale * _LOG2E)]


def _common_args(q, k_cache, v_cache, meta: CudaAttentionMetadata, sizes: AttentionSizes, scale: float) -> list:
    return [q, k_cache, v_cache, *_meta_args(meta, sizes, scale)]


def prefill_attention(out: DeviceTensor, q: DeviceTensor, k_cache: DeviceTensor, v_cache: DeviceTensor,
                      meta: CudaAttentionMetadata, scale: float, stream: Stream | None) -> None:
    """out [T, Hq, D] = causal attention of every new token in the step, any mix of query lengths.

    Token i of sequence s (rows query_start_loc[s] + i of q) sits at position
    seq_lens[s] - query_len + i and attends to the cached keys 0..that position.
    The caches must already hold this step's K/V (rope_write_kv runs first)."""
    sizes = _check(out, q, k_cache, v_cache, meta)
    if sizes.num_seqs == 0 or sizes.num_tokens == 0:
        return
    _require(meta.max_query_len >= 1, f"meta.max_query_len must be >= 1, got {meta.max_query_len}")
    tile = _FP32_TILE if sizes.dtype is DType.float32 else _PREFILL_TILES[sizes.head_dim]
    grid = (math.ceil(meta.max_query_len * sizes.group / tile.rows), sizes.num_kv_heads, sizes.num_seqs)
    get_kernel(_prefill_spec(sizes.dtype, sizes.head_dim)).launch(
        grid, _THREADS, [out, *_common_args(q, k_cache, v_cache, meta, sizes, scale)],
        shared_mem=tile.smem_bytes(sizes.head_dim, sizes.dtype), stream=stream)


def choose_num_splits(num_blocks: int, max_seq_len: int, num_sms: int, blocks_per_sm: int = 2,
                      step: int = 1, min_split_keys: int = MIN_SPLIT_KEYS) -> int:
    """How many splits of its keys each decode block gets (flash-attention 2's wave heuristic).

    num_blocks: blocks without splitting (sequences x kv heads x head chunks), of which
    blocks_per_sm fit on an SM at once. Candidates are 1 and the multiples of `step`,
    none shorter than min_split_keys; the fewest splits whose waves are at least 85%
    as full as the best candidate's win, so a batch that fills its waves stays whole."""
    slots = num_sms * blocks_per_sm
    limit = max(1, min(MAX_SPLITS, slots, math.ceil(max_seq_len / min_split_keys)))
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


def _part_numel(sizes: AttentionSizes) -> int:
    """Workspace floats one part needs: the normalised output and its log-sum-exp per head."""
    return sizes.num_seqs * sizes.num_q_heads * (sizes.head_dim + 1)


def _decode_smem_bytes(sizes: AttentionSizes) -> int:
    scratch = _rope_scratch_bytes(sizes.head_dim, sizes.dtype) if sizes.fused_rope else 0
    if sizes.dtype is DType.float32:
        return _FP32_TILE.smem_bytes(sizes.head_dim, sizes.dtype) + scratch
    return max(_DECODE_TILES[sizes.head_dim].smem_bytes(sizes.head_dim, sizes.dtype) + scratch,
               _decode_merge_bytes(sizes.head_dim))


def _blocks_per_sm(smem_bytes: int, max_shared_per_block: int) -> int:
    """Blocks that fit an SM by shared memory: the SM holds the per-block maximum plus
    the 1 KiB the driver reserves, and each block takes its own 1 KiB too."""
    return max(1, (max_shared_per_block + _RESERVED_SMEM) // (smem_bytes + _RESERVED_SMEM))


def plan_decode(sizes: AttentionSizes, max_seq_len: int, num_sms: int, max_shared_per_block: int,
                workspace_numel: int) -> DecodePlan:
    """The splits that fill the GPU best, as far as `workspace_numel` floats hold the parts.

    Rules measured on the H200 (docs/benchmarks.md, bf16, D 128):
    - A batch whose unsplit blocks already give every SM one is not split (nor one with
      more than DECODE_COUNTERS, the kernels' arrival counters). Splitting it
      pays only at long contexts (batch 64: 0.81-0.97 of the copy rate at 4k-32k keys
      against 0.67-0.69 unsplit), but a decode graph's plan is fixed at max_model_len,
      and there the splits of short sequences sit empty: batch 64 at 1k keys in a graph
      planned for 8k ran at 0.43 of the roofline against 0.69 unsplit.
    - bf16 / fp16 splits merged on chip by a cluster of DECODE_CLUSTER pay off while a
      sequence needs at most MAX_CLUSTER_PARTS clusters (1k-4k keys at batch 1: 7.3 us
      against 12.2 us at 1k); past that, plain splits merged through the workspace are
      faster (measured when a second kernel merged the parts).
    fp32 always splits one by one."""
    blocks = _decode_blocks(sizes)
    if blocks >= min(num_sms, DECODE_COUNTERS):
        return DecodePlan(1, 1)
    per_sm = _blocks_per_sm(_decode_smem_bytes(sizes), max_shared_per_block)
    max_parts = max(1, workspace_numel // _part_numel(sizes))
    clustered = None
    if sizes.dtype is not DType.float32:
        wanted = choose_num_splits(blocks, max_seq_len, num_sms, per_sm, DECODE_CLUSTER)
        parts = wanted // DECODE_CLUSTER
        if parts >= 1:
            clustered = DecodePlan(DECODE_CLUSTER * min(parts, max_parts), DECODE_CLUSTER)
            if parts <= MAX_CLUSTER_PARTS:
                return clustered
    wanted = choose_num_splits(blocks, max_seq_len, num_sms, per_sm, 1)
    if clustered is not None and max_parts < wanted:
        return clustered  # short of workspace, a cluster still splits 8 ways without any
    return DecodePlan(min(wanted, max_parts), 1)


def _plan_for(sizes: AttentionSizes, meta: CudaAttentionMetadata, workspace_numel: int) -> DecodePlan:
    device = current_device()
    return plan_decode(sizes, meta.max_seq_len, device.sm_count, device.max_shared_per_block_optin, workspace_numel)


def decode_plan(q: DeviceTensor, k_cache: DeviceTensor, meta: CudaAttentionMetadata,
                workspace: DeviceTensor | None, fused_rope: bool = False) -> DecodePlan:
    """The plan decode_attention (decode_attention_rope with fused_rope) launches for
    these shapes and this workspace."""
    return _plan_for(_sizes(q, k_cache, meta, fused_rope), meta, workspace.numel if workspace is not None else 0)


def decode_workspace_numel(q: DeviceTensor, k_cache: DeviceTensor, meta: CudaAttentionMetadata,
                           fused_rope: bool = False) -> int:
    """float32 elements of workspace that decode_attention (decode_attention_rope with
    fused_rope) uses for these shapes; 0 when it needs none."""
    sizes = _sizes(q, k_cache, meta, fused_rope)
    plan = _plan_for(sizes, meta, workspace_numel=MAX_SPLITS * _part_numel(sizes))
    return 0 if plan.num_parts == 1 else plan.num_parts * _part_numel(sizes)


def decode_attention(out: DeviceTensor, q: DeviceTensor, k_cache: DeviceTensor, v_cache: DeviceTensor,
                     meta: CudaAttentionMetadata, scale: float, stream: Stream | None,
                     workspace: DeviceTensor | None = None) -> None:
    """out [B, Hq, D] = attention of each sequence's one new token (row query_start_loc[b]
    of q) to its cached keys 0..seq_lens[b]-1, split over the keys when that fills the GPU better.

    One launch: the grid depends only on host sizes (meta.max_seq_len, the SM count,
    the workspace), and blocks read each sequence's length from the device seq_lens,
    so a captured graph replays correctly for any context (a short one in about the
    time of its one part). The parts' merge counts arrivals in counters of the kernels'
    module, which every split launch leaves at zero: split launches must not run on two
    streams at once.
    workspace: float32 of at least decode_workspace_numel(q, k_cache, meta)
    elements; with None (or less) the splits form fewer parts, or one part that needs none."""
    sizes = _check(out, q, k_cache, v_cache, meta)
    _launch_decode(out, [q, k_cache, v_cache], meta, sizes, scale, stream, workspace)


def fused_rope_fits(q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, cos_sin: DeviceTensor,
                    k_cache: DeviceTensor, v_cache: DeviceTensor, qk_norm: QKNorm | None = None) -> bool:
    """Whether decode_attention_rope takes these operands: it rotates in 16-byte vectors
    only, so every address, row stride and rotary_dim / 2 must divide into them. Then
    rope_write_kv would also pick 16-byte vectors, and the fused launch repeats its
    arithmetic and order of summation exactly."""
    norm_weights = qk_norm[:2] if qk_norm is not None else ()
    full = ACCESS_BYTES // q.dtype.itemsize
    return vector_width(q.dtype, (q, k, v, k_cache, v_cache, cos_sin, *norm_weights),
                        (q.shape[-1], cos_sin.shape[-1] // 2, q.strides[0], k.strides[0], v.strides[0])) == full


def use_fused_rope(q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, cos_sin: DeviceTensor,
                   k_cache: DeviceTensor, v_cache: DeviceTensor, meta: CudaAttentionMetadata,
                   qk_norm: QKNorm | None = None) -> bool:
    """Whether a step's rope_write_kv + attention run as one decode_attention_rope: a
    decode-only step of at most FUSED_ROPE_MAX_BATCH sequences whose operands fit it.

    Measured on the H200 at the start of session 4 (tools/bench_attention.py: bf16, D 128,
    graphs planned for 8192 keys, 128 and 4k keys, 8 and 4 kv heads): at batch 1 the one
    launch saved 0.4-0.9 us without the q/k norm and 1.7-2.4 us with it; at batch 64 it
    lost 2.1-4.1 us with 8 kv heads (512 blocks) and -0.6..+1.2 with 4 (256 blocks).
    rope_write_kv costs about one short launch at any batch, but every fused block
    rotates its query heads before its first K/V tile, so each wave of blocks after the
    first (396 blocks on an H200) waits that long again. An 8k plan's splits make 768
    blocks at 4k keys from batch 4 (8 kv heads) and 512 at 128 keys from batch 8: 2 is
    the prediction, to be set from bench_attention's sweep over batch 1-64."""
    return (meta.is_decode_only and meta.num_seqs <= FUSED_ROPE_MAX_BATCH
            and fused_rope_fits(q, k, v, cos_sin, k_cache, v_cache, qk_norm))


def decode_attention_rope(out: DeviceTensor, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor,
                          positions: DeviceTensor, cos_sin: DeviceTensor, k_cache: DeviceTensor,
                          v_cache: DeviceTensor, meta: CudaAttentionMetadata, scale: float, stream: Stream | None,
                          workspace: DeviceTensor | None = None, qk_norm: QKNorm | None = None) -> None:
    """rope_write_kv(q_out, q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping,
    stream, qk_norm) then decode_attention(out, q_out, ...), in one launch and without q_out.

    q [B, Hq, D], k, v [B, Hkv, D]: the step's un-rotated rows, heads contiguous in a
    row (views of the qkv GEMM output are fine); positions [B] int32; cos_sin and
    qk_norm as rope_write_kv takes them. Every block rotates (and normalises) its
    query heads; the block whose split holds a sequence's newest key rotates it, writes
    k and v to the caches at meta.slot_mapping (none for a negative slot) and attends
    to them from shared memory. The caches end bit for bit as rope_write_kv leaves
    them, and out equals the two launches (bit for bit where both plan the same splits).
    workspace: as decode_attention, sized by decode_workspace_numel(..., fused_rope=True).
    The operands must pass fused_rope_fits."""
    sizes = _check(out, q, k_cache, v_cache, meta, fused_rope=True)
    num_seqs, head_dim = sizes.num_seqs, sizes.head_dim
    for name, t in (("k", k), ("v", v)):
        _require(t.shape == (sizes.num_tokens, sizes.num_kv_heads, head_dim) and t.dtype is q.dtype,
                 f"{name} must be [T={sizes.num_tokens}, Hkv={sizes.num_kv_heads}, D={head_dim}] {q.dtype.name}, "
                 f"got {t.shape} {t.dtype.name}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require(t.strides[1:] == (head_dim, 1), f"{name} heads must be contiguous inside a row, got {t.strides}")
    for name, t in (("positions", positions), ("meta.slot_mapping", meta.slot_mapping)):
        _require(t.dtype is DType.int32 and t.shape == (num_seqs,) and t.is_contiguous,
                 f"{name} must be contiguous int32 of shape ({num_seqs},), got {t}")
    _require(cos_sin.dtype is DType.float32 and cos_sin.ndim == 2 and cos_sin.is_contiguous,
             f"cos_sin must be contiguous float32 [positions, rotary_dim], got {cos_sin}")
    rotary_dim = cos_sin.shape[1]
    _require(rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim,
             f"rotary_dim must be even and in [2, D={head_dim}], got {rotary_dim}")
    norm_args = [np.uint64(0), np.uint64(0), np.float32(0)]
    if qk_norm is not None:
        for name, weight in zip(("q_norm", "k_norm"), qk_norm[:2]):
            _require(weight.shape == (head_dim,) and weight.dtype is q.dtype and weight.is_contiguous,
                     f"{name} must be contiguous [D={head_dim}] {q.dtype.name}, got {weight}")
        norm_args = [*qk_norm[:2], np.float32(qk_norm[2])]
    _require(fused_rope_fits(q, k, v, cos_sin, k_cache, v_cache, qk_norm),
             "decode_attention_rope needs 16-byte aligned q, k, v, caches, cos_sin and norm weights, row strides "
             f"and rotary_dim / 2 in whole 16-byte vectors; got rotary_dim {rotary_dim}, row strides "
             f"{q.strides[0]}, {k.strides[0]}, {v.strides[0]}: use rope_write_kv and decode_attention")
    rope_args = [q, k, v, *(np.int64(t.strides[0]) for t in (q, k, v)), positions, meta.slot_mapping, cos_sin,
                 *norm_args, np.int32(rotary_dim), k_cache, v_cache]
    _launch_decode(out, rope_args, meta, sizes, scale, stream, workspace)


def _launch_decode(out: DeviceTensor, query_args: list, meta: CudaAttentionMetadata, sizes: AttentionSizes,
                   scale: float, stream: Stream | None, workspace: DeviceTensor | None) -> None:
    """Plans and launches a decode kernel; query_args are its arguments from q to v_cache."""
    _require(meta.max_query_len == 1, f"decode needs meta.max_query_len == 1, got {meta.max_query_len}")
    _require(sizes.num_tokens == sizes.num_seqs,
             f"decode needs one query token per sequence: {sizes.num_tokens} tokens for {sizes.num_seqs} sequences")
    if sizes.num_seqs == 0:
        return
    if workspace is not None:
        _require(workspace.dtype is DType.float32 and workspace.is_contiguous,
                 f"workspace must be contiguous float32, got {workspace}")
    plan = _plan_for(sizes, meta, workspace.numel if workspace is not None else 0)
    if plan.num_parts == 1:
        # Every sequence fits one part and is written directly: no workspace or counter is touched.
        o_part = lse_part = np.uint64(0)
    else:
        o_part = DeviceTensor(workspace.ptr, (sizes.num_seqs, sizes.num_q_heads, plan.num_parts, sizes.head_dim),
                              DType.float32, owner=workspace.owner)
        lse_part = DeviceTensor(workspace.ptr + o_part.nbytes, (sizes.num_seqs, sizes.num_q_heads, plan.num_parts),
                                DType.float32, owner=workspace.owner)
    head_chunks = math.ceil(sizes.group / DECODE_HEADS_PER_BLOCK)
    get_kernel(_decode_spec(sizes.dtype, sizes.head_dim, plan.cluster, sizes.fused_rope)).launch(
        (head_chunks * plan.num_splits, sizes.num_kv_heads, sizes.num_seqs), _THREADS,
        [out, o_part, lse_part, *query_args, *_meta_args(meta, sizes, scale), np.int32(plan.num_splits),
         np.int32(plan.min_split_keys)],
        shared_mem=_decode_smem_bytes(sizes), stream=stream)
