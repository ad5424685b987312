"""A decode graph bucket's inputs: how they lie in its static device region and in a step's
pinned staging slot, and how a step fills the slot.

The region holds the per-step arrays, padded to the bucket, then the block table [bucket,
max_blocks], then constants written once. A step's slot holds the same per-step arrays, then
only the step's B x W part of the block table, then each token row's source (the id the host
staged, or one an earlier step drew on the device that the host does not know yet). One
launch (kernels/decode_inputs.py) reads the slot through its device mapping and writes the
region: a step moves B x W block ids, not bucket x max_model_len / block_size (8 MB at 256
sequences of 128k tokens), and pays one launch instead of three copies and a gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..base import AttentionMetadata, DrawnTokens
from ..dtypes import DType
from .transfer import pack_layout

_INT32 = DType.int32.itemsize
# The per-step arrays of every model, in layout order, and the value of their padding rows:
# token 0 at position 0 with a context of 1, and no KV write. A hybrid model's state_slots
# follow them (padding rows use the runner's padding_state_slot, fresh sequences that write a
# slot no one reads).
_PER_STEP = ("token_ids", "positions", "seq_lens", "slot_mapping")
_PADDING = {"token_ids": 0, "positions": 0, "seq_lens": 1, "slot_mapping": -1}
STAGED_ID = -1  # a token row's source: the id the host staged


@dataclass(frozen=True)
class DecodeLayout:
    """Byte offsets of a bucket's inputs, the same in its device region and its staging slot.

    In order (int32): token_ids, positions, seq_lens, slot_mapping [size] each (and a hybrid
    model's state_slots [size]); the per-step arrays, all before `block_tables_offset`. Then
    block_tables [size, max_blocks], where the staging slot holds just the step's [B, W] part,
    rows W wide, followed by the token rows' sources [size]. Then the region's constants
    query_start_loc [size + 1] and logits_indices [size] (and a hybrid model's snapshot_start
    [size + 1]: zeros, decode steps take no snapshots)."""

    size: int
    max_blocks: int
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    total: int

    @classmethod
    def for_bucket(cls, size: int, max_blocks: int, with_state: bool = False) -> DecodeLayout:
        names = (_PER_STEP + (("state_slots",) if with_state else ()) + ("block_tables", "query_start_loc",
                 "logits_indices") + (("snapshot_start",) if with_state else ()))
        offsets, total = pack_layout([_INT32 * int(np.prod(_shape(name, size, max_blocks))) for name in names])
        return cls(size, max_blocks, names, tuple(offsets), total)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [_shape(name, self.size, self.max_blocks) for name in self.names]

    def offset(self, name: str) -> int:
        return self.offsets[self.names.index(name)]

    @property
    def per_step_names(self) -> tuple[str, ...]:
        return self.names[: self.names.index("block_tables")]

    @property
    def block_tables_offset(self) -> int:
        return self.offset("block_tables")

    def sources_offset(self, batch: int, width: int) -> int:
        """Where a staging slot of `batch` sequences x `width` blocks holds its sources."""
        return self.block_tables_offset + _INT32 * batch * width

    def staged_bytes(self, batch: int, width: int) -> int:
        """Bytes of staging a step of `batch` sequences x `width` blocks fills."""
        return self.sources_offset(batch, width) + _INT32 * self.size


def _shape(name: str, size: int, max_blocks: int) -> tuple[int, ...]:
    return {"block_tables": (size, max_blocks), "query_start_loc": (size + 1,),
            "snapshot_start": (size + 1,)}.get(name, (size,))


def stage_decode_inputs(host: np.ndarray, layout: DecodeLayout, token_ids: np.ndarray, positions: np.ndarray,
                        meta: AttentionMetadata, padding_state_slot: int = 0, drawn: DrawnTokens | None = None) -> None:
    """Write a decode step of B sequences into `host` (uint8, at least
    layout.staged_bytes(B, W)): token_ids, positions, seq_lens and slot_mapping (and
    state_slots, whose padding rows get padding_state_slot) padded to layout.size rows,
    then meta.block_tables [B, W] compact at block_tables_offset, then the sources [size]:
    drawn.drawn_rows at drawn.rows, STAGED_ID elsewhere."""
    batch, width = meta.block_tables.shape
    if batch > layout.size or width > layout.max_blocks:
        raise ValueError(f"a decode step of {batch} sequences x {width} blocks does not fit a bucket of "
                         f"{layout.size} x {layout.max_blocks}")
    values = {"token_ids": token_ids, "positions": positions, "seq_lens": meta.seq_lens,
              "slot_mapping": meta.slot_mapping, "state_slots": meta.state_slots}
    padding = {**_PADDING, "state_slots": padding_state_slot}
    for name in layout.per_step_names:
        column = _words(host, layout.offset(name), layout.size)
        column[:batch] = values[name] if batch else []
        column[batch:] = padding[name]
    _words(host, layout.block_tables_offset, batch * width).reshape(batch, width)[:] = meta.block_tables
    sources = _words(host, layout.sources_offset(batch, width), layout.size)
    sources[:] = STAGED_ID
    if drawn is not None:
        sources[drawn.rows] = drawn.drawn_rows


def _words(host: np.ndarray, offset: int, count: int) -> np.ndarray:
    """The int32 view of `count` words of the uint8 buffer `host` from byte `offset`."""
    return host[offset : offset + _INT32 * count].view(np.int32)
