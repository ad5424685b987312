"""The whole engine on the GPU, for dense and mixture-of-experts models: greedy parity
with the CPU backend, bf16 agreement with fp32, KV sizing from device memory, the
abort-capture guard and a lost device under AsyncEngine.

fp32 runs must reproduce the CPU backend's greedy tokens exactly, through chunked
prefill, a prefix-cache hit, preemption and decode graphs. bf16 is compared with
fp32 teacher-forced, over prefill and decode steps; see that test for its bar. The
attention kernels support head_dim 64, 128 and 256, so the tiny models use 64.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sparkd import LLM, SamplingParams

pytestmark = pytest.mark.gpu

NUM_NEW = 32
ENGINE_ARGS = {"max_num_batched_tokens": 64, "max_num_seqs": 8}
VARIANTS = {
    "LlamaForCausalLM": {"head_dim": 64, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}},
    "Qwen2ForCausalLM": {"head_dim": 64, "tie_word_embeddings": True},
    "Qwen3ForCausalLM": {"head_dim": 64},
    # Experts narrower than the dense MLP of layer 1, so a mix-up shows; renormalised top-2.
    "Qwen3MoeForCausalLM": {"head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                            "norm_topk_prob": True, "mlp_only_layers": [1]},
    "MixtralForCausalLM": {"head_dim": 64, "num_local_experts": 8, "num_experts_per_tok": 2},
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
SHORT_BOUND = 32  # keys: the short-context graphs' bound in the tests that set it (see short_graphs)
BF16_MIN_TOP1_AGREEMENT = 0.99


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory, gpu):
    """(checkpoint dir, prompts, the CPU backend's greedy tokens for them)."""
    oracle = pytest.importorskip("oracle")
    arch = request.param
    path, model = oracle.make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, **VARIANTS[arch])
    prompts = oracle.make_prompts(np.random.default_rng(7), model.config.vocab_size)
    cpu = LLM(str(path), device="cpu", **ENGINE_ARGS)
    return path, prompts, token_ids(cpu.generate(prompts, GREEDY))


def cuda_llm(path, **engine_args) -> LLM:
    return LLM(str(path), device="cuda", dtype="float32", **{**ENGINE_ARGS, **engine_args})


def captured_buckets(engine) -> list[int]:
    """Batch sizes whose decode graph an LLMEngine has captured (a size twice where both its graphs are)."""
    return [slot.size for slot in engine.runner.decode_graphs.slots if slot.graph is not None]


def replayed_buckets(engine) -> list[int]:
    """Batch sizes whose decode graph served a step (a size twice where both its graphs did)."""
    return [slot.size for slot in engine.runner.decode_graphs.slots if slot.num_replays]


