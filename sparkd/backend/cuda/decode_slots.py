"""Which decode graph serves a step: a slot per (padded batch size, context bound).

Decode attention plans how it splits each sequence's keys from the longest context it may
meet (CudaAttentionMetadata.max_seq_len), and a graph replays the plan it was captured with.
So every batch bucket has a graph planned for max_seq_len (--max-model-len), and a bucket
whose attention would split otherwise at SHORT_CONTEXT keys has a second one planned for
that bound, which serves the steps whose every context fits it. Host bookkeeping only: the
runner (decode_graphs.py) captures and replays the graphs.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from .graphs import GraphSlot, bucket_for
from .kernels.attention import planned_decode
from .kernels.attention_plan import AttentionSizes

# Measured on the H200 (Llama-3.1-8B, 32 layers, batch-1 decode forward after a 128-token prompt,
# one process): graphs planned for 8272 keys 236.7 tok/s, for 1024 keys 238.6 (+0.8%). At batch 1
# the 8272-key plan is 42 splits merged through the workspace, the 1024-key one a single cluster
# of 8 merged on chip.
SHORT_CONTEXT = 1024


def plans_differ(launches: list[AttentionSizes], max_seq_len: int, other: int) -> bool:
    """Whether any of these decode attention launches plans otherwise at the two context bounds.
    Where none does, graphs captured at either bound would launch the same kernels on the same
    grids: a second graph would only cost memory and capture time."""
    return any(planned_decode(sizes, max_seq_len) != planned_decode(sizes, other) for sizes in launches)


class DecodeSlots:
    """The slots of a runner's decode graphs, by (padded batch size, context bound).

    Every bucket has a slot at max_seq_len; `add` gives one a slot at short_context too
    (None when short_context is not below max_seq_len: a bound that long plans no differently)."""

    def __init__(self, buckets: list[int], max_seq_len: int, short_context: int = SHORT_CONTEXT):
        self.buckets = sorted(buckets)
        self.max_seq_len = max_seq_len
        self.short_context = short_context if short_context < max_seq_len else None
        self._slots = {(size, max_seq_len): GraphSlot(size, max_seq_len) for size in self.buckets}

    def get(self, size: int, max_seq_len: int | None = None) -> GraphSlot | None:
        """The slot of a bucket at a context bound (default max_seq_len); None where there is none."""
        return self._slots.get((size, max_seq_len or self.max_seq_len))

    def add(self, slot: GraphSlot) -> None:
        """Give a bucket its short-context slot, once its capture was tried: a step never meets
        a slot that has neither a graph nor a failed capture behind it."""
        if (self.short_context is None or slot.max_seq_len != self.short_context
                or (slot.size, self.max_seq_len) not in self._slots):
            raise ValueError(f"no short-context slot for batch size {slot.size} at {slot.max_seq_len} keys "
                             f"(buckets {self.buckets}, short_context {self.short_context})")
        self._slots[slot.size, slot.max_seq_len] = slot

    def pending(self, size: int) -> bool:
        """Whether a bucket's graphs are still to capture: its full-length slot, always captured
        first, has neither a graph nor a failed capture."""
        slot = self._slots[size, self.max_seq_len]
        return slot.graph is None and not slot.eager_only

    def for_step(self, batch: int, seq_lens: np.ndarray) -> GraphSlot | None:
        """The slot of a decode step of `batch` sequences with contexts seq_lens [batch] (after the
        step): its bucket's short-context slot when there is one and every context fits it, else
        the full-length one; None for a batch larger than every bucket. The bucket's padding rows
        (context 1) fit any bound."""
        size = bucket_for(batch, self.buckets)
        if size is None:
            return None
        longest = int(seq_lens.max()) if len(seq_lens) else 1
        short = self._slots.get((size, self.short_context))
        return short if short is not None and longest <= short.max_seq_len else self._slots[size, self.max_seq_len]

    def __iter__(self) -> Iterator[GraphSlot]:
        return iter(self._slots.values())
