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
import threading
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from ...dtypes import DType
from ..attention_metadata import CudaAttentionMetadata
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream, current_device
from ..tensor import DeviceTensor
from . import ACCESS_BYTES, vector_width
from .attention_plan import (DECODE_CLUSTER, DECODE_HEADS_PER_BLOCK, FP32_TILE, MAX_SPLITS, PREFILL_TILES,
                             AttentionSizes, DecodePlan, decode_smem_bytes, part_numel, plan_decode)
from .rope_kv import QKNorm

HEAD_DIMS = (64, 128, 256)
DTYPES = (DType.bfloat16, DType.float16, DType.float32)
FUSED_ROPE_MAX_BATCH = 2  # see use_fused_rope

_THREADS = 128
_LOG2E = 1.4426950408889634
_MAX_GRID_YZ = 65535


def _prefill_spec(dtype: DType, head_dim: int) -> KernelSpec:
    if dtype is DType.float32:
        return KernelSpec("attention_prefill.cu", f"prefill_attention_fp32_kernel<{head_dim}>")
    return KernelSpec("attention_prefill.cu", f"prefill_attention_kernel<{dtype.c_type}, {head_dim}>")


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
    tile = FP32_TILE if sizes.dtype is DType.float32 else PREFILL_TILES[sizes.head_dim]
    grid = (math.ceil(meta.max_query_len * sizes.group / tile.rows), sizes.num_kv_heads, sizes.num_seqs)
    get_kernel(_prefill_spec(sizes.dtype, sizes.head_dim)).launch(
        grid, _THREADS, [out, *_common_args(q, k_cache, v_cache, meta, sizes, scale)],
        shared_mem=tile.smem_bytes(sizes.head_dim, sizes.dtype), stream=stream)


def _plan_for(sizes: AttentionSizes, max_seq_len: int, workspace_numel: int) -> DecodePlan:
    device = current_device()
    return plan_decode(sizes, max_seq_len, device.sm_count, device.max_shared_per_block_optin, workspace_numel)


def decode_plan(q: DeviceTensor, k_cache: DeviceTensor, meta: CudaAttentionMetadata,
                workspace: DeviceTensor | None, fused_rope: bool = False) -> DecodePlan:
    """The plan decode_attention (decode_attention_rope with fused_rope) launches for
    these shapes and this workspace."""
    return _plan_for(_sizes(q, k_cache, meta, fused_rope), meta.max_seq_len,
                     workspace.numel if workspace is not None else 0)


def planned_decode(sizes: AttentionSizes, max_seq_len: int) -> DecodePlan:
    """The plan of a decode launch of these sizes whose metadata bounds contexts by max_seq_len,
    given the workspace decode_workspace_numel asks for (what CudaOps gives every launch)."""
    return _plan_for(sizes, max_seq_len, MAX_SPLITS * part_numel(sizes))


def decode_workspace_numel(q: DeviceTensor, k_cache: DeviceTensor, meta: CudaAttentionMetadata,
                           fused_rope: bool = False) -> int:
    """float32 elements of workspace that decode_attention (decode_attention_rope with
    fused_rope) uses for these shapes; 0 when it needs none."""
    sizes = _sizes(q, k_cache, meta, fused_rope)
    plan = planned_decode(sizes, meta.max_seq_len)
    return 0 if plan.num_parts == 1 else plan.num_parts * part_numel(sizes)


_recorded = threading.local()  # .launches: the list recording_decode_launches fills, in this thread


@contextmanager
def recording_decode_launches() -> Iterator[list[AttentionSizes]]:
    """The sizes of every decode attention launch (decode_attention, decode_attention_rope) this
    thread makes inside the block: all that a launch's plan depends on besides the context bound
    (meta.max_seq_len), so a decode graph's warm-up tells whether another bound would plan otherwise."""
    outer = getattr(_recorded, "launches", None)
    _recorded.launches = launches = []
    try:
        yield launches
    finally:
        _recorded.launches = outer


def note_decode_launch(sizes: AttentionSizes) -> None:
    """Record a decode launch's sizes where recording_decode_launches is on in this thread."""
    launches = getattr(_recorded, "launches", None)
    if launches is not None:
        launches.append(sizes)


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
    note_decode_launch(sizes)
    plan = _plan_for(sizes, meta.max_seq_len, workspace.numel if workspace is not None else 0)
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
        shared_mem=decode_smem_bytes(sizes), stream=stream)
