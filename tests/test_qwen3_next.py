"""Qwen3-Next (gated delta nets + gated attention + MoE with a shared expert) on the numpy
backend against transformers (float32, CPU): logits of whole prompts and of prompts in
chunks carried through the state pool, greedy generation through the engine (chunked
prefill and preemption included), and the delta rule's two forms against each other.

Logits: max |a - b| / max |b| per row <= 1e-4, the bound the dense models meet.
"""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy
import torch

from sparkd import LLM, SamplingParams
from sparkd.backend.cpu import gdn
from sparkd.backend.cpu.ops import NumpyOps
from sparkd.backend.dtypes import DType
from sparkd.models.registry import load_model
from tests.oracle import (hf_logits, layer_caches, make_prompts, make_tiny_checkpoint, step_inputs,
                          tiny_hybrid_overrides)

RTOL = 1e-4
BLOCK_SIZE, BLOCKS_PER_SEQ = 4, 48
NUM_NEW = 24


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(checkpoint directory, transformers model, sparkd model on NumpyOps)."""
    path, hf = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_next"), "Qwen3NextForCausalLM",
                                    **tiny_hybrid_overrides())
    return path, hf, load_model(path, NumpyOps())


def caches(model, num_seqs: int, num_slots: int = 4) -> list:
    """Per layer: KV caches for the attention layers, a state pool for the delta nets."""
    return layer_caches(model, num_seqs, num_slots, BLOCK_SIZE, BLOCKS_PER_SEQ)


def step_logits(model, layer_caches, sequences, num_cached, slots) -> np.ndarray:
    """Logits [T, V] of every new token of one step whose sequence b uses state slot slots[b]."""
    step = step_inputs(sequences, num_cached, block_size=BLOCK_SIZE, blocks_per_seq=BLOCKS_PER_SEQ)
    step.meta.state_slots = np.array(slots, np.int32)
    attn = model.ops.prepare_attention(step.meta)
    hidden = model.forward(step.token_ids, step.positions, attn, layer_caches)
    return model.compute_logits(hidden, np.arange(len(step.token_ids), dtype=np.int32))


def assert_rows_close(actual, expected):
    err = np.abs(actual - expected).max(axis=-1) / np.abs(expected).max(axis=-1)
    assert np.all(err <= RTOL), f"max relative error {err.max():.2e}"


def test_config_has_the_3_to_1_layout(hybrid):
    _, hf, model = hybrid
    c = model.config
    assert c.layer_types == hf.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert c.attention_layers == [3] and c.linear_attention_layers == [0, 1, 2]
    assert c.rope.rotary_dim == 8 and c.shared_expert_intermediate_size == 40
    assert (c.delta_net_shape.num_k_heads, c.delta_net_shape.num_v_heads, c.delta_net_shape.conv_dim) == (2, 4, 160)


def assert_a_batch_matches_transformers(hf, model, long_prompt: int = 150) -> None:
    """Three sequences in one step, each on its own slot; the third, of long_prompt tokens, crosses
    a 64-token chunk of the WY form."""
    prompts = [p for p in make_prompts(np.random.default_rng(1), model.config.vocab_size) if len(p) > 1][:2]
    prompts.append(np.random.default_rng(2).integers(3, model.config.vocab_size, long_prompt).tolist())
    logits = step_logits(model, caches(model, 3), prompts, None, [2, 0, 3])
    rows = np.cumsum([0] + [len(p) for p in prompts])
    for b, prompt in enumerate(prompts):
        assert_rows_close(logits[rows[b]:rows[b + 1]], hf_logits(hf, prompt))


def test_a_batch_of_prompts_matches_transformers(hybrid):
    _, hf, model = hybrid
    assert_a_batch_matches_transformers(hf, model)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_the_whole_prompt(hybrid, chunk):
    """A 100-token prompt in chunks of `chunk` tokens (chunk 1: every token a decode step) reads
    the conv window and recurrent state its slot carries between steps."""
    _, hf, model = hybrid
    prompt = np.random.default_rng(3).integers(3, model.config.vocab_size, 100).tolist()
    layer_caches = caches(model, 1)
    pieces = [step_logits(model, layer_caches, [prompt[:end]], [start], [1])
              for start, end in ((s, min(s + chunk, len(prompt))) for s in range(0, len(prompt), chunk))]
    assert_rows_close(np.concatenate(pieces), hf_logits(hf, prompt))


def test_a_fresh_sequence_ignores_what_its_slot_held(hybrid):
    """A slot is not cleared when freed: a sequence with no cached tokens starts from zeros anyway."""
    _, _, model = hybrid
    prompt = np.random.default_rng(4).integers(3, model.config.vocab_size, 20).tolist()
    clean = step_logits(model, caches(model, 1), [prompt], None, [0])
    dirty = caches(model, 1)
    for layer in model.config.linear_attention_layers:
        for state in dirty[layer]:
            state[...] = np.random.default_rng(5).standard_normal(state.shape)
    np.testing.assert_array_equal(step_logits(model, dirty, [prompt], None, [0]), clean)


@pytest.mark.parametrize("state_dtype", [DType.bfloat16, DType.float16])
def test_a_reduced_precision_state_holds_that_dtype_and_stays_close(hybrid, state_dtype):
    """--mamba-cache-dtype: the pool is held in that dtype (bf16 as its bits), and a 100-token
    prompt in chunks of 7 (each chunk reads back the rounded state) moves its logits off the
    float32 pool's by rounding only: measured max 1.7e-2 (bf16) and 8.1e-3 (fp16, its small
    values subnormal), bound 5e-2."""
    _, _, model = hybrid
    prompt = np.random.default_rng(3).integers(3, model.config.vocab_size, 100).tolist()

    def chunked(dtype: DType):
        pool = layer_caches(model, 1, 4, BLOCK_SIZE, BLOCKS_PER_SEQ, dtype)
        pieces = [step_logits(model, pool, [prompt[:end]], [start], [1])
                  for start, end in ((s, min(s + 7, len(prompt))) for s in range(0, len(prompt), 7))]
        return np.concatenate(pieces), pool

    reduced, pool = chunked(state_dtype)
    full, _ = chunked(DType.float32)
    for layer in model.config.linear_attention_layers:
        for state in pool[layer]:
            assert state.dtype == state_dtype.host
    err = np.abs(reduced - full).max(axis=-1) / np.abs(full).max(axis=-1)
    assert 0 < err.max() <= 5e-2


def test_recurrent_and_chunked_delta_rule_agree():
    rng = np.random.default_rng(6)
    length, heads, dk, dv = 150, 3, 16, 24
    q, k = (gdn.l2norm(rng.standard_normal((length, heads, dk)).astype(np.float32)) for _ in range(2))
    v = rng.standard_normal((length, heads, dv)).astype(np.float32)
    g = -np.abs(rng.standard_normal((length, heads))).astype(np.float32)
    beta = rng.uniform(0, 1, (length, heads)).astype(np.float32)
    state = rng.standard_normal((heads, dk, dv)).astype(np.float32)
    recurrent, recurrent_state = gdn.recurrent_delta_rule(q, k, v, g, beta, state)
    chunked, chunked_state = gdn.chunked_delta_rule(q, k, v, g, beta, state)
    np.testing.assert_allclose(chunked, recurrent, rtol=0, atol=1e-4 * np.abs(recurrent).max())
    np.testing.assert_allclose(chunked_state, recurrent_state, rtol=0, atol=1e-4 * np.abs(recurrent_state).max())


def test_mtp_weights_are_kept(hybrid, tmp_path):
    """A checkpoint's multi-token-prediction module (which transformers drops) loads and is kept."""
    path, _, _ = hybrid
    for item in path.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    weights = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    weights["mtp.fc.weight"] = np.ones((64, 128), np.float32)
    safetensors.numpy.save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(tmp_path, NumpyOps())
    assert list(model.mtp) == ["mtp.fc.weight"] and model.mtp["mtp.fc.weight"].shape == (64, 128)


