"""A step's attention metadata on the device: what `CudaOps.prepare_attention` returns
and what the attention and rope/KV-write launchers read."""

from __future__ import annotations

from dataclasses import dataclass

from .tensor import DeviceTensor


@dataclass
class CudaAttentionMetadata:
    """Device views of `AttentionMetadata` (all int32), plus host-side bounds.

    query_start_loc: [B+1]   seq_lens: [B]   block_tables: [B, max_blocks]   slot_mapping: [T]
    max_query_len, max_seq_len: upper bounds for sizing grids. Inside a captured
    decode graph they are the graph's bounds (1 and the longest context the graph
    serves), not the step's: a launcher must take lengths from the device arrays and
    treat these only as limits.
    Hybrid models only (else None): state_slots [B]; the snapshots, by sequence,
    snapshot_start [B+1] into snapshot_offsets / snapshot_slots [S] (None when S is 0).
    """

    query_start_loc: DeviceTensor
    seq_lens: DeviceTensor
    block_tables: DeviceTensor
    slot_mapping: DeviceTensor
    max_query_len: int
    max_seq_len: int
    state_slots: DeviceTensor | None = None
    snapshot_start: DeviceTensor | None = None
    snapshot_offsets: DeviceTensor | None = None
    snapshot_slots: DeviceTensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
