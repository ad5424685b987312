"""Paged causal attention with GQA in numpy: the reference for the CUDA kernels.

K/V live in a paged cache [NB, Hkv, BS, D]; a sequence's key at context position j
is in block `block_tables[s, j // BS]`, row `j % BS`. A step mixes decodes
(one new query) and prefill chunks (several new queries after earlier context that
is already cached). Sequences are padded into at most two groups, decodes and
prefill chunks, so a long chunk does not pad every decode to its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..base import AttentionMetadata
from .gdn import StateSegment


@dataclass
class SequenceGroup:
    """Sequences of one step padded to a common query length Lq and context length S.

    rows:         [B, Lq] int64, row in T of each query; padding repeats a real row.
    valid:        [B, Lq] bool, False on padding.
    block_tables: [B, max_blocks] int32.
    allowed:      [B, 1, 1, Lq, S] bool, causal mask: query i of sequence s sits at
                  context position seq_len - query_len + i and sees keys 0..that.
    """

    rows: np.ndarray
    valid: np.ndarray
    block_tables: np.ndarray
    allowed: np.ndarray


@dataclass
class AttentionPlan:
    """What `NumpyOps.prepare_attention` returns: the step's groups and KV write slots.

    write_rows: [W] rows of T whose K/V are written; write_slots: [W] their cache slots
    (slot_mapping entries < 0 mark padding tokens and are skipped)."""

    groups: list[SequenceGroup]
    write_rows: np.ndarray
    write_slots: np.ndarray
    state_segments: list[StateSegment] = field(default_factory=list)  # hybrid models: each sequence's state slot


def plan_attention(meta: AttentionMetadata) -> AttentionPlan:
    query_start = np.asarray(meta.query_start_loc, dtype=np.int64)
    query_lens = np.diff(query_start)
    seq_lens = np.asarray(meta.seq_lens, dtype=np.int64)
    block_tables = np.asarray(meta.block_tables, dtype=np.int64)
    is_decode = query_lens == 1
    groups = [
        _group(query_start[:-1][members], query_lens[members], seq_lens[members], block_tables[members])
        for members in (is_decode, ~is_decode)
        if members.any()
    ]
    slots = np.asarray(meta.slot_mapping, dtype=np.int64)
    write_rows = np.flatnonzero(slots >= 0)
    snapshots: dict[int, list[tuple[int, int]]] = {}
    for b, offset, slot in np.asarray(meta.state_snapshots if meta.state_snapshots is not None else [],
                                      np.int64).reshape(-1, 3):
        snapshots.setdefault(int(b), []).append((int(offset), int(slot)))
    segments = [] if meta.state_slots is None else [
        StateSegment(int(start), int(start + length), int(seq_len - length), int(slot), tuple(snapshots.get(b, ())))
        for b, (start, length, seq_len, slot) in enumerate(zip(query_start[:-1], query_lens, seq_lens,
                                                               meta.state_slots))]
    return AttentionPlan(groups=groups, write_rows=write_rows, write_slots=slots[write_rows], state_segments=segments)


def _group(starts: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray) -> SequenceGroup:
    query_idx = np.arange(query_lens.max())  # [Lq]
    key_pos = np.arange(seq_lens.max())  # [S]
    rows = starts[:, None] + np.minimum(query_idx[None, :], query_lens[:, None] - 1)
    valid = query_idx[None, :] < query_lens[:, None]
    query_pos = (seq_lens - query_lens)[:, None] + query_idx[None, :]  # [B, Lq]
    allowed = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Lq, S]
    return SequenceGroup(rows=rows, valid=valid, block_tables=block_tables, allowed=allowed[:, None, None])


def write_kv(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, plan: AttentionPlan) -> None:
    """k, v [T, Hkv, D] -> caches [NB, Hkv, BS, D] at the plan's slots."""
    block_size = k_cache.shape[2]
    blocks, offsets = np.divmod(plan.write_slots, block_size)
    k_cache[blocks, :, offsets] = k[plan.write_rows]
    v_cache[blocks, :, offsets] = v[plan.write_rows]


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, plan: AttentionPlan, scale: float) -> np.ndarray:
    """q [T, Hq, D], caches [NB, Hkv, BS, D] -> [T, Hq, D] float32."""
    out = np.empty(q.shape, dtype=np.float32)
    for group in plan.groups:
        out[group.rows[group.valid]] = _attend_group(q, k_cache, v_cache, group, scale)[group.valid]
    return out


def _attend_group(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, group: SequenceGroup, scale: float) -> np.ndarray:
    """-> [B, Lq, Hq, D] for the group's padded queries."""
    batch, query_len = group.rows.shape
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[1]
    group_size = num_heads // num_kv_heads  # query heads sharing one kv head
    # Query head h reads kv head h // group_size, as HF's repeat_kv lays them out.
    q_grouped = q[group.rows].reshape(batch, query_len, num_kv_heads, group_size, head_dim)
    q_grouped = q_grouped.transpose(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group_size * query_len, head_dim)
    keys = _gather(k_cache, group)  # [B, Hkv, S, D]
    values = _gather(v_cache, group)
    scores = np.matmul(q_grouped, keys.swapaxes(-1, -2)) * np.float32(scale)  # [B, Hkv, G*Lq, S]
    scores = scores.reshape(batch, num_kv_heads, group_size, query_len, -1)
    scores = np.where(group.allowed, scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.matmul(probs.reshape(batch, num_kv_heads, group_size * query_len, -1), values)
    out = out.reshape(batch, num_kv_heads, group_size, query_len, head_dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, query_len, num_heads, head_dim)


def _gather(cache: np.ndarray, group: SequenceGroup) -> np.ndarray:
    """cache [NB, Hkv, BS, D] -> each sequence's keys 0..S-1, [B, Hkv, S, D]."""
    block_size = cache.shape[2]
    key_pos = np.arange(group.allowed.shape[-1])
    num_blocks_needed = -(-len(key_pos) // block_size)
    if group.block_tables.shape[1] < num_blocks_needed:
        raise ValueError(
            f"block_tables has {group.block_tables.shape[1]} columns but a sequence of "
            f"{len(key_pos)} tokens needs {num_blocks_needed} blocks of {block_size}"
        )
    blocks = group.block_tables[:, key_pos // block_size]  # [B, S]
    # Advanced indices split by a slice put their broadcast dims first: [B, S, Hkv, D].
    return cache[blocks, :, key_pos % block_size].transpose(0, 2, 1, 3)
