"""CUDA graph capture and replay, the abort-capture guard, and decode buckets.

The fault-injection hook (SPARKD_TEST_FAIL_GRAPH_CAPTURE, test-only) makes a
capture fail the way a real mistake does; the stream must stay usable and later
steps must succeed."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.base import AttentionMetadata
from sparkd.backend.cuda.decode_graphs import DecodeLayout, stage_decode_inputs
from sparkd.backend.cuda.graphs import FAIL_CAPTURE_ENV, bucket_for, default_buckets
from sparkd.backend.dtypes import DType

VOCAB = 11

# out[b, v] = 1000 * token[b] + positions[b] + 0.5 * seq_lens[b] + v: every input shows in the logits.
FAKE_LOGITS = """
__global__ void fake_logits(float* out, const int* tokens, const int* positions, const int* seq_lens, int vocab) {
  const int b = blockIdx.x, v = threadIdx.x;
  if (v < vocab) out[b * vocab + v] = 1000.f * tokens[b] + positions[b] + 0.5f * seq_lens[b] + v;
}
"""


def expected_logits(tokens, positions, seq_lens):
    return (1000.0 * tokens + positions + 0.5 * seq_lens)[:, None] + np.arange(VOCAB)[None, :]


def decode_meta(rng, batch, block_size=4, max_blocks=3):
    seq_lens = rng.integers(1, block_size * max_blocks + 1, size=batch).astype(np.int32)
    block_tables = rng.integers(0, 50, size=(batch, max_blocks)).astype(np.int32)
    positions = seq_lens - 1
    slots = block_tables[np.arange(batch), positions // block_size] * block_size + positions % block_size
    return positions, AttentionMetadata(np.arange(batch + 1, dtype=np.int32), seq_lens, block_tables,
                                        slots.astype(np.int32), 1, int(seq_lens.max()))


# ---- host-only ----

def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(5) == [1, 2, 4, 5]
    assert default_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert default_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_for(3, [1, 2, 4, 8]) == 4 and bucket_for(9, [1, 2, 4, 8]) is None


def device_image(layout, host, batch, width, region):
    """What the runner's two H2D copies make of a bucket's region: the per-step bytes as
    staged, then the step's [batch, width] block ids into rows max_blocks wide."""
    start = layout.block_tables_offset
    region[:start] = host[:start]
    table = region[start:start + 4 * layout.size * layout.max_blocks].view(np.int32).reshape(layout.size, -1)
    table[:batch, :width] = host[start:start + 4 * batch * width].view(np.int32).reshape(batch, width)
    return [region[o:o + 4 * int(np.prod(s))].view(np.int32).reshape(s) for o, s in zip(layout.offsets, layout.shapes)]


def test_staging_pads_the_rows_and_moves_only_the_steps_block_columns():
    rng = np.random.default_rng(0)
    layout = DecodeLayout.for_bucket(8, 5)
    assert all(offset % 256 == 0 for offset in layout.offsets)
    region = np.zeros(layout.total, np.uint8)  # zeroed at allocation, as the runner does
    host = np.full(layout.staged_bytes(8, 5), 0x7F, np.uint8)  # a slot dirty from earlier steps
    for batch in (6, 3):  # a smaller step after a larger one: what it leaves stale must not matter
        positions, meta = decode_meta(rng, batch)
        tokens = rng.integers(0, 100, batch).astype(np.int32)
        stage_decode_inputs(host, layout, tokens, positions, meta)
        token_ids, pos, seq_lens, slots, tables, _, _ = device_image(layout, host, batch, 3, region)
        np.testing.assert_array_equal(token_ids[:batch], tokens)
        np.testing.assert_array_equal(pos[:batch], positions)
        np.testing.assert_array_equal(seq_lens[:batch], meta.seq_lens)
        np.testing.assert_array_equal(slots[:batch], meta.slot_mapping)
        np.testing.assert_array_equal(tables[:batch, :3], meta.block_tables)
        assert (token_ids[batch:] == 0).all() and (pos[batch:] == 0).all()
        assert (seq_lens[batch:] == 1).all() and (slots[batch:] == -1).all()
        assert ((tables >= 0) & (tables < 50)).all()  # stale or zero: always a real block id
    with pytest.raises(ValueError, match="does not fit"):
        stage_decode_inputs(host, DecodeLayout.for_bucket(2, 5), tokens, positions, meta)
    with pytest.raises(ValueError, match="does not fit"):
        stage_decode_inputs(host, DecodeLayout.for_bucket(8, 2), tokens, positions, meta)


