"""Mixture-of-experts decoder for Qwen3MoeForCausalLM and MixtralForCausalLM, written once against `Ops`.

The dense decoder (dense.py) with a sparse MoE block in place of the MLP in the
layers `ModelConfig.is_moe_layer` picks: Qwen3-MoE by `decoder_sparse_step` and
`mlp_only_layers` (the other layers keep a dense MLP), Mixtral in every layer.
Mirrors transformers' modeling_qwen3_moe.py and modeling_mixtral.py; attention is
Qwen3's (q/k norm) or Llama's by the same config flags as the dense models.

Checkpoint layout: Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2` are renamed to
Qwen3-MoE's `mlp.experts.{e}.gate_proj/up_proj/down_proj` (`renamed_modules`); gate
and up are packed per expert, then the registry stacks the experts
(`registry.stack_experts`) into `mlp.experts.gate_up_proj` [E, 2I, H] and
`mlp.experts.down_proj` [E, H, I]. Those are the names transformers 5 uses in
memory, so checkpoints saved in that fused 3-D form load unchanged.

Shapes: T tokens in the step, H hidden, E experts, k experts per token, I expert intermediate.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..backend.base import Ops, Tensor
from .config import ModelConfig
from .dense import DenseForCausalLM, Weights, take


def take_shaped(weights: Weights, name: str, shape: tuple[int, ...]) -> Tensor:
    """`take`, checking the weight has the shape the config implies."""
    tensor = take(weights, name)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, but the config implies {shape}")
    return tensor


class SparseMoeBlock:
    """Router and routed SiLU experts: Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock.

    The router's logits are those of the normed rows before their rounding to the model dtype,
    accumulated in fp32: in bf16, rounding the rows flips the top-k choice between near-tied
    experts, which changes the token's output wholesale (on the tiny test models it cost a
    point of top-1 agreement with fp32). The backend says how it holds those rows and the
    router weight (`Ops.add_rmsnorm_for_router`, `Ops.router_weight`)."""

    def __init__(self, config: ModelConfig, ops: Ops, weights: Weights, prefix: str):
        self.ops = ops
        self.eps = config.rms_norm_eps
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        num_experts, hidden, intermediate = config.num_experts, config.hidden_size, config.moe_intermediate_size
        router = take_shaped(weights, prefix + "gate.weight", (num_experts, hidden))
        # Qwen3-Next: a dense SiLU expert every token takes, scaled by sigmoid(shared_expert_gate(y)).
        # Of a routed expert's shape, it is stacked as expert E (registry.fold_shared_expert) and its
        # gate is the router's row E, so that a step can run it as one more expert (`Ops.sparse_moe`'s
        # shared_expert) or beside them (`Ops.shared_expert_among_routed` picks), from one copy.
        self.folded = config.folds_shared_expert
        slots = num_experts + self.folded
        shared_gate = None
        if config.shared_expert_intermediate_size:
            shared_gate = take_shaped(weights, prefix + "shared_expert_gate.weight", (1, hidden))
        self.router = ops.router_weight(router, shared_gate if self.folded else None)
        self.gate_up_proj = take_shaped(weights, prefix + "experts.gate_up_proj", (slots, 2 * intermediate, hidden))
        self.down_proj = take_shaped(weights, prefix + "experts.down_proj", (slots, hidden, intermediate))
        # The routed experts and the shared one, as views of those stacks where it is folded in.
        self.routed = (self.router[:num_experts], self.gate_up_proj[:num_experts], self.down_proj[:num_experts])
        self.shared_expert = None
        if self.folded:
            self.shared_expert = (self.gate_up_proj[num_experts], self.down_proj[num_experts], shared_gate)
        elif shared_gate is not None:
            shared = config.shared_expert_intermediate_size
            self.shared_expert = (take_shaped(weights, prefix + "shared_expert.gate_up_proj.weight", (2 * shared, hidden)),
                                  take_shaped(weights, prefix + "shared_expert.down_proj.weight", (hidden, shared)),
                                  shared_gate)

    def forward(self, x: Tensor, residual: Tensor, norm_weight: Tensor) -> tuple[Tensor, Tensor]:
        """The post-attention norm of x + residual, kept unrounded beside the rows for the router
        (`Ops.add_rmsnorm_for_router`), then `Ops.sparse_moe`: the sum over each token's k experts
        of weight * expert(y), plus the gated shared expert where there is one.
        x [T, H] -> ([T, H], residual')."""
        y, router_input, residual = self.ops.add_rmsnorm_for_router(x, residual, norm_weight, self.eps)
        if self.folded and self.ops.shared_expert_among_routed(y.shape[0], self.top_k, self.router.shape[0]):
            return self.ops.sparse_moe(y, router_input, self.router, self.gate_up_proj, self.down_proj, self.top_k,
                                       self.renormalize, shared_expert=True), residual
        if self.shared_expert is None:
            return self._routed_experts(y, router_input), residual
        # The shared expert needs only y, so it runs beside the routed experts (on a GPU beside the
        # router, whose single routing block leaves the other SMs idle); its gated output joins their sum.
        with self.ops.beside(lambda: self._shared_expert(y)) as shared:
            routed = self._routed_experts(y, router_input)
        return self.ops.mul_sigmoid(*shared.result, add_to=routed), residual

    def _routed_experts(self, y: Tensor, router_input: Tensor) -> Tensor:
        """`Ops.sparse_moe` of the normed rows y [T, H] over the routed experts -> [T, H]."""
        router, gate_up, down = self.routed
        return self.ops.sparse_moe(y, router_input, router, gate_up, down, self.top_k, self.renormalize)

    def _shared_expert(self, y: Tensor) -> tuple[Tensor, Tensor]:
        """The shared SiLU expert's output [T, H] and its gate's logit [T, 1], before the sigmoid."""
        gate_up, down, gate = self.shared_expert
        return self.ops.linear(self.ops.linear_silu_and_mul(y, gate_up), down), self.ops.linear(y, gate)


class MoeForCausalLM(DenseForCausalLM):
    """A dense decoder whose MoE layers (`config.is_moe_layer`) hold a SparseMoeBlock."""

    renamed_modules: ClassVar[dict[str, str]] = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    def build_mlp(self, weights: Weights, prefix: str, layer_index: int) -> Any:
        if self.config.is_moe_layer(layer_index):
            return SparseMoeBlock(self.config, self.ops, weights, prefix)
        return super().build_mlp(weights, prefix, layer_index)
