"""Qwen3-30B-A3B-shaped bf16 mixture-of-experts decode and prefill, against the rooflines.

  python tools/bench_moe.py [--layers 48] [--steps 32]

Random weights made on the device (tools/bench_decode.py's way), the same three decode
measures (served through AsyncEngine, sequential `LLMEngine.step`, forward alone) and
one prefill step. Ceilings, measured in the same run:
- a decode step must read the attention, router and norm weights of every layer, the
  lm_head, the KV cache, and the experts its tokens chose. With random weights the
  routing is close to uniform, so a step of B tokens reads E * (1 - (1 - k/E)^B)
  experts a layer in expectation (k at batch 1, nearly all E at batch 64); all at
  the device-to-device copy rate;
- a prefill's active FLOPs (2 per weight it uses per token: attention, router, k
  experts; 4 * Hq * D per causal (query, key) pair) run at most at the rate of a bf16
  8192^3 GEMM.
The peer: transformers' generate (static cache, eager: compiling its expert loop takes
minutes), batch 1, in the same process. sparkd takes 50% of the GPU by default so the
peer's copy of the weights fits beside it at 48 layers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode import (Model, measure_ceilings, parse_bench_args, print_engine_measures,  # noqa: E402
                          random_device_weights)
from bench_peer import print_peer, transformers_decode  # noqa: E402

from sparkd.backend.cuda.ops import CudaOps  # noqa: E402
from sparkd.engine.args import EngineArgs  # noqa: E402
from sparkd.engine.llm_engine import LLMEngine, LoadedModel  # noqa: E402
from sparkd.models.config import ModelConfig  # noqa: E402
from sparkd.models.moe import MoeForCausalLM  # noqa: E402

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
}
PROMPT_LEN = 128
BATCH, CONTEXT = 64, 1024
PREFILL_LEN = 4096
PEER_TOKENS = 32  # transformers' eager expert loop is slow: a short generate
# The targets.
BATCH1_ROOFLINE, BATCH64_ROOFLINE, PREFILL_GEMM = 0.65, 0.50, 0.40


@dataclass
class MoeModel(Model):
    expert_bytes: int  # one expert's gate_up and down, one layer

    def step_weight_bytes(self, batch: int) -> float:
        """The dense part, plus the experts `batch` uniformly routed tokens choose in expectation."""
        c = self.config
        experts = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** batch)
        return self.decode_weight_bytes + c.num_layers * experts * self.expert_bytes

    def prefill_flops(self, length: int) -> float:
        """Active FLOPs: attention projections, router and k experts per token, causal attention, one lm_head row."""
        c = self.config
        per_token = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size \
            + c.num_heads * c.head_dim * c.hidden_size + c.num_experts * c.hidden_size \
            + c.num_experts_per_tok * 3 * c.moe_intermediate_size * c.hidden_size
        attention_pairs = length * (length + 1) / 2
        return (2 * per_token * length + 4 * c.num_heads * c.head_dim * attention_pairs) * c.num_layers \
            + 2 * c.vocab_size * c.hidden_size


def build_model(ops: CudaOps, num_layers: int, steps: int, gpu_memory_utilization: float) -> MoeModel:
    config = ModelConfig.from_hf({**QWEN3_30B_A3B, "num_hidden_layers": num_layers})
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size

    def experts(prefix: str, matrix) -> dict:
        return {prefix + "gate.weight": matrix((e, h), h), prefix + "experts.gate_up_proj": matrix((e, 2 * i, h), h),
                prefix + "experts.down_proj": matrix((e, h, i), i)}

    weights = random_device_weights(config, ops, mlp_weights=experts)
    expert_weights = [t for name, t in weights.items() if ".experts." in name]
    dense_bytes = sum(t.nbytes for name, t in weights.items() if ".experts." not in name)
    dense_bytes -= weights["model.embed_tokens.weight"].nbytes  # decode reads one row of it per sequence
    dense_bytes += sum(t.nbytes for name, t in weights.items() if name.endswith(".gate.weight"))  # routers: [W | W] (CudaOps.router_weight)
    expert_bytes = sum(t.nbytes for t in expert_weights) // (num_layers * e)
    model = MoeForCausalLM(config, ops, weights)
    # run_decode's requests ask for 2 * steps + 64 tokens; the prefill prompt is PREFILL_LEN.
    max_model_len = max(CONTEXT + 2 * steps + 64, PREFILL_LEN) + 16
    args = EngineArgs(device="cuda", dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=BATCH,
                      max_num_batched_tokens=PREFILL_LEN, enable_prefix_caching=False,
                      gpu_memory_utilization=gpu_memory_utilization)
    loaded = LoadedModel(ops, model, None, "qwen3-30b-a3b-shaped", "random bf16 weights made on the device")
    return MoeModel(LLMEngine(args, loaded), config, dense_bytes, expert_bytes)


def main(argv: list[str] | None = None) -> int:
    args = parse_bench_args(__doc__, layers=48, steps=32, argv=argv)
    ops, copy_rate, gemm_flops = measure_ceilings(f"Qwen3-30B-A3B shape with {args.layers} layers",
                                                  args.fused_norms)
    model = build_model(ops, args.layers, args.steps, args.gpu_memory_utilization)
    rng = np.random.default_rng(0)
    cases = ((1, PROMPT_LEN, BATCH1_ROOFLINE), (BATCH, CONTEXT, BATCH64_ROOFLINE))
    served = print_engine_measures(model, cases, (PREFILL_LEN, PREFILL_GEMM, 5), args.steps, copy_rate, gemm_flops,
                                   rng)
    # Eager: compiling transformers' expert loop for a static cache takes minutes.
    peer = None if args.no_transformers else transformers_decode(QWEN3_30B_A3B, "qwen3_moe", args.layers, PROMPT_LEN,
                                                                 PEER_TOKENS, compile=False)
    print_peer(peer, "static cache, eager", PROMPT_LEN, PEER_TOKENS, served[0], None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
