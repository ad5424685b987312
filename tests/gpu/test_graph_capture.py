"""CUDA graph capture and replay, the abort-capture guard, and decode buckets.

The fault-injection hook (SPARKD_TEST_FAIL_GRAPH_CAPTURE, test-only) makes a
capture fail the way a real mistake does; the stream must stay usable and later
steps must succeed."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.base import AttentionMetadata
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
def test_replays_take_the_ids_an_earlier_step_drew_on_the_device(gpu, fake_forward):
    """Async scheduling: some rows' ids are still being drawn when the step is staged; the upload
    puts them in from the device, on captures and replays alike."""
    from sparkd.backend.base import DrawnTokens
    from sparkd.backend.cuda.decode_graphs import DecodeGraphRunner

    runner = DecodeGraphRunner(gpu, max_batch_size=8, max_blocks_per_seq=3, max_seq_len=12)
    rng = np.random.default_rng(9)
    try:
        for batch, num_drawn in ((3, 2), (3, 3), (8, 8), (1, 1), (5, 0)):
            positions, meta = decode_meta(rng, batch)
            tokens = rng.integers(0, 100, size=batch).astype(np.int32)
            drawn_ids = rng.integers(100, 200, size=6).astype(np.int32)
            rows = rng.choice(batch, size=num_drawn, replace=False).astype(np.int32)
            drawn = DrawnTokens(rows, gpu.upload(drawn_ids), rng.integers(0, 6, num_drawn).astype(np.int32))
            logits = runner.run(fake_forward, tokens, positions, meta, drawn)
            tokens[rows] = drawn_ids[drawn.drawn_rows]
            np.testing.assert_array_equal(gpu.download(logits), expected_logits(tokens, positions, meta.seq_lens))
        assert fake_forward.calls == [4, 4, 8, 8, 1, 1]  # bucket 8 replays for the step of 5
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
def test_resources_released_while_capturing_wait_for_the_capture_to_end(gpu):
    """Freeing pinned memory synchronises the device, which would invalidate the capture, and the
    garbage collector may drop its last reference in the middle of one; a stream's waits too."""
    from sparkd.backend.cuda.driver import Stream
    from sparkd.backend.cuda.graphs import capture
    from sparkd.backend.cuda.transfer import PinnedBuffer, copy_device

    src = gpu.upload(np.arange(64, dtype=np.float32))
    dst = gpu.empty((64,), DType.float32)
    doomed = [PinnedBuffer(1 << 16), Stream()]

    def work():
        copy_device(dst, src, gpu.stream)
        doomed.clear()  # their last references: released here, mid-capture
        copy_device(dst, src, gpu.stream)

    graph, _ = capture(gpu.stream, work)
    try:
        graph.replay(gpu.stream)
        np.testing.assert_array_equal(gpu.download(dst), np.arange(64))
    finally:
        graph.destroy()


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
