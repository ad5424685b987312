"""Qwen3-Next-80B-A3B-shaped bf16 hybrid decode and prefill through the engine, and one gated
delta net layer's 8k-token prefill, against the rooflines and transformers (issue 6).

  python tools/bench_hybrid.py [--layers 12] [--steps 32] [--no-transformers]

The layer count is cut to fit one GPU beside transformers' copy, keeping the 3:1 pattern
(three gated delta nets, then gated attention). Random weights are made on the device
(norms at their identity: zero-centred weights 0, i.e. stored as 1 + 0). The engine rows are
bench_decode.py's: decode served, sequential and forward-only, and the prefill; a decode step
must read every weight but the embedding table and the experts no token chose (10 of 512 a
layer at batch 1, in expectation under uniform routing at larger batches), the KV of the
attention layers, and read and write each sequence's linear-attention state. The layer row:
one delta net's forward on 8192 tokens (its projections, conv, gates, delta rule and gated
norm), its FLOPs (the projections and the chunked form's products) over the bf16 GEMM rate.
The peer: transformers with its own torch delta rule (flash-linear-attention is not there), the
default cache, eager, batch 1.

Beside the layer row, the delta rule alone in each form on the same 8192 tokens, as a share of
the layer's time.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import RandomDeviceWeights, best_seconds, verdict  # noqa: E402
from bench_decode import Model, measure_ceilings, parse_bench_args, print_engine_measures  # noqa: E402
from bench_peer import print_peer, transformers_decode  # noqa: E402

from sparkd.backend.base import AttentionMetadata  # noqa: E402
from sparkd.backend.cuda.ops import CudaOps  # noqa: E402
from sparkd.backend.dtypes import DType  # noqa: E402
from sparkd.engine.args import EngineArgs  # noqa: E402
from sparkd.engine.llm_engine import LLMEngine, LoadedModel  # noqa: E402
from sparkd.models.config import ModelConfig  # noqa: E402
from sparkd.models.qwen3_next import Qwen3NextForCausalLM  # noqa: E402

QWEN3_NEXT_80B_A3B = {
    "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "full_attention_interval": 4, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                              "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
}
PROMPT_LEN = 128
BATCH, CONTEXT = 64, 1024
PREFILL_LEN = 8192
PEER_TOKENS = 32
# The targets.
BATCH1_ROOFLINE, LAYER_PREFILL_GEMM = 0.60, 0.25


@dataclass
class HybridModel(Model):
    expert_bytes: int  # one expert's gate_up and down, one layer
    state_slot_bytes: int  # one sequence's linear-attention state, every layer

    def step_weight_bytes(self, batch: int) -> float:
        """The dense part, the experts `batch` uniformly routed tokens choose in expectation, and
        each sequence's state read and written."""
        c = self.config
        experts = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** batch)
        return self.decode_weight_bytes + c.num_layers * experts * self.expert_bytes + 2 * batch * self.state_slot_bytes

    def kv_bytes(self, num_tokens: float) -> float:
        c = self.config
        return 2 * len(c.attention_layers) * c.num_kv_heads * c.head_dim * self.engine.ops.dtype.itemsize * num_tokens


def hybrid_device_weights(config: ModelConfig, make: RandomDeviceWeights) -> dict:
    """Every weight Qwen3NextForCausalLM takes, in the layout `prepare_weights` leaves (the gate
    rows after q/k/v, one delta-net in_proj, the conv as [C, W], zero-centred norms as 1 + 0) and
    the registry stacks (a shared expert of a routed expert's shape as expert E)."""
    c, matrix, filled = config, make.matrix, make.filled
    h = c.hidden_size
    e, i, s = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    slots = e + c.folds_shared_expert
    weights = {"model.embed_tokens.weight": matrix((c.vocab_size, h), 1), "model.norm.weight": filled(h, 1),
               "lm_head.weight": matrix((c.vocab_size, h), h)}
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        weights |= {p + "input_layernorm.weight": filled(h, 1), p + "post_attention_layernorm.weight": filled(h, 1),
                    p + "mlp.gate.weight": matrix((e, h), h),
                    p + "mlp.experts.gate_up_proj": matrix((slots, 2 * i, h), h),
                    p + "mlp.experts.down_proj": matrix((slots, h, i), i),
                    p + "mlp.shared_expert_gate.weight": matrix((1, h), h)}
        if not c.folds_shared_expert:
            weights |= {p + "mlp.shared_expert.gate_up_proj.weight": matrix((2 * s, h), h),
                        p + "mlp.shared_expert.down_proj.weight": matrix((h, s), s)}
        if c.is_linear_attention_layer(layer):
            weights |= delta_net_weights(c, make, p + "linear_attn.")
        else:
            q_width = c.num_heads * c.head_dim
            weights |= {p + "self_attn.qkv_proj.weight": matrix((2 * q_width + 2 * c.num_kv_heads * c.head_dim, h), h),
                        p + "self_attn.o_proj.weight": matrix((h, q_width), q_width),
                        p + "self_attn.q_norm.weight": filled(c.head_dim, 1),
                        p + "self_attn.k_norm.weight": filled(c.head_dim, 1)}
    return weights


