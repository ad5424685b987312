"""End-to-end greedy generation against transformers (float32, CPU).

Each run checks 32 greedy tokens per prompt against a plain transformers greedy
loop, for a batch of prompts of different lengths, and the engine's books:
no block leaks afterwards, and the feature the run is about actually happened
(prefix hits, chunked prefill, preemption).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkd import LLM, SamplingParams
from tests.oracle import ARCHITECTURES, make_prompts, make_tiny_checkpoint

NUM_NEW = 32
VARIANTS = {
    "LlamaForCausalLM": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "Qwen2ForCausalLM": dict(tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(head_dim=32),
}


def hf_greedy(model, prompt: list[int], num_new: int = NUM_NEW) -> list[int]:
    """Plain argmax decoding, recomputing the whole sequence each step (generate()
    would mask eos under min_new_tokens)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_new):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    arch = request.param
    path, model = make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, **VARIANTS[arch])
    prompts = make_prompts(np.random.default_rng(7), model.config.vocab_size)
    expected = [hf_greedy(model, p) for p in prompts]
    return path, prompts, expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def run(path, prompts, **engine_args):
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=64, **engine_args)
    outputs = llm.generate(prompts, GREEDY)
    return llm, outputs


def assert_no_leaks(llm) -> None:
    scheduler = llm.engine.scheduler
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_usage == 0.0
    scheduler.check_integrity()


def test_greedy_matches_transformers_with_prefix_hits_and_chunking(checkpoint):
    path, prompts, expected = checkpoint
    llm, outputs = run(path, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert_no_leaks(llm)
    # The shared 37-token prefix is cached now: 2 full blocks of 16 must hit.
    again = llm.generate([prompts[3]], GREEDY)[0]
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == expected[3]
    assert llm.engine.stats().prefix_cache_hits >= 32
    assert_no_leaks(llm)


def test_greedy_matches_transformers_under_preemption(checkpoint):
    path, prompts, expected = checkpoint
    # 14 blocks of 16 tokens cannot hold all five sequences at once.
    llm, outputs = run(path, prompts, num_gpu_blocks_override=14)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert_no_leaks(llm)


def test_greedy_matches_transformers_without_prefix_caching(checkpoint):
    path, prompts, expected = checkpoint
    llm, outputs = run(path, prompts, enable_prefix_caching=False, block_size=8)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.stats().prefix_cache_hits == 0
    assert_no_leaks(llm)
