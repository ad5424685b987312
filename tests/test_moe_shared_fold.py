"""A shared expert of a routed expert's shape runs as one more stacked expert
(ModelConfig.folds_shared_expert): the registry appends it to the stacked experts as expert E,
the router gets its gate as row E, and `Ops.sparse_moe` routes every token to it, weighted by
the gate's sigmoid. The model's logits must still be transformers' (which runs it beside)."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cpu.ops import NumpyOps
from sparkd.backend.cuda.moe_ops import MoeOps
from sparkd.models.registry import fold_shared_expert, load_model, stack_experts

pytest.importorskip("transformers")
from tests.oracle import make_tiny_checkpoint, tiny_hybrid_overrides  # noqa: E402
from tests.test_qwen3_next import assert_a_batch_matches_transformers  # noqa: E402


def test_the_shared_expert_is_appended_to_either_form_of_stacked_experts():
    rng = np.random.default_rng(0)
    experts, shared, other = rng.standard_normal((3, 4, 2)), rng.standard_normal((4, 2)), rng.standard_normal(5)
    fused = [("l.mlp.shared_expert.gate_up_proj.weight", shared), ("l.norm.weight", other),
             ("l.mlp.experts.gate_up_proj", experts)]  # transformers 5's fused tensor, after its shared expert
    out = dict(fold_shared_expert(iter(fused)))
    assert sorted(out) == ["l.mlp.experts.gate_up_proj", "l.norm.weight"]
    np.testing.assert_array_equal(out["l.mlp.experts.gate_up_proj"], np.concatenate([experts, shared[None]]))
    per_expert = [(f"l.mlp.experts.{e}.down_proj.weight", experts[e]) for e in range(3)]
    out = dict(fold_shared_expert(stack_experts(iter([*per_expert, ("l.mlp.shared_expert.down_proj.weight", shared)]),
                                                3)))
    np.testing.assert_array_equal(out["l.mlp.experts.down_proj"], np.concatenate([experts, shared[None]]))


def test_experts_without_their_shared_expert_are_an_error():
    with pytest.raises(ValueError, match="not the shared expert"):
        list(fold_shared_expert(iter([("l.mlp.experts.down_proj", np.zeros((3, 4, 2)))])))
    with pytest.raises(ValueError, match="shape"):
        list(fold_shared_expert(iter([("l.mlp.experts.down_proj", np.zeros((3, 4, 2))),
                                      ("l.mlp.shared_expert.down_proj.weight", np.zeros((4, 3)))])))


@pytest.fixture(scope="module")
def folded(tmp_path_factory):
    """(transformers model, sparkd model on NumpyOps) of a tiny Qwen3-Next whose shared expert has
    the routed experts' width (48)."""
    path, hf = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_next_folded"), "Qwen3NextForCausalLM",
                                    **tiny_hybrid_overrides(shared_expert_intermediate_size=48))
    return hf, load_model(path, NumpyOps())


def test_the_folded_model_matches_transformers(folded):
    hf, model = folded
    assert model.config.folds_shared_expert
    block = model.layers[0].mlp
    assert block.gate_up_proj.shape[0] == block.router.shape[0] == model.config.num_experts + 1
    assert_a_batch_matches_transformers(hf, model, long_prompt=70)


def test_a_folded_shared_expert_run_beside_the_routed_ones_matches_transformers(folded, monkeypatch):
    """The form a GPU takes for a step of many tokens (Ops.shared_expert_among_routed): the dense
    shared expert and the routed ones on views of the same stacks."""
    hf, model = folded
    block = model.layers[0].mlp
    gate_up, down, _ = block.shared_expert
    assert np.shares_memory(gate_up, block.gate_up_proj) and np.shares_memory(down, block.down_proj)
    monkeypatch.setattr(NumpyOps, "shared_expert_among_routed", lambda *_: False)
    assert_a_batch_matches_transformers(hf, model, long_prompt=70)


@pytest.mark.parametrize("tokens, top_k, slots, among", [
    (1, 10, 513, True), (2, 10, 513, True),  # Qwen3-Next decode: 11 / 22 folded pairs, one launch routes them
    (3, 10, 513, False),  # 33 folded pairs would miss the one-launch router that the routed 30 take
    (64, 10, 513, False),  # 64 rows: 8 passes of the expert GEMMs over the shared expert's weights
    (8, 2, 129, True), (10, 2, 129, False),  # 24 / 30 pairs, but 10 rows take two passes of kM = 8
])
def test_a_gpu_folds_the_shared_expert_only_into_small_decode_steps(tokens, top_k, slots, among):
    """The rule reads shapes only: no device."""
    assert MoeOps.shared_expert_among_routed(None, tokens, top_k, slots) is among