def assert_no_leaks(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_usage == 0.0
    scheduler.check_integrity()


def test_fp32_greedy_matches_cpu_with_chunking_prefix_hits_and_graphs(checkpoint):
    path, prompts, expected = checkpoint
    llm = cuda_llm(path)
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    graphs = llm.engine.runner.decode_graphs
    assert captured_buckets(llm.engine) == graphs.buckets  # all at start-up
    assert replayed_buckets(llm.engine), "no decode step was replayed from a CUDA graph"
    assert_no_leaks(llm)
    # The shared 37-token prefix is cached now: 2 full blocks of 16 must hit.
    again = llm.generate([prompts[3]], GREEDY)[0]
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == expected[3]
    assert_no_leaks(llm)


@pytest.fixture
def short_graphs(monkeypatch):
    """CudaOps' decode graphs with short-context graphs for up to SHORT_BOUND keys (the tiny
    models' max_model_len is 512), so a 16-token prompt passes the bound while it decodes."""
    from sparkd.backend.cuda.decode_graphs import DecodeGraphRunner
    from sparkd.backend.cuda.ops import CudaOps

    def decode_graph_runner(ops, max_batch_size, max_blocks_per_seq, max_seq_len, padding_state_slot=None):
        return DecodeGraphRunner(ops, max_batch_size, max_blocks_per_seq, max_seq_len,
                                 padding_state_slot=padding_state_slot, short_context=SHORT_BOUND)

    monkeypatch.setattr(CudaOps, "decode_graph_runner", decode_graph_runner)


def test_fp32_greedy_matches_cpu_when_contexts_pass_the_short_graph_bound(checkpoint, short_graphs):
    """Alone, prompt 1 (16 tokens) decodes through bucket 1's short graph up to a 32-key context and
    through its long graph after; all five prompts together mix those with prefill chunks."""
    path, prompts, expected = checkpoint
    llm = cuda_llm(path)
    slots = llm.engine.runner.decode_graphs.slots
    assert slots.get(1, SHORT_BOUND).graph is not None and slots.get(1).graph is not None  # at start-up
    assert token_ids(llm.generate([prompts[1]], GREEDY)) == [expected[1]]
    assert (slots.get(1, SHORT_BOUND).num_replays, slots.get(1).num_replays) == (16, 15)  # contexts 17-32, 33-47
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    assert_no_leaks(llm)


def test_fp32_greedy_matches_cpu_under_preemption(checkpoint):
    path, prompts, expected = checkpoint
    # 14 blocks of 16 tokens cannot hold all five sequences at once.
    llm = cuda_llm(path, num_gpu_blocks_override=14)
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert_no_leaks(llm)


def test_kv_cache_is_sized_from_device_memory(checkpoint):
    path, _, _ = checkpoint
    llm = cuda_llm(path)
    # A tiny model leaves room for every sequence at full length: the pool is capped there.
    max_len, block_size = llm.engine.max_model_len, llm.engine.args.block_size
    assert llm.engine.scheduler.kv.pool.num_blocks == ENGINE_ARGS["max_num_seqs"] * -(-max_len // block_size)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        cuda_llm(path, gpu_memory_utilization=0.001)


# ---- bf16 against fp32, teacher-forced ----

BLOCK_SIZE = 16
NUM_SEQS = 16
PREFILL_LEN = 128
DECODE_LEN = 32


def teacher_forced_logits(model, sequences: list[list[int]]) -> np.ndarray:
    """[B, L - 1, V] logits after each token of `sequences` (all of length L):
    one prefill step over the first PREFILL_LEN tokens, then one decode step per token,
    each fed the true token."""
    from oracle import layer_caches, step_inputs

    ops = model.ops
    length = len(sequences[0])
    blocks_per_seq = -(-length // BLOCK_SIZE)
    caches = layer_caches(model, len(sequences), len(sequences), BLOCK_SIZE, blocks_per_seq)  # a state slot each

    def step_logits(num_cached: int, end: int) -> np.ndarray:
        step = step_inputs([s[:end] for s in sequences], [num_cached] * len(sequences), block_size=BLOCK_SIZE,
                           blocks_per_seq=blocks_per_seq)
        step.meta.state_slots = np.arange(len(sequences), dtype=np.int32)
        attn = ops.prepare_attention(step.meta)
        hidden = model.forward(ops.upload(step.token_ids), ops.upload(step.positions), attn, caches)
        rows = ops.upload(np.arange(len(step.token_ids), dtype=np.int32))
        logits = ops.download(model.compute_logits(hidden, rows))
        return logits.reshape(len(sequences), end - num_cached, -1)

    steps = [step_logits(0, PREFILL_LEN)]
    steps += [step_logits(end - 1, end) for end in range(PREFILL_LEN + 1, length)]
    return np.concatenate(steps, axis=1)


def transformers_bf16_logits(path, sequences: list[list[int]]) -> np.ndarray:
    """[B, L - 1, V] logits from transformers in bf16, an independent bf16 implementation;
    fp32 logits from the bf16 hidden states, as sparkd computes them."""
    import torch
    import transformers

    # from_pretrained keeps the rotary frequencies in fp32 (a .to(bfloat16) would round them).
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        hidden = model.model(torch.tensor(sequences)).last_hidden_state.float()
        return (hidden @ model.lm_head.weight.float().T)[:, :-1].numpy()


# The tiny random Mixtral stays under issue 5's bar: on the H200 (2026-11-30, with the fp32
# residual stream and the fp32 router) sparkd reached 0.9890 and 0.9862 in two runs, above
# transformers' own bf16 (0.9811) but under 0.99; Qwen3-MoE passes (0.9945, 0.9953). The bar is
# checked on a trained tiny Mixtral in test_trained_bf16.py. strict: the marker must go once it passes.
_MIXTRAL_BF16_BELOW_BAR = pytest.mark.xfail(strict=True, reason="Mixtral bf16 top-1 agreement is under 0.99 (issue 5)")


# Qwen3-Next (oracle.tiny_hybrid_overrides at head_dim 64): on the H200 (2026-12-01) sparkd agreed at 0.9458
# and transformers' own bf16 at 0.9493. Random tiny hybrids amplify bf16 rounding (each delta net ~3x its
# input's error, each MoE block's routing flips ~7x); transformers reaches 0.98 even with one delta net
# and one attention layer (CPU), so the 0.99 bar is checked on the trained demo hybrid (test_trained_bf16.py).
_QWEN3_NEXT_BF16_BELOW_BAR = pytest.mark.xfail(strict=True, reason="the tiny random Qwen3-Next's bf16 top-1 "
                                               "agreement is under 0.99, transformers' own too (issue 6)")
BF16_ARCHITECTURES = [*VARIANTS, "Qwen3NextForCausalLM"]
_BELOW_BAR = {"MixtralForCausalLM": _MIXTRAL_BF16_BELOW_BAR, "Qwen3NextForCausalLM": _QWEN3_NEXT_BF16_BELOW_BAR}


@pytest.mark.parametrize("arch", [pytest.param(arch, marks=_BELOW_BAR[arch]) if arch in _BELOW_BAR else arch
                                  for arch in BF16_ARCHITECTURES])
def test_bf16_teacher_forced_top1_agrees_with_fp32(arch, tmp_path, cuda_ops_factory):
    """sparkd in bf16 must pick the fp32 reference's top-1 at >= 99% of teacher-forced
    positions (prefill and decode), and may flip a top-1 only where the fp32 margin is
    within twice transformers' own bf16 logit error. transformers' bf16 agreement is
    printed beside it: on these random tiny models it is ~98.5-99.5%, so the bar is tight."""
    import torch

    oracle = pytest.importorskip("oracle")
    from sparkd.backend.cpu.ops import NumpyOps
    from sparkd.models.registry import load_model

    # A bf16 checkpoint: the fp32 reference computes on the very weights bf16 runs with.
    overrides = VARIANTS.get(arch) or oracle.tiny_hybrid_overrides(head_dim=64)
    path, _ = oracle.make_tiny_checkpoint(tmp_path, arch, dtype=torch.bfloat16, **overrides)
    reference_model = load_model(path, NumpyOps())
    rng = np.random.default_rng(11)
    sequences = rng.integers(3, reference_model.config.vocab_size, (NUM_SEQS, PREFILL_LEN + DECODE_LEN)).tolist()
    reference_logits = teacher_forced_logits(reference_model, sequences)
    reference = reference_logits.argmax(axis=-1)
    bf16_model = load_model(path, cuda_ops_factory("bfloat16"))
    matches = teacher_forced_logits(bf16_model, sequences).argmax(axis=-1) == reference
    transformers_logits = transformers_bf16_logits(path, sequences)
    transformers_agreement = (transformers_logits.argmax(axis=-1) == reference).mean()
    agreement, decode_agreement = matches.mean(), matches[:, PREFILL_LEN:].mean()
    print(f"{arch} bf16 top-1 agreement with fp32: sparkd {agreement:.4f} (decode steps {decode_agreement:.4f}), "
          f"transformers {transformers_agreement:.4f}")
    assert agreement >= BF16_MIN_TOP1_AGREEMENT

    top2 = np.sort(reference_logits, axis=-1)[..., -2:]
    margin = top2[..., 1] - top2[..., 0]
    bf16_error = np.abs(transformers_logits - reference_logits).max()
    decisive = margin > 2 * bf16_error
    flips = int((~matches[decisive]).sum())
    assert flips == 0, f"{flips} top-1 flips where the fp32 margin exceeds 2 x {bf16_error:.4f}"


# ---- the abort-capture guard, through AsyncEngine ----

async def collect(stream):
    return [out async for out in stream]


def test_injected_capture_failure_fails_one_request_and_the_next_10_succeed(checkpoint, monkeypatch):
    from sparkd.backend.cuda.graphs import FAIL_CAPTURE_ENV
    from sparkd.engine.args import EngineArgs
    from sparkd.engine.async_engine import AsyncEngine

    path, prompts, expected = checkpoint
    engine = AsyncEngine.from_args(EngineArgs(model=str(path), device="cuda", dtype="float32",
                                              capture_graphs_at_startup=False, **ENGINE_ARGS))

    async def scenario():
        await engine.start()
        try:
            monkeypatch.setenv(FAIL_CAPTURE_ENV, "1")
            failed = await collect(engine.add_request(prompts[1], GREEDY))  # its first decode step captures
            monkeypatch.delenv(FAIL_CAPTURE_ENV)
            later = await asyncio.gather(*(collect(engine.add_request(prompts[i % 5], GREEDY)) for i in range(10)))
            slots = engine.core.runner.decode_graphs.slots  # before shutdown destroys the graphs
            eager = [slot.size for slot in slots if slot.eager_only]
            return failed, later, eager, captured_buckets(engine.core)
        finally:
            await engine.shutdown()

    # Plain asyncio.run: the GPU host has no pytest-asyncio.
    failed, later, eager, captured = asyncio.run(scenario())
    final = failed[-1]
    assert final.finished and final.outputs[0].finish_reason == "error"
    assert "GraphCaptureError" in final.error
    assert not engine.is_dead and not engine.core.ops.stream.is_capturing()
    assert eager == [1] and captured, (eager, captured)  # the failed batch size alone went eager
    for i, outputs in enumerate(later):
        assert outputs[-1].error is None and outputs[-1].outputs[0].token_ids == expected[i % 5]


def test_a_failed_short_graph_capture_fails_one_request_and_the_next_10_succeed(checkpoint, short_graphs,
                                                                                 monkeypatch):
    """The first request's first decode step captures bucket 1's graphs: the long one, then the short
    one, broken by an illegal call (a stream synchronize) while capturing. That request fails; the
    pair (1, SHORT_BOUND) runs eagerly from then on, and the requests after it succeed."""
    from sparkd.engine.args import EngineArgs
    from sparkd.engine.async_engine import AsyncEngine

    path, prompts, expected = checkpoint
    engine = AsyncEngine.from_args(EngineArgs(model=str(path), device="cuda", dtype="float32",
                                              capture_graphs_at_startup=False, **ENGINE_ARGS))
    runner = engine.core.runner
    decode_forward, broken = runner.decode_forward, []

    def forward(inputs):
        if not broken and inputs.attn.max_seq_len == SHORT_BOUND and runner.ops.stream.is_capturing():
            broken.append(inputs.token_ids.shape[0])
            runner.ops.stream.synchronize()  # invalidates the capture, as a real mistake would
        return decode_forward(inputs)

    monkeypatch.setattr(runner, "decode_forward", forward)

    async def scenario():
        await engine.start()
        try:
            failed = await collect(engine.add_request(prompts[1], GREEDY))
            later = await asyncio.gather(*(collect(engine.add_request(prompts[i % 5], GREEDY)) for i in range(10)))
            slots = runner.decode_graphs.slots  # before shutdown destroys the graphs
            eager = [(slot.size, slot.max_seq_len) for slot in slots if slot.eager_only]
            return failed, later, eager, slots.get(1).graph is not None
        finally:
            await engine.shutdown()

    failed, later, eager, long_captured = asyncio.run(scenario())
    final = failed[-1]
    assert final.finished and final.outputs[0].finish_reason == "error" and "GraphCaptureError" in final.error
    assert broken == [1] and eager == [(1, SHORT_BOUND)] and long_captured, (broken, eager)
    assert not engine.is_dead and not engine.core.ops.stream.is_capturing()
    for i, outputs in enumerate(later):
        assert outputs[-1].error is None and outputs[-1].outputs[0].token_ids == expected[i % 5]


def test_a_sticky_device_error_kills_the_engine(checkpoint, monkeypatch):
    """Simulated: a real sticky error would leave this process no usable GPU for the tests after it."""
    from cuda.bindings import driver

    from sparkd.backend.cuda.driver import error_from_status
    from sparkd.engine.args import EngineArgs
    from sparkd.engine.async_engine import AsyncEngine, EngineDeadError

    path, prompts, _ = checkpoint
    engine = AsyncEngine.from_args(EngineArgs(model=str(path), device="cuda", dtype="float32", **ENGINE_ARGS))

    def lose_the_device(output, previous):
        raise error_from_status(driver.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, "launch of a kernel")

    monkeypatch.setattr(engine.core.runner, "launch", lose_the_device)

    async def scenario():
        await engine.start()
        streams = [engine.add_request(prompt, GREEDY) for prompt in prompts[:3]]
        reason = await asyncio.wait_for(engine.wait_dead(), timeout=30)
        for stream in streams:
            with pytest.raises(EngineDeadError):
                await collect(stream)
        with pytest.raises(EngineDeadError):
            engine.add_request(prompts[0], GREEDY)
        await engine.shutdown()
        return reason

    reason = asyncio.run(scenario())
    assert engine.is_dead and "CUDA_ERROR_ILLEGAL_ADDRESS" in reason


def test_pipelined_engine_matches_cpu_under_preemption(checkpoint):
    """AsyncEngine launches step N+1 before N's ids reach the host: the placeholders'
    ids are copied on the device, inside graph replays and eager steps alike."""
    from sparkd.engine.args import EngineArgs
    from sparkd.engine.async_engine import AsyncEngine

    path, prompts, expected = checkpoint
    engine = AsyncEngine.from_args(EngineArgs(model=str(path), device="cuda", dtype="float32",
                                              num_gpu_blocks_override=14, **ENGINE_ARGS))
    behind = []
    launch = engine.core.launch
    engine.core.launch = lambda output, previous: (behind.append(previous is not None), launch(output, previous))[1]

    async def scenario():
        await engine.start()
        try:
            results = await asyncio.gather(*(collect(engine.add_request(p, GREEDY)) for p in prompts))
            return results, replayed_buckets(engine.core)  # before shutdown destroys the graphs
        finally:
            await engine.shutdown()

    results, replayed = asyncio.run(scenario())
    assert [outputs[-1].outputs[0].token_ids for outputs in results] == expected
    assert engine.core.scheduler.num_preemptions_total > 0
    assert sum(behind) > len(behind) // 2, behind
    assert replayed


def test_a_capture_failure_at_startup_leaves_those_sizes_eager(checkpoint, monkeypatch):
    from sparkd.backend.cuda.graphs import FAIL_CAPTURE_ENV

    path, prompts, expected = checkpoint
    monkeypatch.setenv(FAIL_CAPTURE_ENV, "1")
    llm = cuda_llm(path)
    monkeypatch.delenv(FAIL_CAPTURE_ENV)
    graphs = llm.engine.runner.decode_graphs
    assert all(slot.eager_only for slot in graphs.slots) and not captured_buckets(llm.engine)
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    assert_no_leaks(llm)
