"""HF `config.json` (+ `generation_config.json`) -> `ModelConfig`, the one config the models read.

Field names follow transformers; where transformers 4 and 5 store a value differently
(`rope_scaling` vs `rope_parameters`, `torch_dtype` vs `dtype`) both layouts are read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..backend.base import DeltaNetShape, RopeConfig

# Traits the HF modeling files hard-code instead of reading from the config.
_ALWAYS_QKV_BIAS = {"Qwen2ForCausalLM"}
_QK_NORM = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"}
# Qwen3-Next: RMSNorm weights stored as w with (1 + w) applied, and attention's output gated
# by a second half of q_proj.
_HYBRID = {"Qwen3NextForCausalLM"}
_ALWAYS_RENORMALIZE_TOPK = {"MixtralForCausalLM"}

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass
class ModelConfig:
    """Everything a decoder needs from the checkpoint's config files."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    dtype: str | None = None  # checkpoint dtype as HF names it, e.g. "bfloat16"
    # Mixture of experts (Qwen3-MoE, Mixtral); num_experts 0 is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # I of each expert; `intermediate_size` stays the dense MLP's
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here
    shared_expert_intermediate_size: int = 0  # Qwen3-Next: a dense expert beside the routed ones, 0: none
    # Hybrid models (Qwen3-Next): "linear_attention" (a gated delta net) or "full_attention" per
    # layer; empty: every layer is full attention.
    layer_types: list[str] = field(default_factory=list)
    zero_centered_norms: bool = False  # RMSNorm weights w applied as (1 + w)
    attention_output_gate: bool = False  # q_proj also yields a per-head gate: o = attn * sigmoid(gate)
    linear_num_key_heads: int = 0  # Hk of the gated delta net
    linear_num_value_heads: int = 0  # Hv (a multiple of Hk)
    linear_key_head_dim: int = 0  # dk
    linear_value_head_dim: int = 0  # dv
    linear_conv_kernel_dim: int = 0  # the depthwise causal conv's width

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` has a sparse MoE block rather than a dense MLP (transformers' rule)."""
        return self.num_experts > 0 and index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0

    def is_linear_attention_layer(self, index: int) -> bool:
        """Whether layer `index` mixes tokens by a gated delta net (per-sequence state) rather than attention."""
        return bool(self.layer_types) and self.layer_types[index] == "linear_attention"

    @property
    def folds_shared_expert(self) -> bool:
        """Whether the shared expert runs as one more expert of the stacked experts (expert E, which
        every token takes, weighted by its sigmoid gate): it has a routed expert's shape, and the
        experts' two launches then stream its weights too, instead of three more GEMVs beside them."""
        return 0 < self.shared_expert_intermediate_size == self.moe_intermediate_size

    @property
    def attention_layers(self) -> list[int]:
        """The layers that keep K/V in the paged cache."""
        return [i for i in range(self.num_layers) if not self.is_linear_attention_layer(i)]

    @property
    def linear_attention_layers(self) -> list[int]:
        """The layers that keep a per-sequence state (conv window + recurrent state) instead."""
        return [i for i in range(self.num_layers) if self.is_linear_attention_layer(i)]

    @property
    def delta_net_shape(self) -> DeltaNetShape:
        """The head counts and sizes of the linear-attention layers' gated delta nets."""
        return DeltaNetShape(self.linear_num_key_heads, self.linear_key_head_dim, self.linear_num_value_heads,
                             self.linear_value_head_dim)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """Build from the parsed `config.json` and optional `generation_config.json`."""
        try:
            return cls._from_hf(hf, generation or {})
        except KeyError as missing:
            raise ValueError(f"config.json has no {missing.args[0]!r}") from None

    @classmethod
    def _from_hf(cls, hf: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
        architecture = architecture_of(hf)
        _reject_unsupported_features(hf)
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        attention_bias = bool(hf.get("attention_bias", False))
        qkv_bias = architecture in _ALWAYS_QKV_BIAS or attention_bias
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rope=rope_config(hf, head_dim),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            # Qwen2 biases q/k/v only; Llama and Qwen3 `attention_bias` covers o_proj too.
            o_proj_bias=attention_bias and architecture not in _ALWAYS_QKV_BIAS,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=architecture in _QK_NORM,
            eos_token_ids=_merge_ids(generation.get("eos_token_id"), hf.get("eos_token_id")),
            bos_token_id=generation.get("bos_token_id", hf.get("bos_token_id")),
            dtype=hf.get("dtype") or hf.get("torch_dtype"),
            **_moe_fields(hf, architecture),
            **_hybrid_fields(hf, architecture),
        )


def read_hf_configs(model_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json or {}) of a checkpoint directory."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; is it a Hugging Face checkpoint directory?")
    generation_path = model_dir / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
    return json.loads(config_path.read_text()), generation


def architecture_of(hf: dict[str, Any]) -> str:
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ValueError("config.json has no 'architectures' entry; cannot tell which model to build")
    return architectures[0]


def rope_config(hf: dict[str, Any], head_dim: int) -> RopeConfig:
    """Rotary frequencies as transformers computes them, from either config layout:
    transformers 5 `rope_parameters` {rope_type, rope_theta, ...} or 4.x top-level
    `rope_theta` + `rope_scaling` {type|rope_type, ...}."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    if rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, params, hf.get("max_position_embeddings", 2048))
    return RopeConfig(rotary_dim=rotary_dim, inv_freq=inv_freq)


def _llama3_scaled(inv_freq: np.ndarray, params: dict[str, Any], max_positions: int) -> np.ndarray:
    """Llama 3.1 frequency scaling: long wavelengths are divided by `factor`, short ones
    kept, and the band between is interpolated smoothly."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params.get("original_max_position_embeddings", max_positions)
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context_len / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context_len / high_freq_factor) & (wavelen <= old_context_len / low_freq_factor)
    return np.where(is_medium, smoothed, scaled)


def _moe_fields(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The MoE fields of ModelConfig; {} for a dense model. Qwen3-MoE writes `num_experts`,
    Mixtral (and transformers 5 for both) `num_local_experts`; Mixtral's experts are
    `intermediate_size` wide and always renormalise."""
    num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if not num_experts:
        return {}
    top_k = hf["num_experts_per_tok"]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be between 1 and the number of experts ({num_experts}), got {top_k}")
    sparse_step = hf.get("decoder_sparse_step", 1)
    if sparse_step < 1:
        raise ValueError(f"decoder_sparse_step must be at least 1, got {sparse_step}")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
        norm_topk_prob=architecture in _ALWAYS_RENORMALIZE_TOPK or bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=sparse_step,
        mlp_only_layers=list(hf.get("mlp_only_layers") or []),
    )


def _hybrid_fields(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Qwen3-Next's fields of ModelConfig (layer types as transformers derives them when the
    config lists none: every `full_attention_interval`-th layer is full attention); {} otherwise."""
    if architecture not in _HYBRID:
        return {}
    num_layers = hf["num_hidden_layers"]
    layer_types = list(hf.get("layer_types") or [])
    if not layer_types:
        interval = hf.get("full_attention_interval", 4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or set(layer_types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types must give 'linear_attention' or 'full_attention' for each of the "
                         f"{num_layers} layers, got {layer_types}")
    key_heads, value_heads = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    if value_heads % key_heads:
        raise ValueError(f"linear_num_value_heads ({value_heads}) must be a multiple of linear_num_key_heads "
                         f"({key_heads})")
    return dict(
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
        layer_types=layer_types,
        zero_centered_norms=True,
        attention_output_gate=True,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=hf["linear_key_head_dim"],
        linear_value_head_dim=hf["linear_value_head_dim"],
        linear_conv_kernel_dim=hf["linear_conv_kernel_dim"],
    )


def _reject_unsupported_features(hf: dict[str, Any]) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; only 'silu' is")
    layer_types = hf.get("layer_types") or []
    sliding = hf.get("use_sliding_window", False) and (hf.get("max_window_layers") or 0) < hf["num_hidden_layers"]
    # Mistral-style configs (Mixtral) have no switch: a set `sliding_window` is used.
    sliding = sliding or ("use_sliding_window" not in hf and hf.get("sliding_window") is not None)
    if sliding or "sliding_attention" in layer_types:
        raise ValueError("sliding-window attention (use_sliding_window, sliding_window or layer_types) is not supported")


def _merge_ids(*values: int | list[int] | None) -> list[int]:
    """Union of token ids given as int, list or None, first-seen order."""
    merged: list[int] = []
    for value in values:
        for token_id in [value] if isinstance(value, int) else value or []:
            if token_id not in merged:
                merged.append(token_id)
    return merged