def delta_net_weights(config: ModelConfig, make: RandomDeviceWeights, prefix: str) -> dict:
    """One GatedDeltaNet's weights under `prefix`: A_log and dt_bias 0 (decay exp(-softplus(a)))."""
    shape, h, width = config.delta_net_shape, config.hidden_size, config.linear_conv_kernel_dim
    value_width = shape.num_v_heads * shape.v_dim
    return {prefix + "in_proj.weight": make.matrix((shape.conv_dim + value_width + 2 * shape.num_v_heads, h), h),
            prefix + "conv1d.weight": make.matrix((shape.conv_dim, width), width),
            prefix + "A_log": make.filled(shape.num_v_heads, 0.0), prefix + "dt_bias": make.filled(shape.num_v_heads, 0.0),
            prefix + "norm.weight": make.filled(shape.v_dim, 1),
            prefix + "out_proj.weight": make.matrix((h, value_width), value_width)}


def build_model(ops: CudaOps, num_layers: int, steps: int, gpu_memory_utilization: float) -> HybridModel:
    config = ModelConfig.from_hf({**QWEN3_NEXT_80B_A3B, "num_hidden_layers": num_layers})
    make = RandomDeviceWeights(ops.allocator, ops.stream, ops.dtype)
    weights = hybrid_device_weights(config, make)
    folded = config.folds_shared_expert  # the shared expert, which every step reads, stacked as expert E
    experts = sum(t.nbytes for n, t in weights.items() if ".experts." in n)
    expert_bytes = experts // (num_layers * (config.num_experts + folded))
    dense_bytes = sum(t.nbytes for n, t in weights.items() if ".experts." not in n) + folded * num_layers * expert_bytes
    dense_bytes -= weights["model.embed_tokens.weight"].nbytes  # decode reads one row of it per sequence
    dense_bytes += sum(t.nbytes for n, t in weights.items() if n.endswith(".gate.weight"))  # routers: [W | W]
    model = Qwen3NextForCausalLM(config, ops, weights)
    args = EngineArgs(device="cuda", dtype="bfloat16", max_model_len=max(CONTEXT + 2 * steps + 64, PREFILL_LEN) + 16,
                      max_num_seqs=BATCH, max_num_batched_tokens=PREFILL_LEN, enable_prefix_caching=False,
                      gpu_memory_utilization=gpu_memory_utilization)
    loaded = LoadedModel(ops, model, None, "qwen3-next-80b-a3b-shaped", "random bf16 weights made on the device")
    engine = LLMEngine(args, loaded)
    return HybridModel(engine, config, dense_bytes, expert_bytes, engine._state_slot_bytes())