# ---- the engine ----

def hf_greedy(model, prompt: list[int], num_new: int = NUM_NEW) -> list[int]:
    """Argmax decoding with transformers' own cache (its recurrent decode path)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=num_new, min_new_tokens=num_new,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def greedy_case(hybrid):
    path, hf, model = hybrid
    prompts = make_prompts(np.random.default_rng(7), model.config.vocab_size)
    return path, prompts, [hf_greedy(hf, p) for p in prompts]


@pytest.mark.parametrize("engine_args", [{}, {"num_gpu_blocks_override": 20}], ids=["chunked", "preempted"])
def test_greedy_matches_transformers(greedy_case, engine_args):
    """Five prompts (one longer than the 64-token budget: chunked), with enough KV blocks for all,
    and with too few (20 blocks of 16 tokens), so that sequences are preempted, give back their
    state slots and are recomputed from scratch."""
    path, prompts, expected = greedy_case
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=64, **engine_args)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    scheduler = llm.engine.scheduler
    if engine_args:
        assert scheduler.num_preemptions_total > 0
    assert not scheduler.has_unfinished_requests() and scheduler.kv_cache_usage == 0.0
    assert scheduler.state_slots.num_free == scheduler.state_slots.num_slots
    scheduler.check_integrity()


def test_the_state_pool_comes_out_of_the_kv_budget(hybrid):
    """A slot per --max-num-seqs sequence, four snapshots each and a spare, fp32 by default (24192 bytes a slot here:
    three delta nets of a 160 x 3 conv window and a 4 x 16 x 24 state), come off
    --kv-cache-memory-gb before the KV blocks; a budget they fill is refused with a clear error."""
    path, _, _ = hybrid
    slot_bytes = 3 * 4 * (160 * 3 + 4 * 16 * 24)
    state_bytes = (8 + 4 * 8 + 1) * slot_bytes  # running, snapshots, the graphs' padding slot
    block_bytes = 2 * 1 * 2 * 16 * 32 * 4  # K and V of the one attention layer: 2 kv heads x 16 tokens x 32
    budget = state_bytes + 100 * block_bytes
    llm = LLM(str(path), device="cpu", max_num_seqs=8, max_model_len=512, kv_cache_memory_gb=budget / 2**30)
    assert llm.engine.scheduler.kv.pool.num_blocks == 100
    with pytest.raises(ValueError, match="linear-attention state pool"):
        LLM(str(path), device="cpu", max_num_seqs=8, max_model_len=512, kv_cache_memory_gb=state_bytes / 2**30)
    # Held in bf16 (--mamba-cache-dtype), the pool takes half the bytes: the same budget leaves more blocks.
    half = LLM(str(path), device="cpu", max_num_seqs=8, max_model_len=512, kv_cache_memory_gb=budget / 2**30,
               mamba_cache_dtype="bfloat16")
    assert half.engine.scheduler.kv.pool.num_blocks == 100 + state_bytes // 2 // block_bytes


# ---- hybrid prefix caching ----

def test_a_prefix_hit_restores_the_state_and_gives_the_tokens_of_a_miss(greedy_case):
    """Sent again, a prompt hits its K/V blocks up to its last full block and the state snapshot
    taken there; a 1-token prompt (no full block) and a 16-token one (its one block is the
    whole prompt, which a hit never covers) compute everything again."""
    path, prompts, expected = greedy_case
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    llm.generate(prompts, params)
    hits_before = llm.engine.stats().prefix_cache_hits
    again = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert [o.num_cached_tokens for o in again] == [0, 0, 32, 32, 144]
    assert llm.engine.stats().prefix_cache_hits - hits_before == 32 + 32 + 144
    llm.engine.scheduler.check_integrity()


def test_a_short_prompt_and_a_shared_system_prompt_hit(hybrid):
    """A 20-token prompt (far under 528) hits its first block when sent again. Two prompts share
    a 90-token system prompt: the first snapshots at 64 tokens (every 4 blocks) and at 96 (its
    last full block, past the shared part), so the second resumes from the one at 64."""
    path, hf, model = hybrid
    rng = np.random.default_rng(8)
    vocab = model.config.vocab_size
    short = rng.integers(3, vocab, 20).tolist()
    system = rng.integers(3, vocab, 90).tolist()
    first, second = (system + rng.integers(3, vocab, n).tolist() for n in (10, 12))
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([short, first], params)
    short_again, second_out = llm.generate([short, second], params)
    assert (short_again.num_cached_tokens, second_out.num_cached_tokens) == (16, 64)
    assert short_again.outputs[0].token_ids == hf_greedy(hf, short, 8)
    assert second_out.outputs[0].token_ids == hf_greedy(hf, second, 8)


def test_n_siblings_share_the_prompt_through_its_snapshot(greedy_case):
    """n = 3 greedy siblings of a 46-token prompt: the first computes it, the others hit its two
    full blocks and the state snapshot after them, and all three give transformers' tokens."""
    path, prompts, expected = greedy_case
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=64)
    (out,) = llm.generate([prompts[3]], SamplingParams(n=3, temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True))
    assert [c.token_ids for c in out.outputs] == [expected[3]] * 3
    assert llm.engine.stats().prefix_cache_hits == 2 * 32
    llm.engine.scheduler.check_integrity()


