"""A MoE block with a shared expert (Qwen3-Next's `SparseMoeBlock`) on random weights, and the
order it ran its ops in before `Ops.beside`: the reference of the tests that schedule its two
halves side by side (tests/test_side_branch.py, tests/gpu/test_side_stream.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from sparkd.models.moe import SparseMoeBlock


def shared_expert_block(ops, rng, hidden=64, num_experts=8, top_k=2, intermediate=32, shared=24) -> SparseMoeBlock:
    """A block on `ops` in ops.dtype; weights scaled like trained ones. The config holds only the
    fields the block reads."""
    config = SimpleNamespace(rms_norm_eps=1e-6, num_experts=num_experts, num_experts_per_tok=top_k,
                             norm_topk_prob=True, hidden_size=hidden, moe_intermediate_size=intermediate,
                             shared_expert_intermediate_size=shared, folds_shared_expert=False)
    shapes = {"gate.weight": (num_experts, hidden), "experts.gate_up_proj": (num_experts, 2 * intermediate, hidden),
              "experts.down_proj": (num_experts, hidden, intermediate),
              "shared_expert.gate_up_proj.weight": (2 * shared, hidden),
              "shared_expert.down_proj.weight": (hidden, shared), "shared_expert_gate.weight": (1, hidden)}
    weights = {"mlp." + name: ops.upload((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32), ops.dtype)
               for name, shape in shapes.items()}
    return SparseMoeBlock(config, ops, weights, "mlp.")


def sequential_forward(block: SparseMoeBlock, x, residual, norm_weight):
    """`block.forward` in the order it had before `Ops.beside`: the routed experts, then the shared
    expert and its gate, then the gated sum. -> (out [T, H], residual')."""
    ops = block.ops
    y, router_input, residual = ops.add_rmsnorm_for_router(x, residual, norm_weight, block.eps)
    routed = ops.sparse_moe(y, router_input, block.router, block.gate_up_proj, block.down_proj, block.top_k,
                            block.renormalize)
    gate_up, down, gate = block.shared_expert
    shared = ops.linear(ops.linear_silu_and_mul(y, gate_up), down)
    return ops.mul_sigmoid(shared, ops.linear(y, gate), add_to=routed), residual
