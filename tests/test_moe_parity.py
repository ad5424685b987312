"""MoE models (Qwen3-MoE, Mixtral) on NumpyOps against transformers (float32).

The dense models' parity tests run here unchanged on tiny random MoE variants: they are
imported from test_model_parity.py and test_generation.py and get this module's
`models` and `checkpoint` fixtures. That covers prefill logits, chunked prefill over
cached K/V, decodes mixed with prefill chunks, and 32 greedy tokens through `LLM` with
chunking, a prefix-cache hit (whose lone sequence decodes alone: two experts per layer
take every token, the other six none), preemption, and no prefix caching. The tests
below add what is MoE-specific: where the MoE layers are, and checkpoint loading.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from oracle import make_prompts, make_tiny_checkpoint, save_fused_experts_checkpoint, tiny_moe_overrides
from test_generation import (  # noqa: F401  (tests collected here too)
    hf_greedy,
    test_greedy_matches_transformers_under_preemption,
    test_greedy_matches_transformers_with_prefix_hits_and_chunking,
    test_greedy_matches_transformers_without_prefix_caching,
)
from test_model_parity import (  # noqa: F401  (tests collected here too)
    test_decodes_mixed_with_prefill_chunks,
    test_prefill_batch_matches_transformers,
    test_prompt_in_two_chunks_reads_cached_kv,
)

from sparkd.backend.cpu.ops import NumpyOps
from sparkd.models.config import ModelConfig
from sparkd.models.moe import SparseMoeBlock
from sparkd.models.registry import load_model, stack_experts
from sparkd.models.safetensors_reader import read_header

VARIANTS = {
    # MoE layers 0 and 2, a dense MLP in layer 1; top-k weights renormalised.
    "qwen3-moe-mlp-only-layer": ("Qwen3MoeForCausalLM", dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)),
    # MoE layers 1 and 3 only; top-k weights stay softmax probabilities.
    "qwen3-moe-sparse-step-2": ("Qwen3MoeForCausalLM", dict(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False)),
    "mixtral": ("MixtralForCausalLM", {}),
}


@pytest.fixture(scope="module", autouse=True)
def single_threaded_torch():
    """The tiny models gain nothing from threads, and on a busy machine torch's thread
    pool makes each forward of the eager expert loop up to a hundred times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(VARIANTS))
def moe_checkpoint(request, tmp_path_factory):
    """(checkpoint directory, HF model) of one variant, saved by `save_pretrained`."""
    arch, overrides = VARIANTS[request.param]
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **tiny_moe_overrides(arch, **overrides))


@pytest.fixture(scope="module")
def models(moe_checkpoint):
    """(sparkd model, HF model), for the tests from test_model_parity.py."""
    path, hf_model = moe_checkpoint
    return load_model(path, NumpyOps()), hf_model


@pytest.fixture(scope="module")
def checkpoint(moe_checkpoint):
    """(directory, prompts, HF greedy tokens per prompt), for the tests from test_generation.py."""
    path, hf_model = moe_checkpoint
    prompts = make_prompts(np.random.default_rng(7), hf_model.config.vocab_size)
    return path, prompts, [hf_greedy(hf_model, p) for p in prompts]


def test_moe_layers_are_where_transformers_puts_them(models):
    model, hf_model = models
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers]
    expected = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf_model.model.layers]
    assert ours == expected
    assert any(ours)


def test_per_expert_and_fused_checkpoints_load_the_same_experts(moe_checkpoint, tmp_path):
    """`save_pretrained` writes one tensor per expert (here also sharded, so that a
    layer's experts span files); transformers 5 keeps them fused in memory. Every
    layout loads into the HF model's fused tensors, exactly."""
    path, hf_model = moe_checkpoint
    (shard,) = path.glob("*.safetensors")
    assert any(".experts.0." in name for name in read_header(shard)[0])
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="100KB")
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    moe_layer = next(i for i, layer in enumerate(hf_model.model.layers) if hasattr(layer.mlp, "experts"))
    assert len({shard for name, shard in weight_map.items() if f"layers.{moe_layer}.mlp.experts." in name
                or f"layers.{moe_layer}.block_sparse_moe.experts." in name}) > 1
    fused = save_fused_experts_checkpoint(hf_model, tmp_path / "fused")
    assert any(name.endswith(".experts.gate_up_proj") for name in read_header(fused / "model.safetensors")[0])

    for model in (load_model(path, NumpyOps()), load_model(sharded, NumpyOps()), load_model(fused, NumpyOps())):
        for layer, hf_layer in zip(model.layers, hf_model.model.layers):
            if not isinstance(layer.mlp, SparseMoeBlock):
                continue
            np.testing.assert_array_equal(layer.mlp.router, hf_layer.mlp.gate.weight.detach().numpy())
            np.testing.assert_array_equal(layer.mlp.gate_up_proj, hf_layer.mlp.experts.gate_up_proj.detach().numpy())
            np.testing.assert_array_equal(layer.mlp.down_proj, hf_layer.mlp.experts.down_proj.detach().numpy())


def test_stack_experts_waits_for_every_expert():
    weights = [("l.experts.1.w.weight", np.full((2, 3), 1.0)), ("l.norm.weight", np.ones(3)),
               ("l.experts.0.w.weight", np.full((2, 3), 0.0)), ("l.experts.2.w.weight", np.full((2, 3), 2.0))]
    stacked = dict(stack_experts(weights, num_experts=3))
    assert list(stacked) == ["l.norm.weight", "l.experts.w"]
    np.testing.assert_array_equal(stacked["l.experts.w"][:, 0, 0], [0, 1, 2])
    with pytest.raises(ValueError, match="only some of the 3 experts"):
        list(stack_experts(weights[:2], num_experts=3))
    with pytest.raises(ValueError, match="only 2 experts"):
        list(stack_experts(weights, num_experts=2))


@pytest.mark.parametrize("arch, change, message", [
    ("Qwen3MoeForCausalLM", {"num_experts_per_tok": 9}, "num_experts_per_tok must be between 1 and the number of experts"),
    ("Qwen3MoeForCausalLM", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("MixtralForCausalLM", {"sliding_window": 4096}, "sliding-window"),
])
def test_bad_moe_configs_are_refused(tmp_path, arch, change, message):
    path, _ = make_tiny_checkpoint(tmp_path, arch, **tiny_moe_overrides(arch, num_hidden_layers=1))
    config = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**config, **change})


def test_moe_config_fields(moe_checkpoint):
    path, hf_model = moe_checkpoint
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    hf_config = hf_model.config
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    mixtral = config.architecture == "MixtralForCausalLM"
    assert config.moe_intermediate_size == (hf_config.intermediate_size if mixtral else hf_config.moe_intermediate_size)
    assert config.norm_topk_prob == (mixtral or hf_config.norm_topk_prob)
    assert config.qk_norm == (not mixtral)
