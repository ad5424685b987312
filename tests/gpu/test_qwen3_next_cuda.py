"""Qwen3-Next on CudaOps in fp32 against the numpy backend: whole prompts, prompts in chunks
carried through the state pool (snapshots included), and decode steps replayed from a CUDA
graph whose padding rows write the spare state slot.

Logits: max |a - b| / max |b| per row <= 1e-4 (the bound the dense fp32 models meet) and the
same argmax.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

BLOCK_SIZE, BLOCKS_PER_SEQ = 4, 48
NUM_SLOTS = 8  # slots 0-3 for sequences, 4-6 for snapshots, 7 the graphs' padding rows
RTOL = 1e-4


@pytest.fixture(scope="module", params=[40, 48], ids=["shared-expert-beside", "shared-expert-folded"])
def model_pair(request, tmp_path_factory, cuda_ops_factory):
    """(NumpyOps model, CudaOps fp32 model) of one tiny checkpoint; a shared expert of the routed
    experts' width (48) is stacked as one more of them (ModelConfig.folds_shared_expert), and runs
    among them in decode steps of few tokens, beside them (views of the stacks) in the others."""
    oracle = pytest.importorskip("oracle")
    from sparkd.backend.cpu.ops import NumpyOps
    from sparkd.models.registry import load_model

    path, _ = oracle.make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_next"), "Qwen3NextForCausalLM",
                                          **oracle.tiny_hybrid_overrides(head_dim=64,
                                                                         shared_expert_intermediate_size=request.param))
    return load_model(path, NumpyOps()), load_model(path, cuda_ops_factory("float32"))


def caches(model, num_seqs: int) -> list:
    from oracle import layer_caches

    return layer_caches(model, num_seqs, NUM_SLOTS, BLOCK_SIZE, BLOCKS_PER_SEQ)


def step_logits(model, layer_caches, sequences, num_cached, slots, snapshots=None) -> np.ndarray:
    from oracle import step_inputs

    step = step_inputs(sequences, num_cached, block_size=BLOCK_SIZE, blocks_per_seq=BLOCKS_PER_SEQ)
    step.meta.state_slots = np.array(slots, np.int32)
    step.meta.state_snapshots = snapshots
    ops = model.ops
    attn = ops.prepare_attention(step.meta)
    hidden = model.forward(ops.upload(step.token_ids), ops.upload(step.positions), attn, layer_caches)
    rows = ops.upload(np.arange(len(step.token_ids), dtype=np.int32))
    return ops.download(model.compute_logits(hidden, rows))


def assert_rows_close(actual, expected):
    err = np.abs(actual - expected).max(axis=-1) / np.abs(expected).max(axis=-1)
    assert np.all(err <= RTOL), f"max relative error {err.max():.2e}"
    np.testing.assert_array_equal(actual.argmax(-1), expected.argmax(-1))


def test_prompts_in_chunks_match_the_cpu_backend(model_pair):
    """Three prompts in one step, then each continued by a chunk (one across 64 tokens) that
    writes snapshots mid-chunk: the logits, every state slot, and a snapshot copied back into
    a sequence's slot match the CPU backend's."""
    cpu, gpu = model_pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cpu.config.vocab_size, n).tolist() for n in (9, 30, 100)]
    firsts = [p[: len(p) // 3] for p in prompts]
    cpu_caches, gpu_caches = caches(cpu, 3), caches(gpu, 3)
    assert_rows_close(step_logits(gpu, gpu_caches, firsts, None, [0, 1, 2]),
                      step_logits(cpu, cpu_caches, firsts, None, [0, 1, 2]))
    cached = [len(f) for f in firsts]
    snapshots = np.array([(0, 2, 4), (2, 40, 5), (2, 66, 6)], np.int32)
    assert_rows_close(step_logits(gpu, gpu_caches, prompts, cached, [0, 1, 2], snapshots),
                      step_logits(cpu, cpu_caches, prompts, cached, [0, 1, 2], snapshots))
    layers = cpu.config.linear_attention_layers
    gpu.ops.copy_state_slots_([gpu_caches[i] for i in layers], np.array([6], np.int32), np.array([3], np.int32))
    cpu.ops.copy_state_slots_([cpu_caches[i] for i in layers], np.array([6], np.int32), np.array([3], np.int32))
    for i in layers:
        for gpu_state, cpu_state in zip(gpu_caches[i], cpu_caches[i]):
            expected = cpu_state[: NUM_SLOTS - 1]
            actual = gpu.ops.download(gpu_state)[: NUM_SLOTS - 1]
            assert np.abs(actual - expected).max() <= RTOL * np.abs(expected).max()


@pytest.mark.parametrize("short_context", [None, 16], ids=["one-graph", "short-then-long"])
def test_decode_graphs_replay_with_state_slots(model_pair, short_context):
    """Bucket 4 (one padding row) replays its graph with new inputs on static state slots, and every
    step's logits match the CPU backend's. With short graphs for contexts up to 16 keys beside the
    192-key ones, the steps whose contexts fit 16 replay the short graph and the later ones the long
    graph, on the same state slots."""
    from oracle import step_inputs

    from sparkd.backend.cuda.decode_graphs import DecodeGraphRunner

    cpu, gpu = model_pair
    rng = np.random.default_rng(1)
    sequences = [rng.integers(3, cpu.config.vocab_size, n).tolist() for n in (7, 3, 12)]
    slots = [2, 0, 1]
    cpu_caches, gpu_caches = caches(cpu, 3), caches(gpu, 3)
    step_logits(cpu, cpu_caches, sequences, None, slots)
    step_logits(gpu, gpu_caches, sequences, None, slots)
    runner = DecodeGraphRunner(gpu.ops, max_batch_size=4, max_blocks_per_seq=BLOCKS_PER_SEQ,
                               max_seq_len=BLOCK_SIZE * BLOCKS_PER_SEQ, padding_state_slot=NUM_SLOTS - 1,
                               **({} if short_context is None else {"short_context": short_context}))

    def forward(inputs):
        hidden = gpu.forward(inputs.token_ids, inputs.positions, inputs.attn, gpu_caches)
        return gpu.compute_logits(hidden, inputs.logits_indices)

    try:
        for _ in range(8):  # the first step captures; the longest context after each step: 13, 14, ..., 20
            cached = [len(s) for s in sequences]
            sequences = [s + [int(rng.integers(cpu.config.vocab_size))] for s in sequences]
            step = step_inputs(sequences, cached, block_size=BLOCK_SIZE, blocks_per_seq=BLOCKS_PER_SEQ)
            step.meta.state_slots = np.array(slots, np.int32)
            logits = gpu.ops.download(runner.run(forward, step.token_ids, step.positions, step.meta))
            assert_rows_close(logits, step_logits(cpu, cpu_caches, sequences, cached, slots))
        full = runner.slots.get(4)
        if short_context is None:
            assert full.graph is not None and full.num_replays == 8
        else:
            short = runner.slots.get(4, short_context)
            assert short is not None, "the 192-key plan splits, the 16-key one cannot: bucket 4 needs a short graph"
            assert (short.num_replays, full.num_replays) == (4, 4)
    finally:
        runner.close()


def test_a_failed_hybrid_graph_capture_leaves_the_bucket_eager_and_right(model_pair, monkeypatch):
    """A capture that fails (SPARKD_TEST_FAIL_GRAPH_CAPTURE) fails that step only: the stream stays
    usable, the bucket runs eagerly from then on, and the state slots carry on correctly."""
    from oracle import step_inputs

    from sparkd.backend.cuda.decode_graphs import DecodeGraphRunner
    from sparkd.backend.cuda.graphs import FAIL_CAPTURE_ENV, GraphCaptureError

    cpu, gpu = model_pair
    rng = np.random.default_rng(2)
    sequences = [rng.integers(3, cpu.config.vocab_size, 10).tolist()]
    cpu_caches, gpu_caches = caches(cpu, 1), caches(gpu, 1)
    step_logits(cpu, cpu_caches, sequences, None, [0])
    step_logits(gpu, gpu_caches, sequences, None, [0])
    runner = DecodeGraphRunner(gpu.ops, max_batch_size=1, max_blocks_per_seq=BLOCKS_PER_SEQ,
                               max_seq_len=BLOCK_SIZE * BLOCKS_PER_SEQ, padding_state_slot=NUM_SLOTS - 1)

    def forward(inputs):
        hidden = gpu.forward(inputs.token_ids, inputs.positions, inputs.attn, gpu_caches)
        return gpu.compute_logits(hidden, inputs.logits_indices)

    def decode(token: int):
        nonlocal sequences
        cached = [len(sequences[0])]
        sequences = [sequences[0] + [token]]
        step = step_inputs(sequences, cached, block_size=BLOCK_SIZE, blocks_per_seq=BLOCKS_PER_SEQ)
        step.meta.state_slots = np.array([0], np.int32)
        return cached, step

    try:
        monkeypatch.setenv(FAIL_CAPTURE_ENV, "1")
        _, step = decode(5)
        with pytest.raises(GraphCaptureError):
            runner.run(forward, step.token_ids, step.positions, step.meta)
        monkeypatch.delenv(FAIL_CAPTURE_ENV)
        assert runner.slots.get(1).eager_only
        sequences = [sequences[0][:-1]]  # the failed step computed nothing (warm-up and capture ran padding rows)
        for token in (5, 7, 9):
            cached, step = decode(token)
            logits = gpu.ops.download(runner.run(forward, step.token_ids, step.positions, step.meta))
            assert_rows_close(logits, step_logits(cpu, cpu_caches, sequences, cached, [0]))
    finally:
        runner.close()
