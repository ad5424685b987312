"""CudaOps against NumpyOps: the glue around the kernels, whole tiny models in fp32,
and decode steps replayed from CUDA graphs.

Relative error is max |a - b| / max |b| per logits row: 1e-4 for whole fp32 models
(the bound the CPU backend meets against transformers), 1e-5 fp32 / 1e-2 bf16 for
single ops. The attention kernels support head_dim 64, 128 and 256, so the tiny
models use head_dim 64."""

from __future__ import annotations

import numpy as np
import pytest

from .moe_cases import ROUTER_EPS, router_case

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 8
MODEL_RTOL = 1e-4
VARIANTS = {
    "llama": ("LlamaForCausalLM", dict(head_dim=64)),
    "qwen2": ("Qwen2ForCausalLM", dict(head_dim=64)),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=64, num_key_value_heads=1)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_pair(request, tmp_path_factory, cuda_ops_factory):
    """(NumpyOps model, CudaOps fp32 model) loaded from one random checkpoint."""
    oracle = pytest.importorskip("oracle")
    from sparkd.backend.cpu.ops import NumpyOps
    from sparkd.models.registry import load_model

    arch, overrides = VARIANTS[request.param]
    path, _ = oracle.make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)
    return load_model(path, NumpyOps()), load_model(path, cuda_ops_factory("float32"))


def kv_caches(model, num_seqs):
    from oracle import num_kv_blocks

    c = model.config
    return model.ops.allocate_kv_cache(c.num_layers, num_kv_blocks(num_seqs, BLOCKS_PER_SEQ), BLOCK_SIZE,
                                       c.num_kv_heads, c.head_dim)


def step_logits(model, caches, sequences, num_cached=None) -> np.ndarray:
    """Logits [T, V] of every new token of one step."""
    from oracle import step_inputs

    step = step_inputs(sequences, num_cached, block_size=BLOCK_SIZE, blocks_per_seq=BLOCKS_PER_SEQ)
    ops = model.ops
    attn = ops.prepare_attention(step.meta)
    hidden = model.forward(ops.upload(step.token_ids), ops.upload(step.positions), attn, caches)
    rows = ops.upload(np.arange(len(step.token_ids), dtype=np.int32))
    return ops.download(model.compute_logits(hidden, rows))


def assert_rows_close(actual, expected, rtol):
    err = np.abs(actual - expected).max(axis=-1)
    scale = np.abs(expected).max(axis=-1)
    assert np.all(err <= rtol * scale), f"max relative error {np.max(err / scale):.2e}"
    np.testing.assert_array_equal(actual.argmax(-1), expected.argmax(-1))