def test_a_hybrid_layout_stages_state_slots_with_padding_rows_on_the_spare_slot():
    """A hybrid model's bucket keeps state_slots among the per-step arrays (one copy still moves
    them all) and a snapshot_start after the constants; the dense arrays keep their offsets."""
    rng = np.random.default_rng(4)
    dense, hybrid = DecodeLayout.for_bucket(8, 5), DecodeLayout.for_bucket(8, 5, with_state=True)
    assert hybrid.per_step_names == ("token_ids", "positions", "seq_lens", "slot_mapping", "state_slots")
    assert hybrid.names[-1] == "snapshot_start" and hybrid.shapes[-1] == (9,)
    assert all(dense.offset(n) == hybrid.offset(n) for n in dense.per_step_names)
    host = np.full(hybrid.staged_bytes(8, 5), 0x7F, np.uint8)
    positions, meta = decode_meta(rng, 3)
    meta.state_slots = np.array([5, 0, 2], np.int32)
    stage_decode_inputs(host, hybrid, rng.integers(0, 100, 3).astype(np.int32), positions, meta, padding_state_slot=9)
    offset = hybrid.offset("state_slots")
    np.testing.assert_array_equal(host[offset:offset + 32].view(np.int32), [5, 0, 2, 9, 9, 9, 9, 9])


# ---- on the device ----

@pytest.fixture
def fake_forward(gpu, compile_test_kernel):
    kernel = compile_test_kernel(FAKE_LOGITS, "fake_logits")
    calls = []

    def forward(inputs):
        batch = inputs.token_ids.shape[0]
        out = gpu.empty((batch, VOCAB), DType.float32)
        kernel.launch(batch, 32, [out, inputs.token_ids, inputs.positions, inputs.attn.seq_lens, np.int32(VOCAB)],
                      stream=gpu.stream)
        calls.append(batch)
        return out

    forward.calls = calls
    return forward


def run_step(gpu, runner, forward, rng, batch):
    from sparkd.backend.cuda.tensor import DeviceTensor

    positions, meta = decode_meta(rng, batch)
    tokens = rng.integers(0, 100, size=batch).astype(np.int32)
    logits = runner.run(forward, tokens, positions, meta)
    assert isinstance(logits, DeviceTensor) and logits.shape == (batch, VOCAB)
    np.testing.assert_array_equal(gpu.download(logits), expected_logits(tokens, positions, meta.seq_lens))


@pytest.mark.gpu
def test_capture_then_replay_with_new_inputs(gpu, fake_forward):
    from sparkd.backend.cuda.decode_graphs import DecodeGraphRunner

    runner = DecodeGraphRunner(gpu, max_batch_size=8, max_blocks_per_seq=3, max_seq_len=12)
    rng = np.random.default_rng(1)
    try:
        run_step(gpu, runner, fake_forward, rng, 3)  # warm-up + capture + replay of bucket 4
        assert fake_forward.calls == [4, 4]
        for batch in (3, 4, 2, 1, 4):  # replays only: the forward is not called again for seen buckets
            run_step(gpu, runner, fake_forward, rng, batch)
        assert fake_forward.calls == [4, 4, 2, 2, 1, 1]
        assert not gpu.stream.is_capturing()
    finally:
        runner.close()


