"""NumpyOps.moe_route and NumpyOps.moe_experts against straightforward references:
torch's softmax + topk (transformers' routers), a per-token loop over each token's
experts in float64, transformers' own expert module, and an exact float16 case of where
each expert's row is rounded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from sparkd.backend.cpu.ops import NumpyOps

OPS = NumpyOps()
RTOL = 1e-5


def reference_route(router_logits: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """transformers' Qwen3MoeTopKRouter / MixtralTopKRouter after the router GEMM."""
    probs = torch.softmax(torch.from_numpy(router_logits).float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.numpy(), expert_ids.numpy()


def reference_experts(x, gate_up, down, weights, expert_ids) -> np.ndarray:
    """One token and one of its experts at a time, in float64."""
    x, gate_up, down = (a.astype(np.float64) for a in (x, gate_up, down))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, expert in zip(weights[t], expert_ids[t]):
            gate, up = np.split(gate_up[expert] @ x[t], 2)
            out[t] += weight * (down[expert] @ (gate / (1 + np.exp(-gate)) * up))
    return out


def random_experts(rng, num_experts: int, hidden: int, intermediate: int):
    """gate_up [E, 2I, H], down [E, H, I] float32, scaled like trained weights."""
    gate_up = rng.standard_normal((num_experts, 2 * intermediate, hidden), dtype=np.float32) / hidden**0.5
    down = rng.standard_normal((num_experts, hidden, intermediate), dtype=np.float32) / intermediate**0.5
    return gate_up, down


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (16, 4), (4, 1), (3, 3)])
def test_route_matches_softmax_topk(num_experts, top_k, renormalize):
    rng = np.random.default_rng(num_experts * 10 + top_k)
    router_logits = 2 * rng.standard_normal((37, num_experts), dtype=np.float32)
    weights, expert_ids = OPS.moe_route(router_logits, top_k, renormalize)
    expected_weights, expected_ids = reference_route(router_logits, top_k, renormalize)
    assert weights.dtype == np.float32 and expert_ids.dtype == np.int32
    assert weights.shape == expert_ids.shape == (37, top_k)
    np.testing.assert_array_equal(expert_ids, expected_ids)
    np.testing.assert_allclose(weights, expected_weights, rtol=RTOL)
    if renormalize:
        np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=RTOL)


def test_route_ties_go_to_the_lower_expert_id():
    router_logits = np.array([
        [1.0, 3.0, 3.0, 0.0, 3.0],  # three-way tie for the top: experts 1, 2
        [2.0, 0.5, 2.0, 2.0, 0.5],  # three tied for two slots: 0, 2
        [0.0, 0.0, 0.0, 0.0, 0.0],  # all equal: 0, 1
        [0.0, 1.0, 0.0, 5.0, 0.0],  # ties only below the top two: 3, 1
    ], dtype=np.float32)
    probs = np.exp(router_logits) / np.exp(router_logits).sum(axis=-1, keepdims=True)
    weights, expert_ids = OPS.moe_route(router_logits, 2, renormalize=False)
    expected_ids = [sorted(range(5), key=lambda e: (-row[e], e))[:2] for row in router_logits]
    np.testing.assert_array_equal(expert_ids, expected_ids)
    np.testing.assert_allclose(weights, np.take_along_axis(probs, np.array(expected_ids), axis=-1), rtol=RTOL)
    renormalized, _ = OPS.moe_route(router_logits, 2, renormalize=True)
    np.testing.assert_allclose(renormalized[2], [0.5, 0.5], rtol=RTOL)