def prompts(lengths, vocab, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def test_prefill_chunks_and_decode_match_the_cpu_backend(model_pair):
    cpu, gpu = model_pair
    sequences = prompts([13, 2, 6], cpu.config.vocab_size, seed=0)
    first_chunk = [len(s) // 2 for s in sequences]
    cpu_caches, gpu_caches = kv_caches(cpu, 3), kv_caches(gpu, 3)
    steps = [
        ([s[:n] for s, n in zip(sequences, first_chunk)], None),  # first prompt chunks, fresh caches
        (sequences, first_chunk),  # the rest, reading the cached chunks
        ([s + [7] for s in sequences], [len(s) for s in sequences]),  # one decode token each
    ]
    for step_sequences, cached in steps:
        assert_rows_close(step_logits(gpu, gpu_caches, step_sequences, cached),
                          step_logits(cpu, cpu_caches, step_sequences, cached), MODEL_RTOL)


def test_decode_graphs_replay_the_eager_logits(model_pair):
    from oracle import step_inputs

    from sparkd.backend.cuda.decode_graphs import DecodeGraphRunner

    cpu, gpu = model_pair
    sequences = prompts([9, 4, 12], cpu.config.vocab_size, seed=1)
    cpu_caches, gpu_caches = kv_caches(cpu, 3), kv_caches(gpu, 3)
    step_logits(cpu, cpu_caches, sequences)
    step_logits(gpu, gpu_caches, sequences)
    runner = DecodeGraphRunner(gpu.ops, max_batch_size=4, max_blocks_per_seq=BLOCKS_PER_SEQ,
                               max_seq_len=BLOCK_SIZE * BLOCKS_PER_SEQ)

    def forward(inputs):
        hidden = gpu.forward(inputs.token_ids, inputs.positions, inputs.attn, gpu_caches)
        return gpu.compute_logits(hidden, inputs.logits_indices)

    rng = np.random.default_rng(2)
    try:
        for _ in range(4):  # warm-up + capture, then replays with new inputs
            cached = [len(s) for s in sequences]
            sequences = [s + [int(rng.integers(cpu.config.vocab_size))] for s in sequences]
            step = step_inputs(sequences, cached, block_size=BLOCK_SIZE, blocks_per_seq=BLOCKS_PER_SEQ)
            logits = gpu.ops.download(runner.run(forward, step.token_ids, step.positions, step.meta))
            assert_rows_close(logits, step_logits(cpu, cpu_caches, sequences, cached), MODEL_RTOL)
        assert runner.slots.get(4).graph is not None
    finally:
        runner.close()


def test_decode_graphs_switch_to_the_long_graph_when_a_context_passes_the_short_bound(model_pair):
    """Graphs planned for 256 keys (a bound is only a limit: these caches hold 32), and a short
    graph per bucket for contexts up to 16, where the plan does not split. Greedy decoding from
    prompts of 9, 4 and 12 tokens replays bucket 4's short graph while every context fits 16 keys,
    then its long one, and matches the CPU backend's logits at every step."""
    from oracle import step_inputs

    from sparkd.backend.cuda.decode_graphs import DecodeGraphRunner

    cpu, gpu = model_pair
    sequences = prompts([9, 4, 12], cpu.config.vocab_size, seed=4)
    cpu_caches, gpu_caches = kv_caches(cpu, 3), kv_caches(gpu, 3)
    next_tokens = step_logits(cpu, cpu_caches, sequences)[np.cumsum([len(s) for s in sequences]) - 1].argmax(-1)
    step_logits(gpu, gpu_caches, sequences)
    runner = DecodeGraphRunner(gpu.ops, max_batch_size=4, max_blocks_per_seq=BLOCKS_PER_SEQ, max_seq_len=256,
                               short_context=16)

    def forward(inputs):
        hidden = gpu.forward(inputs.token_ids, inputs.positions, inputs.attn, gpu_caches)
        return gpu.compute_logits(hidden, inputs.logits_indices)

    try:
        for _ in range(8):  # the longest context after each step: 13, 14, ..., 20
            cached = [len(s) for s in sequences]
            sequences = [s + [int(t)] for s, t in zip(sequences, next_tokens)]
            step = step_inputs(sequences, cached, block_size=BLOCK_SIZE, blocks_per_seq=BLOCKS_PER_SEQ)
            logits = gpu.ops.download(runner.run(forward, step.token_ids, step.positions, step.meta))
            expected = step_logits(cpu, cpu_caches, sequences, cached)
            assert_rows_close(logits, expected, MODEL_RTOL)
            next_tokens = expected.argmax(-1)
        short, full = runner.slots.get(4, 16), runner.slots.get(4)
        assert short is not None, "the 256-key plan splits, the 16-key one cannot: bucket 4 needs a short graph"
        assert (short.num_replays, full.num_replays) == (4, 4)
    finally:
        runner.close()


def test_one_sequence_decodes_with_the_norms_inside_gemv(model_pair, monkeypatch):
    """With a GEMM table that gives every product of the model to gemv at one row, a decode step
    of one sequence runs each pre-norm inside the GEMV after it (gemv_norm), eagerly and replayed
    from a graph, and its logits still match the CPU backend's."""
    from oracle import step_inputs

    from sparkd.backend.cuda.decode_graphs import DecodeGraphRunner
    from sparkd.backend.cuda.gemm_table import GemmTable, Measurement, ShapeKey
    from sparkd.backend.cuda.kernels import gemv_norm

    cpu, gpu = model_pair
    ops = gpu.ops
    matrices = [m for layer in gpu.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj)] + [gpu.lm_head]
    table = GemmTable("test", "sm_00", entries={ShapeKey(*w.shape, w.dtype.name, 1): Measurement(0.1, 0.9)
                                                for w in matrices})
    monkeypatch.setattr(ops.gemm, "table", table)
    monkeypatch.setattr(ops, "fuse_norms", True)
    launches = []
    for name in ("gemv_norm", "gemv_norm_silu_and_mul"):
        launcher = getattr(gemv_norm, name)
        monkeypatch.setattr(gemv_norm, name, lambda *a, launcher=launcher, **kw: (launches.append(1), launcher(*a, **kw)))

    sequence = prompts([11], cpu.config.vocab_size, seed=3)
    cpu_caches, gpu_caches = kv_caches(cpu, 1), kv_caches(gpu, 1)
    step_logits(cpu, cpu_caches, sequence)
    step_logits(gpu, gpu_caches, sequence)
    assert not launches, "a prompt of 11 tokens takes the unfused ops"
    cached = [len(sequence[0])]
    sequence = [sequence[0] + [5]]
    assert_rows_close(step_logits(gpu, gpu_caches, sequence, cached), step_logits(cpu, cpu_caches, sequence, cached),
                      MODEL_RTOL)
    assert len(launches) == 2 * len(gpu.layers), "one fused launch per pre-norm"
    runner = DecodeGraphRunner(ops, max_batch_size=1, max_blocks_per_seq=BLOCKS_PER_SEQ,
                               max_seq_len=BLOCK_SIZE * BLOCKS_PER_SEQ)

    def forward(inputs):
        hidden = gpu.forward(inputs.token_ids, inputs.positions, inputs.attn, gpu_caches)
        return gpu.compute_logits(hidden, inputs.logits_indices)

    try:
        for token in (9, 2, 14):  # warm-up + capture, then replays with new inputs
            cached = [len(sequence[0])]
            sequence = [sequence[0] + [token]]
            step = step_inputs(sequence, cached, block_size=BLOCK_SIZE, blocks_per_seq=BLOCKS_PER_SEQ)
            logits = ops.download(runner.run(forward, step.token_ids, step.positions, step.meta))
            assert_rows_close(logits, step_logits(cpu, cpu_caches, sequence, cached), MODEL_RTOL)
        assert runner.slots.get(1).graph is not None
    finally:
        runner.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_glue_ops_match_numpy(cuda_ops_factory, rel_error, tolerance, dtype):
    from sparkd.backend.cpu.ops import NumpyOps

    ops, ref = cuda_ops_factory(dtype), NumpyOps()
    rng = np.random.default_rng(3)
    tol = tolerance[dtype]

    def on_device(array):
        return ops.upload(array.astype(np.float32), ops.dtype)

    def as_held(tensor):  # the reference sees the operands as the device holds them
        return ops.download(tensor).astype(np.float32)

    x, residual, w = (on_device(rng.standard_normal(s)) for s in [(5, 64), (5, 64), (64,)])
    x_h, residual_h, w_h = as_held(x), as_held(residual), as_held(w)
    y, new_residual = ops.add_rmsnorm(x, residual, w, 1e-6)
    y_ref, residual_ref = ref.add_rmsnorm(x_h, residual_h, w_h, 1e-6)
    assert rel_error(ops.download(new_residual), residual_ref) <= tol
    assert rel_error(ops.download(y), y_ref) <= tol

    qkv = on_device(rng.standard_normal((3, (4 + 2 * 2) * 64)))
    q, k, v = ops.split_heads(qkv, 4, 2, 64)
    q_ref, k_ref, v_ref = ref.split_heads(as_held(qkv), 4, 2, 64)
    q_norm = on_device(rng.standard_normal(64))
    assert rel_error(ops.download(ops.rmsnorm(q, q_norm, 1e-6)), ref.rmsnorm(q_ref, as_held(q_norm), 1e-6)) <= tol
    np.testing.assert_array_equal(ops.download(v), v_ref)

    weight, bias = on_device(rng.standard_normal((48, 64)) / 8), on_device(rng.standard_normal(48))
    expected = ref.linear(x_h.astype(np.float64), as_held(weight).astype(np.float64), as_held(bias))
    assert rel_error(ops.download(ops.linear(x, weight, bias)), expected) <= tol

    hidden, lm_head = on_device(rng.standard_normal((6, 64))), on_device(rng.standard_normal((100, 64)) / 8)
    indices = ops.upload(np.array([5, 0, 2], np.int32))
    logits = ops.logits(hidden, indices, w, 1e-6, lm_head)
    assert logits.dtype.name == "float32"
    expected = ref.logits(as_held(hidden), np.array([5, 0, 2]), w_h, 1e-6, as_held(lm_head))
    assert rel_error(ops.download(logits), expected) <= tol

    assert rel_error(ops.download(ops.add(x, residual)), x_h + as_held(residual)) <= tol
    gate_up = on_device(rng.standard_normal((5, 128)))
    assert rel_error(ops.download(ops.silu_and_mul(gate_up)), ref.silu_and_mul(as_held(gate_up))) <= tol
    assert ops.reshape(ops.silu_and_mul(gate_up), (-1,)).shape == (5 * 64,)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("num_tokens", [1, 3, 300])
def test_router_logits_are_the_unrounded_rows(cuda_ops_factory, rel_error, dtype, num_tokens):
    """add_rmsnorm_for_router + router_weight + the router GEMM sparse_moe runs give the logits
    of the normed rows before their rounding, as NumpyOps computes them in fp32, to 1e-5 in
    every dtype (bf16 / fp16 take the split [y | y_lo] @ [W | W]^T path on the tensor cores),
    and far closer than the rounded rows' logits in bf16. y is the rows rounded, as add_rmsnorm
    gives them."""
    ops = cuda_ops_factory(dtype)
    case = router_case(ops, np.random.default_rng(num_tokens), num_tokens, 256, 64)
    x, norm_weight, expected = case.x, case.norm_weight, case.expected_logits

    y, router_input, _ = ops.add_rmsnorm_for_router(x, case.residual, norm_weight, ROUTER_EPS)
    logits = ops.download(ops.linear(router_input, ops.router_weight(case.router), out_dtype=np.float32))
    assert rel_error(logits, expected) <= 1e-5
    y_plain, _ = ops.add_rmsnorm(x, ops.upload(case.residual_host, np.float32), norm_weight, ROUTER_EPS)
    np.testing.assert_array_equal(ops.download(y), ops.download(y_plain))
    if dtype == "bfloat16":
        rounded = ops.download(y).astype(np.float64) @ case.router_host.astype(np.float64).T
        assert rel_error(logits, expected) < rel_error(rounded, expected) / 30