@pytest.mark.gpu
def test_steps_larger_than_every_bucket_run_eagerly(gpu, fake_forward):
    from sparkd.backend.cuda.decode_graphs import DecodeGraphRunner

    runner = DecodeGraphRunner(gpu, max_batch_size=4, max_blocks_per_seq=3, max_seq_len=12)
    run_step(gpu, runner, fake_forward, np.random.default_rng(2), 6)
    assert fake_forward.calls == [6]
    runner.close()


@pytest.mark.gpu
def test_injected_capture_failure_fails_one_step_and_leaves_the_stream_usable(gpu, fake_forward, monkeypatch):
    from sparkd.backend.cuda.decode_graphs import DecodeGraphRunner
    from sparkd.backend.cuda.graphs import GraphCaptureError

    runner = DecodeGraphRunner(gpu, max_batch_size=8, max_blocks_per_seq=3, max_seq_len=12)
    rng = np.random.default_rng(3)
    monkeypatch.setenv(FAIL_CAPTURE_ENV, "1")
    with pytest.raises(GraphCaptureError) as info:
        run_step(gpu, runner, fake_forward, rng, 2)
    assert info.value.bucket == 2
    assert not gpu.stream.is_capturing()
    monkeypatch.delenv(FAIL_CAPTURE_ENV)
    try:
        for step in range(10):  # the failed bucket now runs eagerly; the others capture
            run_step(gpu, runner, fake_forward, rng, 1 + step % 4)
        assert runner.slots.get(2).eager_only and runner.slots.get(2).graph is None
        assert runner.slots.get(4).graph is not None
    finally:
        runner.close()


@pytest.mark.gpu
def test_capture_guard_survives_an_illegal_call_inside_the_capture(gpu):
    """A stream synchronize while capturing invalidates the capture (GPU-FACTS.md)."""
    from sparkd.backend.cuda.driver import CudaError
    from sparkd.backend.cuda.graphs import capture
    from sparkd.backend.cuda.transfer import copy_device

    src = gpu.upload(np.arange(64, dtype=np.float32))
    dst = gpu.empty((64,), DType.float32)

    def illegal():
        copy_device(dst, src, gpu.stream)
        gpu.stream.synchronize()

    with pytest.raises(CudaError, match="CAPTURE"):
        capture(gpu.stream, illegal)
    assert not gpu.stream.is_capturing()
    copy_device(dst, src, gpu.stream)
    np.testing.assert_array_equal(gpu.download(dst), np.arange(64))


@pytest.mark.gpu
def test_a_captured_copy_replays_on_every_launch(gpu):
    from sparkd.backend.cuda.graphs import capture
    from sparkd.backend.cuda.transfer import copy_device, copy_to_device

    src = gpu.upload(np.zeros(32, dtype=np.float32))
    dst = gpu.empty((32,), DType.float32)
    graph, _ = capture(gpu.stream, lambda: copy_device(dst, src, gpu.stream))
    try:
        for value in (1.0, 2.0, 3.0):
            host = np.full(32, value, dtype=np.float32)
            copy_to_device(src, host, gpu.stream)
            graph.replay(gpu.stream)
            np.testing.assert_array_equal(gpu.download(dst), host)
    finally:
        graph.destroy()


# ---- captures with a side branch (`Ops.beside`): both streams must leave capture mode ----

