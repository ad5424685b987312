"""The transformers oracle: tiny random HF models saved as checkpoints, and sparkd step inputs.

`make_tiny_checkpoint` builds a small random model of a supported architecture with
transformers (float32, eager attention), writes it with `save_pretrained`, and returns
the directory and the HF model for reference outputs. `step_inputs` flattens a batch of
sequences into one step's token ids, positions and AttentionMetadata, with block tables
that are deliberately non-contiguous so that paging bugs show.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import tokenizers
import torch
import transformers

from sparkd.backend.base import AttentionMetadata
from sparkd.backend.dtypes import DType

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM",)
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
                "Qwen3NextForCausalLM": "qwen3_next"}

TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def make_tiny_checkpoint(
    directory: str | Path,
    arch: str = "LlamaForCausalLM",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    generation_config: dict[str, Any] | None = None,
    **overrides: Any,
) -> tuple[Path, transformers.PreTrainedModel]:
    """Save a random `arch` model with TINY_CONFIG updated by `overrides` (HF config
    keys, e.g. num_key_value_heads=1, head_dim=32, attention_bias=True, rope_scaling={...})
    into `directory`, in `dtype`, sharded if `max_shard_size` is given.
    `generation_config` entries (e.g. eos_token_id=[2, 5]) go to generation_config.json.
    Returns (directory, the HF model in `dtype`, in eval mode)."""
    directory = Path(directory)
    config = transformers.AutoConfig.for_model(_MODEL_TYPES[arch], architectures=[arch], **{**TINY_CONFIG, **overrides})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # MoE: the plain loop over experts, not grouped_mm
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    _randomize(model, seed)
    model.to(dtype)
    for key, value in (generation_config or {}).items():
        setattr(model.generation_config, key, value)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **save_kwargs)
    return directory, model


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Replace HF's near-zero init (std 0.02, norms at 1) with weights that make every
    parameter matter: linears ~ N(0, 1/fan_in), biases ~ N(0, 0.1), norms ~ 1 + N(0, 0.1) (as scales:
    a zero-centred norm's w ~ N(0, 0.1))."""
    generator = torch.Generator().manual_seed(seed)

    def zero_centred(name: str) -> bool:
        """Qwen3-Next's RMSNorms hold w and apply 1 + w, all but the delta net's gated norm."""
        return model.config.model_type == "qwen3_next" and not name.endswith("linear_attn.norm.weight")

    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight") and zero_centred(name):
                param.copy_(0.1 * noise)  # applied as 1 + w
            elif name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)  # fused experts [E, N, K] have fan-in K too


def tiny_moe_overrides(arch: str, **overrides: Any) -> dict[str, Any]:
    """`make_tiny_checkpoint` overrides for a tiny MoE `arch`: 8 experts, 2 per token, and
    Qwen3-MoE experts narrower (48) than its dense MLP layers (TINY_CONFIG's 128), so a
    mix-up of the two shows; `overrides` win."""
    experts = dict(num_experts=8, moe_intermediate_size=48) if arch == "Qwen3MoeForCausalLM" else dict(num_local_experts=8)
    return {**experts, "num_experts_per_tok": 2, **overrides}


def tiny_hybrid_overrides(**overrides: Any) -> dict[str, Any]:
    """`make_tiny_checkpoint` overrides for a tiny Qwen3-Next: 4 layers in the 3:1 pattern (three
    gated delta nets, then gated attention), 2 key heads of 16 and 4 value heads of 24 in the
    delta nets (so that dk != dv and Hv != Hk show), partial rotary over a quarter of head_dim
    32, 8 experts of 48 with 2 per token and a shared expert of 40; `overrides` win."""
    return {"num_hidden_layers": 4, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 24, "linear_conv_kernel_dim": 4, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 40,
            "norm_topk_prob": True, **overrides}


def save_fused_experts_checkpoint(model: transformers.PreTrainedModel, directory: str | Path) -> Path:
    """Save `model` with its in-memory weight names (transformers 5 keeps each layer's
    experts fused: `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
    [E, H, I]), the layout `save_pretrained` converts back to one tensor per expert."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    safetensors.torch.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def hf_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> np.ndarray:
    """Reference logits of one prompt, [L, V] float32."""
    with torch.no_grad():
        out = model(torch.tensor([token_ids], dtype=torch.long))
    return out.logits[0].float().numpy()


def hf_state_dict(model: transformers.PreTrainedModel) -> dict[str, np.ndarray]:
    """The model's weights as float32 numpy arrays, by checkpoint name."""
    return {name: t.detach().float().numpy() for name, t in model.state_dict().items()}


@dataclass
class StepInputs:
    """One step's flattened inputs, host arrays.

    token_ids, positions: [T] int32; last_rows: [B] int32, the row in T of each
    sequence's last new token (where its next-token logits come from)."""

    token_ids: np.ndarray
    positions: np.ndarray
    meta: AttentionMetadata
    last_rows: np.ndarray