def delta_net_layer_flops(config: ModelConfig, tokens: int, chunk: int = 64) -> float:
    """One gated delta net layer on `tokens` tokens: in_proj, out_proj, the conv, and the chunked
    delta rule's products (per chunk and value head: (beta k) k^T and q k^T, the two triangular
    solves, w S, q S, the intra-chunk product and the state update)."""
    c, shape = config, config.delta_net_shape
    h, dk, dv, hv = c.hidden_size, shape.k_dim, shape.v_dim, shape.num_v_heads
    projections = 2 * tokens * h * (shape.conv_dim + 2 * hv * dv + 2 * hv)  # in_proj, out_proj
    conv = 2 * tokens * shape.conv_dim * c.linear_conv_kernel_dim
    per_chunk = 2 * chunk * chunk * dk * 2 + chunk * chunk * (dv + dk) + 2 * chunk * dk * dv * 3 + 2 * chunk * chunk * dv
    return projections + conv + hv * -(-tokens // chunk) * per_chunk


def one_sequence_step(ops: CudaOps, tokens: int, cached: int = 0, block_size: int = 16):
    """The metadata of a step that computes `tokens` tokens of one sequence with `cached` tokens
    before them, state slot 0 (its block table zeros: only the delta nets read this step)."""
    blocks = -(-(cached + tokens) // block_size)
    meta = AttentionMetadata(query_start_loc=np.array([0, tokens], np.int32),
                             seq_lens=np.array([cached + tokens], np.int32), block_tables=np.zeros((1, blocks), np.int32),
                             slot_mapping=np.full(tokens, -1, np.int32), max_query_len=tokens,
                             max_seq_len=cached + tokens, state_slots=np.zeros(1, np.int32))
    return ops.prepare_attention(meta)


# The first forwards of the first delta net layer a process builds run slower: on the H200 the
# first 4 of a fresh process took 2.79 ms, every later one (that layer or fresh ones) 2.64
# (docs/benchmarks.md, session 12). A row is the layer's steady state, as a serving process runs
# it, so the timed runs follow a tenth of a second of warm-up.
_LAYER_WARMUP_SECONDS = 0.1


def delta_net_layer_seconds(ops: CudaOps, config: ModelConfig, tokens: int) -> float:
    """The best of 3 forwards of a fresh delta net layer (its own weights and one state slot) on
    `tokens` tokens of one sequence, after _LAYER_WARMUP_SECONDS of warm-up."""
    from sparkd.models.qwen3_next import GatedDeltaNet

    make = RandomDeviceWeights(ops.allocator, ops.stream, ops.dtype, seed=1)
    layer = GatedDeltaNet(config, ops, delta_net_weights(config, make, "linear_attn."), "linear_attn.")
    shape = config.delta_net_shape
    state = ops.allocate_linear_attention_state(1, 1, shape.conv_dim, config.linear_conv_kernel_dim, shape.num_v_heads,
                                                shape.k_dim, shape.v_dim)[0]
    attn = one_sequence_step(ops, tokens)
    x = make.matrix((tokens, config.hidden_size), 1)
    norm = make.filled(config.hidden_size, 1)
    return best_seconds(ops.stream, lambda: layer.forward(None, x, None, norm, attn, state), reps=3,
                        warmup_seconds=_LAYER_WARMUP_SECONDS)


def delta_rule_seconds(ops: CudaOps, config: ModelConfig, tokens: int, form: str) -> float:
    """The best of 3 runs of the delta rule alone in `form` on one fresh `tokens`-token sequence
    (random q, k, v; decay exp(-0.05) and write 0.5 a token), warmed as the layer is."""
    from sparkd.backend.cuda.kernels import delta_net

    shape = config.delta_net_shape
    make = RandomDeviceWeights(ops.allocator, ops.stream, ops.dtype, seed=2)
    mixed = make.matrix((tokens, shape.conv_dim), 1)
    g, beta = (make.upload(np.full((tokens, shape.num_v_heads), value, np.float32), DType.float32)
               for value in (-0.05, 0.5))
    state = ops.zeros((1, shape.num_v_heads, shape.k_dim, shape.v_dim), DType.float32)
    out = ops.allocator.empty((tokens, shape.num_v_heads * shape.v_dim), ops.dtype)
    workspace = ops.allocator.empty((delta_net.chunk_workspace_floats(tokens, shape),), DType.float32)
    attn = one_sequence_step(ops, tokens)
    return best_seconds(ops.stream, lambda: delta_net.gated_delta_rule(out, mixed, g, beta, state, attn, shape,
                                                                       ops.stream, form, workspace), reps=3,
                        warmup_seconds=_LAYER_WARMUP_SECONDS)


def main(argv: list[str] | None = None) -> int:
    args = parse_bench_args(__doc__, layers=12, steps=32, argv=argv)
    ops, copy_rate, gemm_flops = measure_ceilings(f"Qwen3-Next-80B-A3B shape with {args.layers} layers",
                                                  args.fused_norms)
    config = ModelConfig.from_hf({**QWEN3_NEXT_80B_A3B, "num_hidden_layers": args.layers})
    seconds = delta_net_layer_seconds(ops, config, PREFILL_LEN)
    rate = delta_net_layer_flops(config, PREFILL_LEN) / seconds
    print(f"\n| one gated delta net layer, {PREFILL_LEN}-token prefill | {seconds * 1e3:.2f} ms, {rate / 1e12:.1f} "
          f"TFLOP/s | {gemm_flops / 1e12:.0f} TFLOP/s | {rate / gemm_flops:.3f} | "
          f"{verdict(rate / gemm_flops, LAYER_PREFILL_GEMM)} |", flush=True)
    for form in ("chunked", "recurrent"):
        rule = delta_rule_seconds(ops, config, PREFILL_LEN, form)
        print(f"| its delta rule alone, {form} form | {rule * 1e3:.2f} ms, {100 * rule / seconds:.0f}% of the "
              f"layer | | | |", flush=True)
    model = build_model(ops, args.layers, args.steps, args.gpu_memory_utilization)
    cases = ((1, PROMPT_LEN, BATCH1_ROOFLINE), (BATCH, CONTEXT, None))
    served = print_engine_measures(model, cases, (PREFILL_LEN, None, 3), args.steps, copy_rate, gemm_flops,
                                   np.random.default_rng(0))
    peer = None if args.no_transformers else transformers_decode(QWEN3_NEXT_80B_A3B, "qwen3_next", args.layers,
                                                                 PROMPT_LEN, PEER_TOKENS, compile=False,
                                                                 cache_implementation=None)
    print_peer(peer, "default cache, eager, torch delta rule", PROMPT_LEN, PEER_TOKENS, served[0], None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
