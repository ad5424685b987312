"""Decode steps replayed from CUDA graphs, one graph per padded batch-size bucket.

A bucket's inputs live in one static device buffer. Each step pads its host inputs
to the bucket, copies them into that buffer in one H2D copy, and replays the graph.
The first step of a bucket runs the forward once eagerly (loading kernels, planning
GEMMs, sizing the rope table) and then captures it. If capturing fails, the bucket
runs eagerly from then on and that step raises GraphCaptureError.

Padding rows are harmless: token 0 at position 0, a negative slot (the KV write
skips it), a context of 1 read from block 0, logits that nobody samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..base import AttentionMetadata
from ..dtypes import DType
from .attention_metadata import CudaAttentionMetadata
from .driver import DeviceLostError
from .graphs import GraphCaptureError, GraphSlot, bucket_for, capture, default_buckets
from .memory import MemoryPool
from .tensor import DeviceTensor
from .transfer import pack_layout

log = logging.getLogger("sparkd.cuda.graphs")


@dataclass
class DecodeInputs:
    """What a decode forward reads, all on the device.

    token_ids, positions, logits_indices (= arange(B)): [B] int32."""

    token_ids: DeviceTensor
    positions: DeviceTensor
    attn: CudaAttentionMetadata
    logits_indices: DeviceTensor


DecodeForward = Callable[[DecodeInputs], DeviceTensor]  # -> logits [B, V] float32


class DecodeGraphRunner:
    """Runs decode steps through captured graphs.

    max_blocks_per_seq and max_seq_len bound every step a graph will serve (from
    --max-model-len); the attention kernels size their grids from them."""

    def __init__(self, ops, max_batch_size: int, max_blocks_per_seq: int, max_seq_len: int,
                 buckets: list[int] | None = None):
        self.ops = ops
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = max_seq_len
        self.buckets = sorted(buckets or default_buckets(max_batch_size))
        self.pool = MemoryPool("decode graphs")  # shared: graphs replay one at a time on one stream
        self._slots = {size: GraphSlot(size) for size in self.buckets}
        self._inputs: dict[int, tuple[DeviceTensor, DecodeInputs]] = {}
        self._outputs: dict[int, DeviceTensor] = {}

    def run(self, forward: DecodeForward, token_ids: np.ndarray, positions: np.ndarray,
            meta: AttentionMetadata) -> DeviceTensor:
        """Logits [B, V] of one decode step (one new token per sequence).

        Raises GraphCaptureError when this step's bucket failed to capture."""
        if not meta.is_decode_only:
            raise ValueError("DecodeGraphRunner runs decode-only steps; run mixed steps eagerly")
        batch = len(token_ids)
        slot = self._slots.get(bucket_for(batch, self.buckets))
        if slot is None or slot.eager_only:
            arrays = pad_decode_inputs(token_ids, positions, meta, batch, meta.block_tables.shape[1])
            return forward(self._views(self.ops.staging.upload(arrays), meta.max_seq_len))
        region, inputs = self._static_inputs(slot.size)
        self.ops.staging.upload(pad_decode_inputs(token_ids, positions, meta, slot.size, self.max_blocks_per_seq),
                                dest=region)
        if slot.graph is None:
            self._capture(slot, forward, inputs)
        slot.graph.replay(self.ops.stream)
        return self._outputs[slot.size].narrow(0, batch)

    def _static_inputs(self, size: int) -> tuple[DeviceTensor, DecodeInputs]:
        if size not in self._inputs:
            shapes = pad_decode_shapes(size, self.max_blocks_per_seq)
            offsets, total = pack_layout([DType.int32.itemsize * int(np.prod(s)) for s in shapes])
            region = self.ops.allocator.empty((total,), DType.uint8)
            views = [DeviceTensor(region.ptr + o, s, DType.int32, None, region.owner) for o, s in zip(offsets, shapes)]
            self._inputs[size] = region, self._views(views, self.max_seq_len)
        return self._inputs[size]

    @staticmethod
    def _views(tensors: list[DeviceTensor], max_seq_len: int) -> DecodeInputs:
        token_ids, positions, query_start_loc, seq_lens, block_tables, slots, logits_indices = tensors
        attn = CudaAttentionMetadata(query_start_loc, seq_lens, block_tables, slots, 1, max_seq_len)
        return DecodeInputs(token_ids, positions, attn, logits_indices)

    def _capture(self, slot: GraphSlot, forward: DecodeForward, inputs: DecodeInputs) -> None:
        forward(inputs)  # warm-up: nothing may load, plan or grow while capturing
        try:
            with self.ops.allocator.use_pool(self.pool):
                slot.graph, self._outputs[slot.size] = capture(self.ops.stream, lambda: forward(inputs))
        except DeviceLostError:
            raise
        except Exception as err:
            slot.eager_only = True
            log.warning("capturing the decode graph for batch size %d failed (%s: %s); that size runs eagerly "
                        "from now on", slot.size, type(err).__name__, err)
            raise GraphCaptureError(f"decode graph capture failed for batch size {slot.size}: {err}",
                                    bucket=slot.size) from err
        log.info("captured the decode graph for batch size %d", slot.size)

    def close(self) -> None:
        """Destroy the graphs and free their memory pool."""
        for slot in self._slots.values():
            if slot.graph is not None:
                slot.graph.destroy()
                slot.graph = None
        self._outputs.clear()
        self.ops.stream.synchronize()
        self.ops.allocator.release_cached(self.pool)


def pad_decode_shapes(size: int, max_blocks: int) -> list[tuple[int, ...]]:
    """Shapes of the arrays `pad_decode_inputs` returns."""
    return [(size,), (size,), (size + 1,), (size,), (size, max_blocks), (size,), (size,)]


def pad_decode_inputs(token_ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata, size: int,
                      max_blocks: int) -> list[np.ndarray]:
    """int32 [token_ids, positions, query_start_loc, seq_lens, block_tables, slot_mapping,
    logits_indices], padded from B to `size` rows and block tables to `max_blocks` columns."""
    batch = len(token_ids)
    if batch > size or meta.block_tables.shape[1] > max_blocks:
        raise ValueError(f"a decode step of {batch} sequences x {meta.block_tables.shape[1]} blocks does not "
                         f"fit a bucket of {size} x {max_blocks}")

    def padded(values: np.ndarray, fill: int) -> np.ndarray:
        out = np.full(size, fill, dtype=np.int32)
        out[:batch] = values
        return out

    block_tables = np.zeros((size, max_blocks), dtype=np.int32)
    block_tables[:batch, : meta.block_tables.shape[1]] = meta.block_tables
    return [
        padded(token_ids, 0),
        padded(positions, 0),
        np.arange(size + 1, dtype=np.int32),
        padded(meta.seq_lens, 1),
        block_tables,
        padded(meta.slot_mapping, -1),
        np.arange(size, dtype=np.int32),
    ]