class ForkedSum:
    """On CudaOps fp32: rows [T, 64] -> rows @ w_side^T (side work) + rows @ w_main^T (the block
    beside it), [T, VOCAB] float32; `forward` is that of a decode step's token embeddings."""

    def __init__(self, ops, rng):
        self.ops = ops
        self.host = [rng.standard_normal(shape).astype(np.float32) for shape in ((100, 64), (VOCAB, 64), (VOCAB, 64))]
        self.table, self.w_side, self.w_main = (ops.upload(a) for a in self.host)

    def __call__(self, rows, fail_in: str | None = None):
        """fail_in: "side work" or "block" make an illegal call there (a stream synchronize, which
        invalidates a capture), "python" raises a plain error in the block."""
        ops = self.ops

        def side_work():
            out = ops.linear(rows, self.w_side)
            if fail_in == "side work":
                ops.stream.synchronize()  # the side stream's, which the capture has taken in
            return out

        with ops.beside(side_work) as side:
            main = ops.linear(rows, self.w_main)
            if fail_in == "block":
                ops.stream.synchronize()
            if fail_in == "python":
                raise RuntimeError("failed in the block")
        return ops.add(side.result, main)

    def forward(self, inputs):
        return self(self.ops.embedding(inputs.token_ids, self.table))

    def expected(self, tokens):
        table, w_side, w_main = (a.astype(np.float64) for a in self.host)
        return table[tokens] @ (w_side + w_main).T


@pytest.fixture
def forked_sum(cuda_ops_factory):
    return ForkedSum(cuda_ops_factory("float32"), np.random.default_rng(7))


def assert_no_stream_captures(ops):
    assert not ops.stream.is_capturing() and not ops.lanes.side.stream.is_capturing()
    assert ops.lanes.current is ops.lanes.main


def forked_step(runner, forked, rng, batch, rel_error):
    positions, meta = decode_meta(rng, batch)
    tokens = rng.integers(0, 100, size=batch).astype(np.int32)
    logits = forked.ops.download(runner.run(forked.forward, tokens, positions, meta))
    assert rel_error(logits, forked.expected(tokens)) <= 1e-5


@pytest.mark.gpu
def test_an_injected_failure_after_a_fork_fails_one_step_and_leaves_both_streams_usable(forked_sum, monkeypatch,
                                                                                         rel_error):
    from sparkd.backend.cuda.decode_graphs import DecodeGraphRunner
    from sparkd.backend.cuda.graphs import GraphCaptureError

    runner = DecodeGraphRunner(forked_sum.ops, max_batch_size=8, max_blocks_per_seq=3, max_seq_len=12)
    rng = np.random.default_rng(8)
    monkeypatch.setenv(FAIL_CAPTURE_ENV, "1")
    with pytest.raises(GraphCaptureError):
        forked_step(runner, forked_sum, rng, 2, rel_error)
    assert_no_stream_captures(forked_sum.ops)
    monkeypatch.delenv(FAIL_CAPTURE_ENV)
    try:
        for step in range(8):  # bucket 2 runs eagerly, its fork too; the others capture theirs
            forked_step(runner, forked_sum, rng, 1 + step % 4, rel_error)
        assert runner.slots.get(2).eager_only and runner.slots.get(4).graph is not None
        assert_no_stream_captures(forked_sum.ops)
    finally:
        runner.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fail_in, error", [("side work", "CAPTURE"), ("block", "CAPTURE"),
                                            ("python", "failed in the block")])
def test_a_capture_that_fails_inside_a_fork_leaves_both_streams_usable(forked_sum, rel_error, fail_in, error):
    """An invalidating call on either stream between fork and join, or a plain error there: the guard
    ends the capture, neither stream is left capturing, and an eager fork and a new capture with one
    then give the right sums."""
    from sparkd.backend.cuda.graphs import capture

    ops = forked_sum.ops
    tokens = np.arange(4, dtype=np.int32)
    rows = ops.embedding(ops.upload(tokens), forked_sum.table)
    with pytest.raises(Exception, match=error):
        capture(ops.stream, lambda: forked_sum(rows, fail_in))
    assert_no_stream_captures(ops)
    assert rel_error(ops.download(forked_sum(rows)), forked_sum.expected(tokens)) <= 1e-5
    graph, out = capture(ops.stream, lambda: forked_sum(rows))
    try:
        graph.replay(ops.stream)
        assert rel_error(ops.download(out), forked_sum.expected(tokens)) <= 1e-5
        assert_no_stream_captures(ops)
    finally:
        graph.destroy()
