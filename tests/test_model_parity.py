"""Dense models on NumpyOps against transformers (float32): prefill logits, batches,
chunked prefill over cached K/V, and decodes mixed with prefill chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from oracle import hf_logits, make_tiny_checkpoint, num_kv_blocks, step_inputs
from transformers.models.qwen3_next import modeling_qwen3_next

from sparkd.backend.base import AttentionMetadata
from sparkd.backend.cpu.ops import NumpyOps
from sparkd.models.config import rope_config
from sparkd.models.registry import load_model

RTOL = 1e-4
BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 8
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=16,  # small, so positions < 32 cross all three frequency bands
)

VARIANTS = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-mqa-bias": ("LlamaForCausalLM", dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True)),
    "llama-tied": ("LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama3-rope": ("LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen2-mha-tied": ("Qwen2ForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=True, rms_norm_eps=0.05)),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "qwen3-head-dim": ("Qwen3ForCausalLM", dict(head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen3-bias": ("Qwen3ForCausalLM", dict(attention_bias=True)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tmp_path_factory):
    """(sparkd model, HF model) of one variant."""
    arch, overrides = VARIANTS[request.param]
    path, hf_model = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)
    return load_model(path, NumpyOps()), hf_model


def fresh_kv_caches(model, num_seqs: int):
    config = model.config
    return model.ops.allocate_kv_cache(
        config.num_layers, num_kv_blocks(num_seqs, BLOCKS_PER_SEQ), BLOCK_SIZE, config.num_kv_heads, config.head_dim
    )


def run_step(model, kv_caches, sequences, num_cached=None) -> list[np.ndarray]:
    """Run one step; per sequence, the logits [new tokens, V] of its new tokens."""
    step = step_inputs(sequences, num_cached, block_size=BLOCK_SIZE, blocks_per_seq=BLOCKS_PER_SEQ)
    ops = model.ops
    attn = ops.prepare_attention(step.meta)
    hidden = model.forward(ops.upload(step.token_ids), ops.upload(step.positions), attn, kv_caches)
    all_rows = ops.upload(np.arange(len(step.token_ids), dtype=np.int32))
    logits = ops.download(model.compute_logits(hidden, all_rows))
    assert logits.dtype == np.float32
    return np.split(logits, step.meta.query_start_loc[1:-1])


def assert_rel_close(actual: np.ndarray, expected: np.ndarray) -> None:
    """Each row within RTOL of the row's largest reference logit."""
    assert actual.shape == expected.shape
    err = np.abs(actual - expected).max(axis=-1)
    scale = np.abs(expected).max(axis=-1)
    assert np.all(err <= RTOL * scale), f"max relative error {np.max(err / scale):.2e}"


def random_prompts(lengths, vocab_size, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, n).tolist() for n in lengths]


def test_prefill_batch_matches_transformers(models):
    model, hf_model = models
    prompts = random_prompts([1, 5, 11, 18], model.config.vocab_size)
    logits = run_step(model, fresh_kv_caches(model, len(prompts)), prompts)
    for prompt, ours in zip(prompts, logits):
        assert_rel_close(ours, hf_logits(hf_model, prompt))


def test_prompt_in_two_chunks_reads_cached_kv(models):
    model, hf_model = models
    (prompt,) = random_prompts([19], model.config.vocab_size, seed=1)
    kv_caches = fresh_kv_caches(model, 1)
    first = run_step(model, kv_caches, [prompt[:7]])[0]
    second = run_step(model, kv_caches, [prompt], num_cached=[7])[0]
    expected = hf_logits(hf_model, prompt)
    assert_rel_close(first, expected[:7])
    assert_rel_close(second, expected[7:])


def test_decodes_mixed_with_prefill_chunks(models):
    """Step 1: prompts A, B whole plus C's first chunk. Step 2: A and B decode one
    token each while C's second chunk and a new prompt D run in the same batch."""
    model, hf_model = models
    a, b, c, d = random_prompts([9, 6, 21, 3], model.config.vocab_size, seed=2)
    kv_caches = fresh_kv_caches(model, 4)
    run_step(model, kv_caches, [a, b, c[:8]])
    a, b = a + [17], b + [42]
    logits = run_step(model, kv_caches, [a, b, c, d], num_cached=[len(a) - 1, len(b) - 1, 8, 0])
    assert_rel_close(logits[0], hf_logits(hf_model, a)[-1:])
    assert_rel_close(logits[1], hf_logits(hf_model, b)[-1:])
    assert_rel_close(logits[2], hf_logits(hf_model, c)[8:])
    assert_rel_close(logits[3], hf_logits(hf_model, d))


def test_partial_rotary_matches_transformers():
    """Rotary over the first quarter of each head (Qwen3-Next style); the rest passes through."""
    hf_config = transformers.Qwen3NextConfig(head_dim=32, partial_rotary_factor=0.25, rope_theta=10000.0)
    rotary = modeling_qwen3_next.Qwen3NextRotaryEmbedding(hf_config)
    rope = rope_config(hf_config.to_dict(), head_dim=32)
    assert rope.rotary_dim == 8
    rng = np.random.default_rng(0)
    num_tokens, num_heads, num_kv_heads = 6, 4, 2
    q = rng.standard_normal((num_tokens, num_heads, 32), dtype=np.float32)
    k = rng.standard_normal((num_tokens, num_kv_heads, 32), dtype=np.float32)
    positions = np.array([0, 1, 2, 7, 30, 100], dtype=np.int32)

    torch_positions = torch.from_numpy(positions.astype(np.int64))[None]
    cos, sin = rotary(torch.from_numpy(q), torch_positions)
    # HF wants [batch, heads, tokens, D]; ours are [tokens, heads, D].
    q_ref, k_ref = modeling_qwen3_next.apply_rotary_pos_emb(
        torch.from_numpy(q).transpose(0, 1)[None], torch.from_numpy(k).transpose(0, 1)[None], cos, sin
    )

    ops = NumpyOps()
    slots = np.arange(num_tokens, dtype=np.int32)  # the K cache only stores what was written
    meta = AttentionMetadata(
        query_start_loc=np.array([0, num_tokens], np.int32), seq_lens=np.array([num_tokens], np.int32),
        block_tables=np.array([[0, 1]], np.int32), slot_mapping=slots, max_query_len=num_tokens, max_seq_len=num_tokens,
    )
    k_cache, v_cache = ops.allocate_kv_cache(1, 2, BLOCK_SIZE, num_kv_heads, 32)[0]
    q_rot = ops.rope_write_kv(q, k, np.zeros_like(k), positions, rope, k_cache, v_cache, ops.prepare_attention(meta))

    np.testing.assert_allclose(q_rot, q_ref[0].transpose(0, 1).numpy(), rtol=1e-5, atol=1e-5)
    k_written = k_cache.transpose(0, 2, 1, 3).reshape(-1, num_kv_heads, 32)[slots]
    np.testing.assert_allclose(k_written, k_ref[0].transpose(0, 1).numpy(), rtol=1e-5, atol=1e-5)
