"""Decode steps replayed from CUDA graphs, one per padded batch-size bucket and context bound.

Every bucket has a graph whose attention is planned for max_seq_len keys, and where that plan
would split otherwise at SHORT_CONTEXT keys, one planned for that bound too, which serves the
steps whose every context fits it (`DecodeSlots`). A bucket's graphs share its inputs, one
static device region (`DecodeLayout`, decode_staging.py): they replay one at a time on one
stream. Each step stages its inputs in a pinned slot and one launch, before the replay, moves
them into the region and puts in the ids an earlier step drew on the device. The constants
(query_start_loc, logits_indices) are written once. Capturing a graph runs the forward once
eagerly first (loading kernels, planning GEMMs, sizing the rope table), on padding rows; a
bucket's full-length graph goes first, and its warm-up's decode attention launches decide
whether it gets a short one. The engine captures every bucket's graphs at start-up
(`capture_all`); a bucket not captured yet captures at its first step, which then replays a new
graph. A graph that fails to capture leaves its (batch size, context bound) slot eager from
then on, and a step that was capturing raises GraphCaptureError.

Padding rows are harmless: token 0 at position 0, a negative slot (the KV write
skips it), a context of 1, logits that nobody samples. Block-table entries a step
does not write keep the block ids of an earlier step (zeros at first), so they
always name real blocks; and the kernels read no entry past a row's context.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
from cuda.bindings import driver

from ..base import AttentionMetadata, DrawnTokens
from ..dtypes import DType
from .attention_metadata import CudaAttentionMetadata
from .decode_slots import SHORT_CONTEXT, DecodeSlots, plans_differ
from .decode_staging import DecodeLayout, stage_decode_inputs
from .driver import DeviceLostError, call
from .graphs import GraphCaptureError, GraphSlot, capture, default_buckets
from .kernels.attention import recording_decode_launches
from .kernels.decode_inputs import upload_decode_step
from .memory import MemoryPool
from .tensor import DeviceTensor

log = logging.getLogger("sparkd.cuda.graphs")

_NO_IDS = np.zeros(0, np.int32)
_NO_SEQUENCES = AttentionMetadata(query_start_loc=np.zeros(1, np.int32), seq_lens=_NO_IDS,
                                  block_tables=np.zeros((0, 1), np.int32), slot_mapping=_NO_IDS,
                                  max_query_len=1, max_seq_len=1)


@dataclass
class DecodeInputs:
    """What a decode forward reads, all on the device.

    token_ids, positions, logits_indices (= arange(B)): [B] int32."""

    token_ids: DeviceTensor
    positions: DeviceTensor
    attn: CudaAttentionMetadata
    logits_indices: DeviceTensor


DecodeForward = Callable[[DecodeInputs], DeviceTensor]  # -> logits [B, V] float32


@dataclass
class _StaticInputs:
    """A bucket's device region, seen as its graphs' inputs."""

    layout: DecodeLayout
    views: dict[str, DeviceTensor]  # int32, by DecodeLayout name
    words: DeviceTensor  # int32 [layout.total / 4], the whole region

    def inputs(self, max_seq_len: int) -> DecodeInputs:
        """The region as the inputs of a graph planned for contexts of up to max_seq_len keys."""
        return _decode_inputs(self.views, max_seq_len)


class DecodeGraphRunner:
    """Runs decode steps through captured graphs.

    max_blocks_per_seq and max_seq_len bound every step a graph will serve (from
    --max-model-len); the attention kernels size their grids from them, a short-context
    graph's from short_context (see DecodeSlots; tests set it small). A hybrid model's
    steps carry state slots too: padding_state_slot is the one its padding rows use (None:
    a model without linear-attention state)."""

    def __init__(self, ops, max_batch_size: int, max_blocks_per_seq: int, max_seq_len: int,
                 buckets: list[int] | None = None, padding_state_slot: int | None = None,
                 short_context: int = SHORT_CONTEXT):
        self.ops = ops
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = max_seq_len
        self.padding_state_slot = padding_state_slot
        self.slots = DecodeSlots(buckets or default_buckets(max_batch_size), max_seq_len, short_context)
        self.buckets = self.slots.buckets
        self.pool = MemoryPool("decode graphs")  # shared: graphs replay one at a time on one stream
        self._inputs: dict[int, _StaticInputs] = {}  # by batch size
        self._outputs: dict[tuple[int, int], DeviceTensor] = {}  # by (batch size, context bound)

    def run(self, forward: DecodeForward, token_ids: np.ndarray, positions: np.ndarray,
            meta: AttentionMetadata, drawn: DrawnTokens | None = None) -> DeviceTensor:
        """Logits [B, V] of one decode step (one new token per sequence).

        drawn: the step's token ids an earlier step drew on the device (token_ids holds
        anything at those rows), put in with the upload, before the forward.
        Raises GraphCaptureError when a graph of this step's bucket failed to capture now
        (the step does not run)."""
        if not meta.is_decode_only:
            raise ValueError("DecodeGraphRunner runs decode-only steps; run mixed steps eagerly")
        batch = len(token_ids)
        slot = self.slots.for_step(batch, meta.seq_lens)
        if slot is not None and self.slots.pending(slot.size):
            failures = self._capture_bucket(forward, slot.size)
            if failures:
                raise failures[0]
            slot = self.slots.for_step(batch, meta.seq_lens)  # the capture may have added a short slot
        if slot is None or slot.eager_only:
            inputs = self._eager_inputs(token_ids, positions, meta)
            if drawn is not None:
                self.ops.copy_drawn_tokens_(inputs.token_ids, drawn)
            return forward(inputs)
        self._upload_step(self._inputs[slot.size], token_ids, positions, meta, drawn)
        slot.graph.replay(self.ops.stream)
        slot.num_replays += 1
        return self._outputs[slot.size, slot.max_seq_len].narrow(0, batch)

    def capture_all(self, forward: DecodeForward) -> None:
        """Capture the graphs of every bucket not captured yet, each on a batch of padding rows.
        A graph that fails to capture leaves its slot eager (logged); nothing raises."""
        for size in self.buckets:
            if self.slots.pending(size):
                self._capture_bucket(forward, size)
        captured = [slot for slot in self.slots if slot.graph is not None]
        short = [slot.size for slot in captured if slot.max_seq_len != self.max_seq_len]
        log.info("captured %d decode graphs: %d planned for contexts up to %d keys, %d (batch sizes %s) for up to "
                 "%d", len(captured), len(captured) - len(short), self.max_seq_len, len(short), short,
                 self.slots.short_context or self.max_seq_len)

    def _capture_bucket(self, forward: DecodeForward, size: int) -> list[GraphCaptureError]:
        """Capture a bucket's graphs on padding rows (so a step that triggers this runs exactly
        once, in its replay: a hybrid model's recurrent state must not take a token twice). The
        full-length graph goes first: its warm-up sizes what both capture (the rope table, for
        max_seq_len positions), so nothing grows under a captured graph; and its decode attention
        launches tell whether a short-context graph would plan otherwise (else it would be the
        same graph). Returns the captures' failures, each already logged."""
        static = self._static_inputs(size)
        self._upload_step(static, _NO_IDS, _NO_IDS, _NO_SEQUENCES)
        with recording_decode_launches() as launches:  # the warm-up's and the capture's: the same sizes
            failures = [self._capture(self.slots.get(size), forward, static)]
        short = self.slots.short_context
        if short is not None and plans_differ(launches, self.max_seq_len, short):
            slot = GraphSlot(size, short)
            failures.append(self._capture(slot, forward, static))
            self.slots.add(slot)
        return [failure for failure in failures if failure is not None]

    def _upload_step(self, static: _StaticInputs, token_ids: np.ndarray, positions: np.ndarray,
                     meta: AttentionMetadata, drawn: DrawnTokens | None = None) -> None:
        """Stage a step in a pinned slot and enqueue the launch that moves it into the region."""
        layout = static.layout
        batch, width = meta.block_tables.shape
        with self.ops.staging.slot(layout.staged_bytes(batch, width)) as pinned:
            stage_decode_inputs(pinned.array, layout, token_ids, positions, meta, self.padding_state_slot or 0, drawn)
            upload_decode_step(static.words, pinned.device_ptr, layout.block_tables_offset // DType.int32.itemsize,
                               layout.size, layout.max_blocks, batch, width, None if drawn is None else drawn.ids,
                               self.ops.stream)

    def _static_inputs(self, size: int) -> _StaticInputs:
        if size not in self._inputs:
            layout = DecodeLayout.for_bucket(size, self.max_blocks_per_seq, self.padding_state_slot is not None)
            region = self.ops.allocator.empty((layout.total,), DType.uint8)
            # Steps write only their own block-table columns: the rest must hold real block ids.
            call(driver.cuMemsetD8Async, region.ptr, 0, region.nbytes, self.ops.stream.handle)
            constants_offset = layout.offset("query_start_loc")
            constants = DeviceTensor(region.ptr + constants_offset, (layout.total - constants_offset,), DType.uint8,
                                     None, region.owner)
            values = {"query_start_loc": np.arange(size + 1), "logits_indices": np.arange(size),
                      "snapshot_start": np.zeros(size + 1)}
            self.ops.staging.upload([values[name].astype(np.int32) for name in
                                     layout.names[layout.names.index("query_start_loc"):]], dest=constants)
            views = {name: DeviceTensor(region.ptr + offset, shape, DType.int32, None, region.owner)
                     for name, offset, shape in zip(layout.names, layout.offsets, layout.shapes)}
            words = DeviceTensor(region.ptr, (layout.total // DType.int32.itemsize,), DType.int32, None, region.owner)
            self._inputs[size] = _StaticInputs(layout, views, words)
        return self._inputs[size]

    def _eager_inputs(self, token_ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata) -> DecodeInputs:
        """A step no graph serves, uploaded as it is: B rows, W block-table columns."""
        arrays = {"token_ids": token_ids, "positions": positions, "seq_lens": meta.seq_lens,
                  "slot_mapping": meta.slot_mapping, "block_tables": meta.block_tables,
                  "query_start_loc": meta.query_start_loc, "logits_indices": np.arange(len(token_ids))}
        if self.padding_state_slot is not None:
            arrays |= {"state_slots": meta.state_slots, "snapshot_start": np.zeros(len(token_ids) + 1)}
        uploaded = self.ops.staging.upload([np.asarray(a, np.int32) for a in arrays.values()])
        return _decode_inputs(dict(zip(arrays, uploaded)), meta.max_seq_len)

    def _capture(self, slot: GraphSlot, forward: DecodeForward, static: _StaticInputs) -> GraphCaptureError | None:
        """Warm up and capture a slot's graph on the padding rows in its bucket's region. A failed
        capture leaves the slot eager (logged) and is returned."""
        inputs = static.inputs(slot.max_seq_len)
        forward(inputs)  # warm-up: nothing may load, plan or grow while capturing
        try:
            with self.ops.allocator.use_pool(self.pool):
                slot.graph, self._outputs[slot.size, slot.max_seq_len] = capture(self.ops.stream,
                                                                                  lambda: forward(inputs))
        except DeviceLostError:
            raise
        except Exception as err:
            slot.eager_only = True
            log.warning("capturing the decode graph for batch size %d, contexts up to %d keys, failed (%s: %s); "
                        "those steps run eagerly from now on", slot.size, slot.max_seq_len, type(err).__name__, err)
            error = GraphCaptureError(f"decode graph capture failed for batch size {slot.size}, contexts up to "
                                      f"{slot.max_seq_len} keys: {err}", bucket=slot.size)
            error.__cause__ = err
            return error
        log.info("captured the decode graph for batch size %d, contexts up to %d keys", slot.size, slot.max_seq_len)
        return None

    def close(self) -> None:
        """Destroy the graphs and free their memory pool."""
        for slot in self.slots:
            if slot.graph is not None:
                slot.graph.destroy()
                slot.graph = None
        self._outputs.clear()
        self.ops.stream.synchronize()
        self.ops.allocator.release_cached(self.pool)


def _decode_inputs(tensors: dict[str, DeviceTensor], max_seq_len: int) -> DecodeInputs:
    """DecodeInputs from int32 tensors by DecodeLayout name, attention planned for max_seq_len keys."""
    attn = CudaAttentionMetadata(tensors["query_start_loc"], tensors["seq_lens"], tensors["block_tables"],
                                 tensors["slot_mapping"], 1, max_seq_len, tensors.get("state_slots"),
                                 tensors.get("snapshot_start"))
    return DecodeInputs(tensors["token_ids"], tensors["positions"], attn, tensors["logits_indices"])
