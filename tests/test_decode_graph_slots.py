"""Decode graphs by batch size and context bound, on the host: which graph a step replays, which
buckets get a short-context graph (from the attention plan on an H200's numbers), and which
(batch size, context bound) slot a failed capture leaves eager. The device is faked
(graph_fakes.py); the GPU tests replay the real graphs."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from device_fakes import H200Device
from graph_fakes import FakeGraphOps, LlamaForward, decode_step, patch_device
from sparkd.backend.cuda.decode_graphs import DecodeGraphRunner
from sparkd.backend.cuda.decode_slots import DecodeSlots, plans_differ
from sparkd.backend.cuda.decode_staging import DecodeLayout, stage_decode_inputs
from sparkd.backend.cuda.graphs import GraphCaptureError, GraphSlot, default_buckets
from sparkd.backend.cuda.kernels import attention
from sparkd.backend.cuda.kernels.attention_plan import AttentionSizes
from sparkd.backend.dtypes import DType

MAX_MODEL_LEN = 8272  # tools/bench_decode.py's: an 8k prompt and its decode steps
SHORT = 1024


def bound_of(slot) -> tuple[int, int]:
    return slot.size, slot.max_seq_len


def test_a_step_takes_the_short_graph_while_every_context_fits_its_bound():
    slots = DecodeSlots([1, 2, 4, 8], MAX_MODEL_LEN, SHORT)
    for size in (1, 4):
        slots.add(GraphSlot(size, SHORT))
    assert bound_of(slots.for_step(1, np.array([SHORT]))) == (1, SHORT)
    assert bound_of(slots.for_step(1, np.array([SHORT + 1]))) == (1, MAX_MODEL_LEN)
    # Three sequences in bucket 4: its padding row does not count, one long context does.
    assert bound_of(slots.for_step(3, np.array([5, SHORT, 7]))) == (4, SHORT)
    assert bound_of(slots.for_step(3, np.array([5, SHORT + 1, 7]))) == (4, MAX_MODEL_LEN)
    assert bound_of(slots.for_step(2, np.array([3, 4]))) == (2, MAX_MODEL_LEN)  # bucket 2 has no short graph
    assert slots.for_step(9, np.ones(9, np.int32)) is None  # larger than every bucket: eager
    assert sorted(bound_of(slot) for slot in slots) == [(1, SHORT), (1, MAX_MODEL_LEN), (2, MAX_MODEL_LEN),
                                                        (4, SHORT), (4, MAX_MODEL_LEN), (8, MAX_MODEL_LEN)]


def test_padding_rows_fit_the_short_bound():
    """What a short graph's padding rows read on the device: a context of 1."""
    layout = DecodeLayout.for_bucket(4, -(-MAX_MODEL_LEN // 16))
    token_ids, positions, meta = decode_step([SHORT, 3, 9])
    host = np.zeros(layout.staged_bytes(3, meta.block_tables.shape[1]), np.uint8)
    stage_decode_inputs(host, layout, token_ids, positions, meta)
    offset = layout.offset("seq_lens")
    np.testing.assert_array_equal(host[offset:offset + 16].view(np.int32), [SHORT, 3, 9, 1])


def test_no_short_slots_unless_the_bound_is_below_max_model_len():
    slots = DecodeSlots([1, 2], SHORT, SHORT)
    assert slots.short_context is None
    with pytest.raises(ValueError, match="no short-context slot"):
        slots.add(GraphSlot(1, SHORT))
    assert bound_of(slots.for_step(1, np.array([3]))) == (1, SHORT)
    slots = DecodeSlots([1, 2], MAX_MODEL_LEN, SHORT)
    for wrong in (GraphSlot(3, SHORT), GraphSlot(1, 2 * SHORT)):  # not a bucket; not the short bound
        with pytest.raises(ValueError, match="no short-context slot"):
            slots.add(wrong)


def test_llama_8b_splits_otherwise_at_the_short_bound_up_to_batch_8(monkeypatch):
    """Llama-3.1-8B's 8 kv heads on an H200's 132 SMs: from batch 24 a batch is never split, and
    batch 16 splits in one cluster of 8 at either bound, so a short graph would repeat the long one."""
    monkeypatch.setattr(attention, "current_device", H200Device)

    def llama(batch):
        return [AttentionSizes(batch, 32, 8, 128, 16, batch, DType.bfloat16, fused_rope=batch <= 2)]

    assert [b for b in default_buckets(64) if plans_differ(llama(b), MAX_MODEL_LEN, SHORT)] == [1, 2, 4, 8]
    assert not plans_differ([], MAX_MODEL_LEN, SHORT)  # a forward without attention (all linear)


@pytest.fixture
def runner(monkeypatch):
    patch_device(monkeypatch)
    ops = FakeGraphOps()
    graphs = DecodeGraphRunner(ops, max_batch_size=64, max_blocks_per_seq=-(-MAX_MODEL_LEN // 16),
                               max_seq_len=MAX_MODEL_LEN)
    yield graphs
    graphs.close()


def test_capture_all_adds_short_graphs_only_where_the_plan_changes(runner, caplog):
    forward = LlamaForward(runner.ops)
    with caplog.at_level(logging.INFO, logger="sparkd.cuda.graphs"):
        runner.capture_all(forward)
    captured = sorted(bound_of(slot) for slot in runner.slots if slot.graph is not None)
    assert captured == sorted([(size, MAX_MODEL_LEN) for size in runner.buckets] + [(s, SHORT) for s in (1, 2, 4, 8)])
    assert "captured 15 decode graphs" in caplog.text
    # Each graph: a warm-up, then the capture, planned for its own bound; a bucket's full-length one first.
    bounds = [(size, bound) for size in runner.buckets for bound in (MAX_MODEL_LEN, SHORT)[:2 if size <= 8 else 1]]
    assert forward.calls == [(size, bound, capturing) for size, bound in bounds for capturing in (False, True)]


def test_steps_replay_the_graph_of_their_longest_context(runner):
    forward = LlamaForward(runner.ops)
    runner.capture_all(forward)
    captures = len(forward.calls)
    for seq_lens in ([200], [SHORT], [SHORT + 1], [SHORT - 1, 7, 3], [7, SHORT + 5, 3], [40] * 16):
        logits = runner.run(forward, *decode_step(seq_lens))
        assert logits.shape == (len(seq_lens), 11)
    assert len(forward.calls) == captures  # replays only
    replays = {bound_of(slot): slot.num_replays for slot in runner.slots if slot.num_replays}
    assert replays == {(1, SHORT): 2, (1, MAX_MODEL_LEN): 1, (4, SHORT): 1, (4, MAX_MODEL_LEN): 1,
                       (16, MAX_MODEL_LEN): 1}
    assert all(slot.graph.replays == slot.num_replays for slot in runner.slots)


def test_a_failed_short_capture_leaves_that_pair_eager_and_fails_only_its_step(runner, caplog):
    """A bucket captures at its first step: the full-length graph, then the short one, which fails.
    That step raises GraphCaptureError and runs nothing; from then on the bucket's short steps
    run eagerly, its long ones replay, and other buckets capture both graphs."""
    forward = LlamaForward(runner.ops, fail_at=(SHORT, True))
    with caplog.at_level(logging.WARNING, logger="sparkd.cuda.graphs"):
        with pytest.raises(GraphCaptureError, match="contexts up to 1024 keys") as info:
            runner.run(forward, *decode_step([100]))
    assert info.value.bucket == 1 and "batch size 1, contexts up to 1024 keys, failed" in caplog.text
    short, full = runner.slots.get(1, SHORT), runner.slots.get(1)
    assert short.eager_only and short.graph is None and full.graph is not None and not full.num_replays
    assert forward.calls == [(1, MAX_MODEL_LEN, False), (1, MAX_MODEL_LEN, True), (1, SHORT, False),
                             (1, SHORT, True)]  # warm-ups and captures only: the step did not run
    forward.calls.clear()
    runner.run(forward, *decode_step([101]))
    assert forward.calls == [(1, 101, False)]  # eagerly, planned for its own context
    runner.run(forward, *decode_step([SHORT + 1]))
    assert full.num_replays == 1 and len(forward.calls) == 1
    runner.run(forward, *decode_step([5, 6]))
    assert runner.slots.get(2, SHORT).num_replays == 1 and runner.slots.get(2).graph is not None
    assert [bound_of(slot) for slot in runner.slots if slot.eager_only] == [(1, SHORT)]


def test_a_short_warm_up_that_raises_leaves_the_bucket_to_its_long_graph(runner):
    """An error outside the capture (the warm-up) reaches the step as it is; the bucket then has no
    short slot, so its short steps replay the long graph, which serves any context."""
    forward = LlamaForward(runner.ops, fail_at=(SHORT, False))
    with pytest.raises(RuntimeError, match="a failed warm-up"):
        runner.run(forward, *decode_step([100]))
    assert runner.slots.get(1, SHORT) is None and not runner.slots.pending(1)
    runner.run(forward, *decode_step([100]))
    assert runner.slots.get(1).num_replays == 1


def test_close_destroys_every_graph_and_frees_their_pool(runner):
    runner.capture_all(LlamaForward(runner.ops))
    graphs = [slot.graph for slot in runner.slots]
    runner.close()
    assert all(graph.destroyed for graph in graphs) and all(slot.graph is None for slot in runner.slots)
    assert runner.ops.allocator.released == [runner.pool]