@pytest.mark.parametrize("top_k", [0, 6])
def test_route_rejects_top_k_outside_the_experts(top_k):
    with pytest.raises(ValueError, match="top_k"):
        OPS.moe_route(np.zeros((2, 5), np.float32), top_k, renormalize=True)


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 8, 2), (29, 8, 2), (64, 16, 4), (5, 4, 1)])
def test_experts_match_per_token_reference(num_tokens, num_experts, top_k):
    rng = np.random.default_rng(num_tokens)
    hidden, intermediate = 24, 40
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    gate_up, down = random_experts(rng, num_experts, hidden, intermediate)
    weights, expert_ids = OPS.moe_route(rng.standard_normal((num_tokens, num_experts), dtype=np.float32), top_k, True)
    out = OPS.moe_experts(x, gate_up, down, weights, expert_ids)
    assert out.shape == x.shape and out.dtype == np.float32
    expected = reference_experts(x, gate_up, down, weights, expert_ids)
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())


def test_idle_experts_are_never_read_and_one_expert_serves_every_token():
    """Expert 3 is in every token's top-2; experts 2, 4 and 5 get no token, and their
    weights are NaN, so any read of them would poison the output."""
    rng = np.random.default_rng(1)
    hidden, intermediate = 16, 8
    x = rng.standard_normal((5, hidden), dtype=np.float32)
    gate_up, down = random_experts(rng, 6, hidden, intermediate)
    expert_ids = np.array([[3, 0], [1, 3], [3, 0], [3, 1], [0, 3]], dtype=np.int32)
    weights = rng.uniform(0.1, 1.0, (5, 2)).astype(np.float32)
    expected = reference_experts(x, gate_up, down, weights, expert_ids)
    idle = [2, 4, 5]
    gate_up[idle] = np.nan
    down[idle] = np.nan
    out = OPS.moe_experts(x, gate_up, down, weights, expert_ids)
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())


def test_experts_match_transformers_expert_module():
    """Same [gate | up] layout and combine as transformers' fused Qwen3MoeExperts."""
    rng = np.random.default_rng(2)
    num_experts, hidden, intermediate, num_tokens = 8, 32, 20, 13
    config = transformers.Qwen3MoeConfig(num_experts=num_experts, hidden_size=hidden, moe_intermediate_size=intermediate)
    hf_experts = Qwen3MoeExperts(config)
    gate_up, down = random_experts(rng, num_experts, hidden, intermediate)
    with torch.no_grad():
        hf_experts.gate_up_proj.copy_(torch.from_numpy(gate_up))
        hf_experts.down_proj.copy_(torch.from_numpy(down))
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    weights, expert_ids = OPS.moe_route(rng.standard_normal((num_tokens, num_experts), dtype=np.float32), 3, False)
    with torch.no_grad():
        expected = hf_experts(torch.from_numpy(x), torch.from_numpy(expert_ids).long(), torch.from_numpy(weights)).numpy()
    out = OPS.moe_experts(x, gate_up, down, weights, expert_ids)
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())


def test_each_expert_row_is_rounded_to_x_dtype_before_the_fp32_sum():
    """float16 x: expert 0 gives the row 1 + 2^-12, which rounds to 1 in float16 (10 fraction bits),
    expert 1 gives -1. Rounded first (as a GPU stores them, and as transformers does) they cancel;
    summed unrounded they would leave 2^-12, a float16 number."""
    hidden, intermediate = 8, 4
    x = np.zeros((1, hidden), np.float16)
    x[0, 0] = 1
    gate_up = np.zeros((2, 2 * intermediate, hidden), np.float32)
    gate_up[:, 0, 0] = 32  # gate column 0: silu(32) = 32 in float32 (exp(-32) is below half an ulp of 1)
    gate_up[:, intermediate, 0] = 1  # up column 0
    down = np.zeros((2, hidden, intermediate), np.float32)
    down[0, :, 0] = (1 + 2**-12) / 32
    down[1, :, 0] = -1 / 32
    out = OPS.moe_experts(x, gate_up, down, np.ones((1, 2), np.float32), np.array([[0, 1]], np.int32))
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, np.zeros((1, hidden), np.float16))


def test_experts_reject_ids_outside_the_experts():
    rng = np.random.default_rng(3)
    gate_up, down = random_experts(rng, 4, 8, 4)
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="expert_ids"):
        OPS.moe_experts(x, gate_up, down, np.ones((2, 1), np.float32), np.array([[0], [4]], np.int32))