def num_kv_blocks(num_seqs: int, blocks_per_seq: int) -> int:
    """KV pool size `step_inputs` assumes: block 0 stays unused, so a stray read of a
    block table's padding (0) shows up."""
    return 1 + num_seqs * blocks_per_seq


def layer_caches(model, num_seqs: int, num_slots: int, block_size: int, blocks_per_seq: int,
                 state_dtype: DType = DType.float32) -> list:
    """Per layer of `model` (on its own ops): KV caches for `step_inputs`' block layout, or for
    a hybrid model's linear-attention layers a state pool of `num_slots` slots in state_dtype."""
    ops, c = model.ops, model.config
    shape = c.delta_net_shape
    kv = iter(ops.allocate_kv_cache(len(c.attention_layers), num_kv_blocks(num_seqs, blocks_per_seq), block_size,
                                    c.num_kv_heads, c.head_dim))
    states = iter(ops.allocate_linear_attention_state(len(c.linear_attention_layers), num_slots, shape.conv_dim,
                                                      c.linear_conv_kernel_dim, shape.num_v_heads, shape.k_dim,
                                                      shape.v_dim, state_dtype) if c.linear_attention_layers else [])
    return [next(states) if c.is_linear_attention_layer(i) else next(kv) for i in range(c.num_layers)]


def step_inputs(
    sequences: list[list[int]],
    num_cached: list[int] | None = None,
    *,
    block_size: int = 4,
    blocks_per_seq: int = 16,
) -> StepInputs:
    """Inputs of a step in which sequence b computes tokens num_cached[b]: of
    sequences[b], the first num_cached[b] of them being in the cache already
    (None: whole prompts on fresh caches).

    Sequence b owns blocks 1 + b * blocks_per_seq ... in reverse order, so its
    block table is never the identity and a step's layout does not depend on the
    other sequences in it (the same b can be continued by a later step)."""
    num_cached = num_cached or [0] * len(sequences)
    seq_lens = np.array([len(s) for s in sequences], dtype=np.int32)
    if any(n >= len(s) for n, s in zip(num_cached, sequences)) or seq_lens.max() > block_size * blocks_per_seq:
        raise ValueError("each sequence needs at least one new token and at most block_size * blocks_per_seq tokens")
    new_tokens = [s[n:] for s, n in zip(sequences, num_cached)]
    positions = np.concatenate([np.arange(n, len(s)) for s, n in zip(sequences, num_cached)]).astype(np.int32)
    seq_of_token = np.repeat(np.arange(len(sequences)), [len(t) for t in new_tokens])
    blocks_used = -(-seq_lens // block_size)
    block_tables = np.zeros((len(sequences), blocks_used.max()), dtype=np.int32)
    for b, used in enumerate(blocks_used):
        block_tables[b, :used] = 1 + b * blocks_per_seq + (blocks_per_seq - 1 - np.arange(used))
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    query_lens = np.array([len(t) for t in new_tokens], dtype=np.int32)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    meta = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping.astype(np.int32),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    return StepInputs(
        token_ids=np.concatenate(new_tokens).astype(np.int32),
        positions=positions,
        meta=meta,
        last_rows=(query_start_loc[1:] - 1).astype(np.int32),
    )


# Text the tiny tokenizer is trained on: English prose plus multi-byte scripts, so
# its merges include CJK and emoji byte sequences.
_TOKENIZER_CORPUS = [
    json.__doc__,
    argparse.__doc__,
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji: 😀🎉🚀 and accents: café, naïve, Zürich, Ελληνικά, русский.",
]
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def make_tiny_tokenizer(
    directory: str | Path, vocab_size: int = 360, chat_template: str | None = None, **special_tokens: str
) -> transformers.PreTrainedTokenizerFast:
    """Train a byte-level BPE (SPECIAL_TOKENS get ids 0, 1, 2) and `save_pretrained` it
    into `directory` with `chat_template` and named special tokens (default
    eos_token="<|im_end|>", pad_token="<|endoftext|>"). Returns the HF tokenizer."""
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_TOKENIZER_CORPUS, trainer)
    special_tokens = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", **special_tokens}
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=chat_template, **special_tokens)
    tokenizer.save_pretrained(directory)
    return tokenizer


def make_prompts(rng: np.random.Generator, vocab: int) -> list[list[int]]:
    """Prompts of the end-to-end generation tests (CPU and GPU): one token, one block,
    two sharing a 37-token prefix (a prefix-cache hit), one longer than a 64-token budget."""
    shared = rng.integers(3, vocab, 37).tolist()
    return [
        rng.integers(3, vocab, 1).tolist(),
        rng.integers(3, vocab, 16).tolist(),  # exactly one block
        shared + rng.integers(3, vocab, 5).tolist(),
        shared + rng.integers(3, vocab, 9).tolist(),
        rng.integers(3, vocab, 150).tolist(),  # longer than the token budget: chunked
    ]
