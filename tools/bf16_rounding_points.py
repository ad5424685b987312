"""Which of sparkd's bf16 rounding points flip a tiny Mixtral's top-1, on the CPU.

  python tools/bf16_rounding_points.py

The GPU test `test_bf16_teacher_forced_top1_agrees_with_fp32` (tests/gpu/test_engine_cuda.py)
asks sparkd in bf16 to pick the fp32 reference's top-1 at >= 99% of 16 x 159 teacher-forced
positions of a tiny random Mixtral. This tool emulates sparkd's bf16 forward in torch fp32,
rounding to bf16 where sparkd's kernels store bf16, and counts the flipped positions with
every rounding point on, then with each one off. Rounding points:

  qkv_input      input_layernorm's output, the qkv GEMM's input
  expert_input   post_attention_layernorm's output, the experts' input
  qkv            the q, k and v the GEMM stores (k and v as the bf16 KV cache holds them)
  rope           q and k after the rotation
  p              the softmax numerators that meet V on the tensor cores
  attn_out       attention's output rows
  o_proj         o_proj's output (added to the fp32 residual)
  expert_hidden  silu(gate) * up, the down GEMM's input
  expert_out     each expert's output row
  combine        the weighted sum of a token's expert rows
  final_norm     the last norm's output, lm_head's input

The router's logits are computed from the unrounded rows, as sparkd's [y | y_lo] router does;
the residual stream stays fp32. With every rounding off the emulation matches transformers'
fp32 logits to ~1e-6 (printed first).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import oracle  # noqa: E402

POINTS = ("qkv_input", "expert_input", "qkv", "rope", "p", "attn_out", "o_proj", "expert_hidden", "expert_out", "combine",
          "final_norm")
NUM_SEQS, SEQ_LEN, SEED = 16, 160, 11  # the GPU test's teacher-forced sequences


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


class MixtralEmulation:
    """A Mixtral forward over one whole sequence [T] in fp32, rounding to bf16 at the given points."""

    def __init__(self, model):
        self.config = model.config
        self.weights = {name: tensor.float() for name, tensor in model.state_dict().items()}

    def rms(self, x: torch.Tensor, weight: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps) * self.weights[weight]

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Neox rotation of x [T, heads, D]."""
        d = x.shape[-1]
        theta = self.config.rope_parameters["rope_theta"]
        inverse_frequencies = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # as transformers
        angles = positions[:, None].float() * inverse_frequencies
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    def attention(self, h: torch.Tensor, prefix: str, round_at) -> torch.Tensor:
        """Causal GQA attention of h [T, H]: [T, Hq * D], o_proj's input."""
        c, w, t = self.config, self.weights, h.shape[0]
        heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q, k, v = (round_at("qkv", h @ w[f"{prefix}self_attn.{name}_proj.weight"].T).view(t, n, d)
                   for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)))
        positions = torch.arange(t)
        q, k = round_at("rope", self.rope(q, positions)), round_at("rope", self.rope(k, positions))
        k, v = (x.repeat_interleave(heads // kv_heads, 1) for x in (k, v))
        scores = torch.einsum("thd,shd->hts", q, k) / d ** 0.5 + torch.triu(torch.full((t, t), float("-inf")), 1)
        numerators = torch.exp(scores - scores.amax(-1, keepdim=True))
        out = torch.einsum("hts,shd->htd", round_at("p", numerators), v) / numerators.sum(-1, keepdim=True)
        return round_at("attn_out", out.transpose(0, 1).reshape(t, heads * d))

    def experts(self, h_exact: torch.Tensor, prefix: str, round_at) -> torch.Tensor:
        """The top-k experts of each row of h [T, H], routed on the unrounded rows."""
        c, w = self.config, self.weights
        h = round_at("expert_input", h_exact)
        probs = torch.softmax(h_exact @ w[f"{prefix}mlp.gate.weight"].T, -1)
        weights, ids = probs.topk(c.num_experts_per_tok, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        gate_up, down = w[f"{prefix}mlp.experts.gate_up_proj"], w[f"{prefix}mlp.experts.down_proj"]
        inter = gate_up.shape[1] // 2
        out = torch.zeros_like(h)
        for j in range(c.num_experts_per_tok):
            for expert in ids[:, j].unique().tolist():
                rows = ids[:, j] == expert
                gate, up = (h[rows] @ gate_up[expert, half * inter:(half + 1) * inter].T for half in (0, 1))
                hidden = round_at("expert_hidden", torch.nn.functional.silu(gate) * up)
                out[rows] += weights[rows, j:j + 1] * round_at("expert_out", hidden @ down[expert].T)
        return round_at("combine", out)

    def logits(self, tokens: torch.Tensor, points: set[str]) -> torch.Tensor:
        """[T, V] fp32 logits of tokens [T] with bf16 rounding at `points`."""
        def round_at(point: str, x: torch.Tensor) -> torch.Tensor:
            return bf16(x) if point in points else x

        residual = self.weights["model.embed_tokens.weight"][tokens]
        for layer in range(self.config.num_hidden_layers):
            prefix = f"model.layers.{layer}."
            h = round_at("qkv_input", self.rms(residual, f"{prefix}input_layernorm.weight"))
            residual = residual + round_at("o_proj", self.attention(h, prefix, round_at)
                                           @ self.weights[f"{prefix}self_attn.o_proj.weight"].T)
            residual = residual + self.experts(self.rms(residual, f"{prefix}post_attention_layernorm.weight"), prefix,
                                               round_at)
        return round_at("final_norm", self.rms(residual, "model.norm.weight")) @ self.weights["lm_head.weight"].T


def main() -> int:
    import tempfile

    import transformers

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as directory:
        # The GPU test's checkpoint: TINY_CONFIG with its Mixtral overrides, saved in bf16.
        path, model = oracle.make_tiny_checkpoint(directory, "MixtralForCausalLM", dtype=torch.bfloat16, head_dim=64,
                                                  num_local_experts=8, num_experts_per_tok=2)
        fp32_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    emulation = MixtralEmulation(model)
    sequences = [torch.tensor(s) for s in np.random.default_rng(SEED).integers(3, model.config.vocab_size,
                                                                              (NUM_SEQS, SEQ_LEN))]
    with torch.no_grad():
        check = (fp32_model(sequences[0][None]).logits[0] - emulation.logits(sequences[0], set())).abs().max()
        print(f"# emulation with no rounding against transformers fp32: max |difference| {check.item():.2e}")
        reference = [emulation.logits(s, set())[:-1].argmax(-1) for s in sequences]

        def flips(points: set[str]) -> int:
            return sum(int((emulation.logits(s, points)[:-1].argmax(-1) != r).sum()) for s, r in zip(sequences, reference))

        positions = NUM_SEQS * (SEQ_LEN - 1)
        every = set(POINTS)
        cases = [("all of sparkd's", every), *((f"all but {point}", every - {point}) for point in POINTS),
                 ("all but both norms' outputs", every - {"qkv_input", "expert_input"})]
        print("| bf16 rounding at | flipped positions | top-1 agreement |\n| --- | --- | --- |")
        for label, points in cases:
            count = flips(points)
            print(f"| {label} | {count} of {positions} | {1 - count / positions:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
