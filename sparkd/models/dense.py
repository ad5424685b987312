"""Dense decoder for LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM, written once against `Ops`.

Mirrors transformers' modeling_llama.py; the Qwen variants differ only in config
flags (Qwen2: q/k/v bias; Qwen3: per-head q/k RMSNorm). The checkpoint's q/k/v
projections arrive fused into one `qkv_proj` and gate/up into one `gate_up_proj`
(see `packed_modules`), so each layer runs two large GEMMs instead of five small ones.

Shapes: T tokens in the step, H hidden, Hq/Hkv query/kv heads, D head dim, I intermediate.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import numpy as np

from ..backend.base import Ops, Tensor
from .config import ModelConfig

Weights = dict[str, Tensor]


def take(weights: Weights, name: str) -> Tensor:
    """Remove and return one uploaded weight; what is left over afterwards was unused."""
    try:
        return weights.pop(name)
    except KeyError:
        raise ValueError(f"checkpoint is missing weight {name!r}") from None


def take_linear(weights: Weights, prefix: str, has_bias: bool) -> tuple[Tensor, Tensor | None]:
    """(weight [N, K], bias [N] or None) of the linear layer at `prefix`."""
    return take(weights, prefix + ".weight"), take(weights, prefix + ".bias") if has_bias else None


class DenseAttention:
    def __init__(self, config: ModelConfig, ops: Ops, weights: Weights, prefix: str):
        self.ops = ops
        self.config = config
        self.scaling = config.head_dim**-0.5
        self.qkv_proj, self.qkv_bias = take_linear(weights, prefix + "qkv_proj", config.qkv_bias)
        self.o_proj, self.o_bias = take_linear(weights, prefix + "o_proj", config.o_proj_bias)
        # Qwen3's per-head q/k RMSNorm, applied inside rope_attention: (q_norm [D], k_norm [D], eps).
        self.qk_norm = ((take(weights, prefix + "q_norm.weight"), take(weights, prefix + "k_norm.weight"),
                         config.rms_norm_eps) if config.qk_norm else None)

    def forward(self, positions: Tensor, hidden_states: Tensor, residual: Tensor | None, norm_weight: Tensor,
                attn: Any, kv_cache: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """The layer's input norm (of hidden_states + residual, `norm_weight`), then attention:
        hidden_states [T, H] -> ([T, H], residual'); writes this step's K/V into kv_cache."""
        ops, config = self.ops, self.config
        qkv, residual = ops.add_rmsnorm_linear(hidden_states, residual, norm_weight, config.rms_norm_eps,
                                               self.qkv_proj, self.qkv_bias)  # [T, (Hq + 2 Hkv) D (+ Hq D)]
        q_width = config.num_heads * config.head_dim
        if config.attention_output_gate:  # Qwen3-Next: the gate's rows come last (qwen3_next.gate_rows_last)
            qkv, gate = ops.split_columns(qkv, [qkv.shape[1] - q_width, q_width])
        q, k, v = ops.split_heads(qkv, config.num_heads, config.num_kv_heads, config.head_dim)
        k_cache, v_cache = kv_cache
        attn_output = ops.rope_attention(q, k, v, positions, config.rope, k_cache, v_cache, attn, self.scaling,
                                         self.qk_norm)  # [T, Hq, D]
        attn_output = ops.reshape(attn_output, (q.shape[0], q_width))
        if config.attention_output_gate:
            attn_output = ops.mul_sigmoid(attn_output, gate)
        return ops.linear(attn_output, self.o_proj, self.o_bias), residual


class DenseMLP:
    def __init__(self, config: ModelConfig, ops: Ops, weights: Weights, prefix: str):
        self.ops = ops
        self.eps = config.rms_norm_eps
        self.gate_up_proj, self.gate_up_bias = take_linear(weights, prefix + "gate_up_proj", config.mlp_bias)
        self.down_proj, self.down_bias = take_linear(weights, prefix + "down_proj", config.mlp_bias)

    def forward(self, x: Tensor, residual: Tensor, norm_weight: Tensor) -> tuple[Tensor, Tensor]:
        """The post-attention norm of x + residual, then down(silu(gate(y)) * up(y)): x [T, H] -> ([T, H], residual')."""
        hidden, residual = self.ops.add_rmsnorm_linear_silu_and_mul(x, residual, norm_weight, self.eps,
                                                                    self.gate_up_proj, self.gate_up_bias)  # [T, I]
        return self.ops.linear(hidden, self.down_proj, self.down_bias), residual


class DenseDecoderLayer:
    """`mixer` is the layer's token mixer (attention, or a hybrid model's gated delta net):
    anything with `forward(positions, x [T, H], residual, norm_weight, attn, cache) -> ([T, H],
    residual')` that norms x + residual itself (the input norm); `mlp` is its feed-forward block,
    `forward(x [T, H], residual, norm_weight) -> ([T, H], residual')` likewise (the post-attention
    norm). So a backend may fuse each norm into the first GEMM after it."""

    def __init__(self, weights: Weights, prefix: str, mixer: Any, mlp: Any):
        self.input_layernorm = take(weights, prefix + "input_layernorm.weight")
        self.self_attn = mixer
        self.post_attention_layernorm = take(weights, prefix + "post_attention_layernorm.weight")
        self.mlp = mlp

    def forward(
        self, positions: Tensor, hidden_states: Tensor, residual: Tensor | None, attn: Any, kv_cache: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """The residual add is deferred into the next norm (`add_rmsnorm`), so a layer
        returns (its sublayer output, the residual stream before adding it); residual is
        None at the first layer. kv_cache: the layer's (k_cache, v_cache), or what its mixer keeps instead."""
        hidden_states, residual = self.self_attn.forward(positions, hidden_states, residual, self.input_layernorm, attn,
                                                         kv_cache)
        return self.mlp.forward(hidden_states, residual, self.post_attention_layernorm)


class DenseForCausalLM:
    """Takes its weights, uploaded and packed, from `weights`, removing each one it uses.

    The registry renames checkpoint path components by `renamed_modules`, then packs
    by `packed_modules`, before the weights get here."""

    renamed_modules: ClassVar[dict[str, str]] = {}
    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: ModelConfig, ops: Ops, weights: Weights):
        self.config = config
        self.ops = ops
        self.embed_tokens = take(weights, "model.embed_tokens.weight")
        self.layers = [
            DenseDecoderLayer(weights, f"model.layers.{i}.", self.build_mixer(weights, f"model.layers.{i}.", i),
                              self.build_mlp(weights, f"model.layers.{i}.mlp.", i))
            for i in range(config.num_layers)
        ]
        self.norm = take(weights, "model.norm.weight")
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)  # some checkpoints store the tied copy anyway
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = take(weights, "lm_head.weight")

    def build_mixer(self, weights: Weights, prefix: str, layer_index: int) -> Any:
        """The token mixer of layer `layer_index`, from the weights under the layer's `prefix`."""
        return DenseAttention(self.config, self.ops, weights, prefix + "self_attn.")

    def build_mlp(self, weights: Weights, prefix: str, layer_index: int) -> Any:
        """The feed-forward block of layer `layer_index`, from the weights under `prefix`."""
        return DenseMLP(self.config, self.ops, weights, prefix)

    @classmethod
    def prepare_weights(cls, config: ModelConfig, weights: Iterable[tuple[str, np.ndarray]]
                        ) -> Iterator[tuple[str, np.ndarray]]:
        """The host weights, renamed and packed, on their way to the backend: a family that
        stores a weight differently from how it runs reorders or rescales it here. Dense: as they are."""
        return iter(weights)

    def forward(self, token_ids: Tensor, positions: Tensor, attn: Any, kv_caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        """token_ids, positions [T] int32 -> final hidden states [T, H], before the last norm.
        kv_caches: per layer, its (k_cache, v_cache) or its mixer's state (hybrid models)."""
        hidden_states = self.ops.embedding(token_ids, self.embed_tokens)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer.forward(positions, hidden_states, residual, attn, kv_cache)
        return self.ops.add(hidden_states, residual)

    def compute_logits(self, hidden_states: Tensor, indices: Tensor) -> Tensor:
        """Final norm + lm_head on rows `indices` [B] int32 of hidden_states [T, H] -> [B, V] float32."""
        return self.ops.logits(hidden_states, indices, self.norm, self.config.rms_norm_eps, self.lm_head)