def test_served_hybrid_model_reports_its_prefix_hits_in_the_metrics(hybrid, tmp_path):
    """`sparkd serve` on the hybrid checkpoint: a repeated 53-token prompt hits 48 tokens (three
    blocks of 16, its last full block's snapshot), and /metrics counts them."""
    from tests.server_fixtures import start_server

    path, _, _ = hybrid
    server = start_server(path, tmp_path / "serve.log")
    try:
        prompt = list(range(10, 10 + 3 * 16 + 5))
        with server.client() as client:
            first = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
            before = server.wait_idle()
            second = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
        after = server.wait_idle()
        assert first.status_code == second.status_code == 200
        assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
        assert after["sparkd:prefix_cache_hits_total"] - before["sparkd:prefix_cache_hits_total"] == 48
    finally:
        assert server.stop() == 0


# ---- checkpoint and rollback (speculative decoding's verify step) ----

def test_rolling_back_to_any_accepted_count_equals_running_that_many(hybrid):
    """A k-token step that checkpoints the state after each of its tokens (state_snapshots at
    0..k, into spare slots), rolled back to j (copy_state_slots_) and continued, gives the
    logits of running only its first j tokens and continuing."""
    _, _, model = hybrid
    c = model.config
    rng = np.random.default_rng(9)
    prompt = rng.integers(3, c.vocab_size, 30).tolist()
    drafted, following = rng.integers(3, c.vocab_size, 5).tolist(), rng.integers(3, c.vocab_size, 3).tolist()
    k, slot, spare = len(drafted), 0, 1  # the checkpoint after j drafted tokens goes to slot spare + j

    def run(layer_caches, sequence, num_cached, snapshots=None):
        step = step_inputs([sequence], [num_cached], block_size=BLOCK_SIZE, blocks_per_seq=BLOCKS_PER_SEQ)
        step.meta.state_slots = np.array([slot], np.int32)
        step.meta.state_snapshots = snapshots
        hidden = model.forward(step.token_ids, step.positions, model.ops.prepare_attention(step.meta), layer_caches)
        return model.compute_logits(hidden, np.arange(len(step.token_ids), dtype=np.int32))

    for j in range(k + 1):
        verified = caches(model, 1, num_slots=2 + k)  # the K/V of the rejected tokens is overwritten below
        step_logits(model, verified, [prompt], None, [slot])
        run(verified, prompt + drafted, len(prompt), np.array([(0, i, spare + i) for i in range(k + 1)], np.int32))
        accepted = prompt + drafted[:j]
        model.ops.copy_state_slots_([verified[i] for i in c.linear_attention_layers], np.array([spare + j], np.int32),
                                    np.array([slot], np.int32))
        rolled_back = run(verified, accepted + following, len(accepted))
        direct = caches(model, 1, num_slots=2 + k)
        step_logits(model, direct, [prompt], None, [slot])
        if j:
            run(direct, accepted, len(prompt))
        expected = run(direct, accepted + following, len(accepted))
        np.testing.assert_allclose(rolled_back, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
