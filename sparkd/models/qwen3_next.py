"""Qwen3NextForCausalLM: a hybrid of gated delta net layers and gated attention, with MoE, written once against `Ops`.

Mirrors transformers' modeling_qwen3_next.py. `config.layer_types` gives each layer's token
mixer: "linear_attention", a gated delta net (`GatedDeltaNet`, which keeps a per-sequence
state in the engine's state pool instead of K/V), or "full_attention", the dense attention
with Qwen3's q/k norm, partial rotary and an output gate (`DenseAttention` with
`config.attention_output_gate`). The MLP is Qwen3-MoE's sparse block with a gated shared
expert (`SparseMoeBlock`), or a dense MLP in `mlp_only_layers`.

How the checkpoint is stored vs how it runs (`prepare_weights`, exact reorderings and one add):
- RMSNorm weights are zero-centred (applied as 1 + w): the layer norms, the final norm and
  q/k norm get the 1 added on the host, in fp32. The delta net's gated norm is a plain one.
- q_proj interleaves each head's query and gate rows; they are regrouped [queries | k | v | gates]
  so that one GEMM gives qkv and the gate as column ranges.
- in_proj_qkvz and in_proj_ba group their rows by key head ([q_h, k_h, v_h, z_h] and [b_h, a_h]);
  they are packed into one `in_proj` whose rows are [q | k | v | z | b | a], so the conv input
  [q | k | v] is one column range of its output.
- The MTP module's weights (`mtp.*`) are kept, unused, for speculative decoding.

Shapes: T tokens, H hidden, Hk / Hv the delta net's key / value heads of dk / dv, C = 2 Hk dk + Hv dv.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import numpy as np

from ..backend.base import DeltaNetShape, Ops, Tensor
from .config import ModelConfig
from .dense import Weights
from .moe import MoeForCausalLM, take_shaped

_ZERO_CENTRED_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                       "self_attn.k_norm.weight")


class GatedDeltaNet:
    """Qwen3NextGatedDeltaNet: in_proj -> causal conv + SiLU over [q | k | v] -> the gated delta
    rule with the state of each sequence's slot -> gated RMSNorm by z -> out_proj."""

    def __init__(self, config: ModelConfig, ops: Ops, weights: Weights, prefix: str):
        self.ops = ops
        self.eps = config.rms_norm_eps
        self.shape = shape = config.delta_net_shape
        hidden, value_width = config.hidden_size, shape.num_v_heads * shape.v_dim
        self.in_proj = take_shaped(weights, prefix + "in_proj.weight",
                                   (shape.conv_dim + value_width + 2 * shape.num_v_heads, hidden))
        self.conv_weight = take_shaped(weights, prefix + "conv1d.weight", (shape.conv_dim, config.linear_conv_kernel_dim))
        self.a_log = take_shaped(weights, prefix + "A_log", (shape.num_v_heads,))
        self.dt_bias = take_shaped(weights, prefix + "dt_bias", (shape.num_v_heads,))
        self.norm_weight = take_shaped(weights, prefix + "norm.weight", (shape.v_dim,))
        self.out_proj = take_shaped(weights, prefix + "out_proj.weight", (hidden, value_width))

    def forward(self, positions: Tensor, hidden_states: Tensor, residual: Tensor | None, norm_weight: Tensor,
                attn: Any, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """The layer's input norm, then the delta net: [T, H] -> ([T, H], residual'). state:
        (conv_state, recurrent_state) of this layer's pool, read and left at each sequence's slot."""
        ops, shape = self.ops, self.shape
        projected, residual = ops.add_rmsnorm_linear(hidden_states, residual, norm_weight, self.eps, self.in_proj)
        value_width = shape.num_v_heads * shape.v_dim
        mixed_qkv, z, b, a = ops.split_columns(projected, [shape.conv_dim, value_width, shape.num_v_heads,
                                                           shape.num_v_heads])
        conv_state, recurrent_state = state
        mixed_qkv = ops.causal_conv1d_silu(mixed_qkv, self.conv_weight, conv_state, attn)  # [T, C]
        core = ops.gated_delta_net(mixed_qkv, a, b, self.a_log, self.dt_bias, z, self.norm_weight, self.eps,
                                   recurrent_state, attn, shape)  # [T, Hv dv]
        return ops.linear(core, self.out_proj), residual


class Qwen3NextForCausalLM(MoeForCausalLM):
    """The MoE decoder with a gated delta net in place of attention in its linear-attention layers."""

    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {
        **MoeForCausalLM.packed_modules, "in_proj": ("in_proj_qkvz", "in_proj_ba")}

    def __init__(self, config: ModelConfig, ops: Ops, weights: Weights):
        super().__init__(config, ops, weights)
        # Multi-token prediction weights: kept for speculative decoding, which does not use them yet.
        self.mtp = {name: weights.pop(name) for name in [n for n in weights if n.startswith("mtp.")]}

    def build_mixer(self, weights: Weights, prefix: str, layer_index: int) -> Any:
        if self.config.is_linear_attention_layer(layer_index):
            return GatedDeltaNet(self.config, self.ops, weights, prefix + "linear_attn.")
        return super().build_mixer(weights, prefix, layer_index)

    @classmethod
    def prepare_weights(cls, config: ModelConfig, weights: Iterable[tuple[str, np.ndarray]]
                        ) -> Iterator[tuple[str, np.ndarray]]:
        for name, array in weights:
            if name.startswith("mtp."):
                yield name, array
            elif name.endswith(_ZERO_CENTRED_NORMS) or name == "model.norm.weight":
                yield name, 1.0 + array.astype(np.float32)
            elif name.endswith("self_attn.qkv_proj.weight"):
                yield name, gate_rows_last(array, config)
            elif name.endswith("linear_attn.in_proj.weight"):
                yield name, array[delta_net_in_proj_order(config.delta_net_shape)]
            elif name.endswith("linear_attn.conv1d.weight"):
                yield name, array.reshape(array.shape[0], -1)  # [C, 1, W] -> [C, W]
            else:
                yield name, array


def gate_rows_last(qkv: np.ndarray, config: ModelConfig) -> np.ndarray:
    """qkv_proj [Hq 2D + 2 Hkv D, H] whose q part interleaves each head's query and gate rows ->
    rows [queries | k | v | gates]."""
    q_rows, head_dim = 2 * config.num_heads * config.head_dim, config.head_dim
    per_head = qkv[:q_rows].reshape(config.num_heads, 2, head_dim, -1)
    queries, gates = (per_head[:, i].reshape(config.num_heads * head_dim, -1) for i in (0, 1))
    return np.concatenate([queries, qkv[q_rows:], gates])


def delta_net_in_proj_order(shape: DeltaNetShape) -> np.ndarray:
    """Row order taking the packed [in_proj_qkvz; in_proj_ba] (rows grouped by key head:
    [q_h dk, k_h dk, v_h r dv, z_h r dv] then [b_h r, a_h r], r = Hv / Hk) to [q | k | v | z | b | a]."""
    hk, dk, dv = shape.num_k_heads, shape.k_dim, shape.v_dim
    r = shape.num_v_heads // hk
    group = 2 * dk + 2 * r * dv
    offsets = np.cumsum([0, dk, dk, r * dv, r * dv])  # q, k, v, z within a key head's group
    qkvz = [np.concatenate([h * group + np.arange(offsets[i], offsets[i + 1]) for h in range(hk)]) for i in range(4)]
    ba_start = hk * group
    ba = [np.concatenate([ba_start + h * 2 * r + i * r + np.arange(r) for h in range(hk)]) for i in range(2)]
    return np.concatenate(qkvz + ba)
