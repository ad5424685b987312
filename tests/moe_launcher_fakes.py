"""Operands for the expert-GEMM launcher tests (moe_gemm, moe_grouped_gemm, moe_grouped_wgmma):
fake device tensors of one small MoE step, so a test states only the operand it changes."""

from __future__ import annotations

from device_fakes import fake_tensor

T, K, E, H, I = 3, 2, 8, 64, 32  # tokens, choices each (P = 6 pairs), experts, hidden, intermediate


def grouped_plan(num_pairs=T * K, num_experts=E):
    """The grouped GEMMs' routing operands: sorted_pairs, offsets, tile_starts."""
    return [fake_tensor((num_pairs,), "int32"), fake_tensor((num_experts + 1,), "int32"),
            fake_tensor((num_experts + 1,), "int32")]


def gemm_routing(num_pairs=T * K, num_experts=E):
    """moe_gemm's routing operands: sorted_pairs, offsets, active_experts, num_active."""
    return [fake_tensor((num_pairs,), "int32"), fake_tensor((num_experts + 1,), "int32"),
            fake_tensor((min(num_experts, num_pairs),), "int32"), fake_tensor((1,), "int32")]


def call_gate_up(launch, routing, hidden=None, x=None, gate_up=None, top_k=K):
    """launch(hidden, x, gate_up, *routing, top_k, stream None), each operand the default unless given."""
    launch(hidden or fake_tensor((T * K, I)), x or fake_tensor((T, H)), gate_up or fake_tensor((E, 2 * I, H)),
           *routing, top_k, None)


def call_down(launch, routing, expert_out=None, hidden=None, down=None):
    """launch(expert_out, hidden, down, *routing[1:], stream None): down takes no sorted_pairs;
    expert_out in the activations' dtype."""
    launch(expert_out or fake_tensor((T * K, H)), hidden or fake_tensor((T * K, I)),
           down or fake_tensor((E, H, I)), *routing[1:], None)
