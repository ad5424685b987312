"""Host-only stand-ins for what a DecodeGraphRunner asks of the device, so that its bookkeeping
(which graph a step replays, which slot a failed capture leaves eager) runs with no GPU: ops
whose memory is never touched, captures that run the work and hand back a graph that counts its
replays, and a decode forward that launches Llama-3.1-8B's decode attention only on paper."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from device_fakes import H200Device
from sparkd.backend.base import AttentionMetadata
from sparkd.backend.cuda import decode_graphs
from sparkd.backend.cuda.kernels import attention
from sparkd.backend.cuda.kernels.attention_plan import AttentionSizes
from sparkd.backend.cuda.tensor import DeviceTensor
from sparkd.backend.dtypes import DType

VOCAB = 11
BLOCK_SIZE = 16


class FakeAllocator:
    """Addresses that are never dereferenced, 256 bytes apart at least."""

    def __init__(self):
        self.next_ptr = 0x100000
        self.released = []

    def empty(self, shape, dtype):
        tensor = DeviceTensor(self.next_ptr, shape, dtype)
        self.next_ptr += -(-max(tensor.nbytes, 1) // 256) * 256
        return tensor

    @contextmanager
    def use_pool(self, pool):
        yield pool

    def release_cached(self, pool=None) -> int:
        self.released.append(pool)
        return 0


@dataclass
class FakePinned:
    array: np.ndarray
    ptr: int = 0
    device_ptr: int = 0


class FakeStaging:
    def __init__(self, allocator: FakeAllocator):
        self.allocator = allocator

    @contextmanager
    def slot(self, nbytes: int):
        yield FakePinned(np.zeros(nbytes, np.uint8))

    def upload(self, arrays, dest=None):
        return [self.allocator.empty(np.shape(a), DType.int32) for a in arrays]


class FakeStream:
    handle = None
    capturing = False

    def is_capturing(self) -> bool:
        return self.capturing

    def synchronize(self) -> None:
        pass


class FakeGraphOps:
    def __init__(self):
        self.allocator = FakeAllocator()
        self.staging = FakeStaging(self.allocator)
        self.stream = FakeStream()


@dataclass
class FakeGraph:
    replays: int = 0
    destroyed: bool = False

    def replay(self, stream) -> None:
        self.replays += 1

    def destroy(self) -> None:
        self.destroyed = True


def fake_capture(stream: FakeStream, work):
    stream.capturing = True
    try:
        result = work()
    finally:
        stream.capturing = False
    return FakeGraph(), result


def patch_device(monkeypatch) -> None:
    """Take the device out of decode_graphs (memset, the inputs' upload, capture) and give the
    attention plan an H200's numbers."""
    for name in ("call", "upload_decode_step"):
        monkeypatch.setattr(decode_graphs, name, lambda *args: None)
    monkeypatch.setattr(decode_graphs, "capture", fake_capture)
    monkeypatch.setattr(attention, "current_device", H200Device)


@dataclass
class LlamaForward:
    """A decode forward whose 32 layers each note a decode attention launch of Llama-3.1-8B's
    shapes (bf16, 32 query and 8 kv heads of 128, the fused rope kernel up to batch 2), and which
    returns logits [B, VOCAB]. calls: (batch, the bound it planned for, capturing) per forward.
    fail_at: (bound, capturing): the next forward planned for that bound, captured or not
    (a warm-up), raises (once)."""

    ops: FakeGraphOps
    fail_at: tuple[int, bool] | None = None
    calls: list = field(default_factory=list)

    def __call__(self, inputs):
        batch, bound, capturing = inputs.token_ids.shape[0], inputs.attn.max_seq_len, self.ops.stream.capturing
        self.calls.append((batch, bound, capturing))
        for _ in range(32):
            attention.note_decode_launch(AttentionSizes(batch, 32, 8, 128, BLOCK_SIZE, batch, DType.bfloat16,
                                                        fused_rope=batch <= 2))
        if (bound, capturing) == self.fail_at:
            self.fail_at = None
            raise RuntimeError("an illegal call while capturing" if capturing else "a failed warm-up")
        return self.ops.allocator.empty((batch, VOCAB), DType.float32)


def decode_step(seq_lens) -> tuple[np.ndarray, np.ndarray, AttentionMetadata]:
    """token_ids, positions and metadata of a decode step whose contexts after it are seq_lens."""
    seq_lens = np.asarray(seq_lens, np.int32)
    batch, width = len(seq_lens), -(-int(seq_lens.max()) // BLOCK_SIZE)
    meta = AttentionMetadata(np.arange(batch + 1, dtype=np.int32), seq_lens, np.zeros((batch, width), np.int32),
                             seq_lens - 1, 1, int(seq_lens.max()))
    return np.zeros(batch, np.int32), seq_lens - 1, meta
