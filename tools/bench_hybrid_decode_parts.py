"""One Qwen3-Next-80B-A3B-shaped layer's batch-1 decode, part by part, against the copy rate
(issue 6): where a hybrid decode step spends the time its bytes do not explain.

  python tools/bench_hybrid_decode_parts.py

A gated delta net layer (its mixer, then its MoE block) on one token of a sequence with 128
cached tokens, in state slot 0, bf16 random weights made on the device. Each part is timed as
a CUDA graph of ITERS back-to-back calls (device time, as a decode graph replays it: no host
launch cost). Its floor is the bytes it must move at the measured copy rate: the weights it
reads (10 of the 512 experts), the recurrent state and conv window read and written. The
launches a part makes bound it from below too (GPU-FACTS.md: ~2 us each in a graph), which is
what the "launches" column counts.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import RandomDeviceWeights, copy_bandwidth, timed_graph  # noqa: E402
from bench_hybrid import QWEN3_NEXT_80B_A3B, hybrid_device_weights, one_sequence_step  # noqa: E402

from sparkd.backend.cuda.kernels import moe_router, moe_routing  # noqa: E402
from sparkd.backend.cuda.ops import CudaOps  # noqa: E402
from sparkd.backend.dtypes import DType  # noqa: E402
from sparkd.models.config import ModelConfig  # noqa: E402
from sparkd.models.qwen3_next import Qwen3NextForCausalLM  # noqa: E402

ITERS = 50
CACHED = 128


def main() -> int:
    ops = CudaOps(dtype="bfloat16")
    copy_rate = copy_bandwidth(ops.allocator, ops.stream)
    config = ModelConfig.from_hf({**QWEN3_NEXT_80B_A3B, "num_hidden_layers": 1})  # layer 0: a delta net
    make = RandomDeviceWeights(ops.allocator, ops.stream, ops.dtype)
    weights = hybrid_device_weights(config, make)
    folded = config.folds_shared_expert  # the shared expert stacked as expert E, its gate the router's row E
    expert_bytes = sum(t.nbytes for n, t in weights.items() if ".experts." in n) // (config.num_experts + folded)
    shared_bytes = sum(t.nbytes for n, t in weights.items() if "shared_expert" in n) + folded * expert_bytes
    routed_pairs = config.num_experts_per_tok + folded  # the pairs a token's experts run
    mixer_bytes = sum(t.nbytes for n, t in weights.items() if ".linear_attn." in n)
    layer = Qwen3NextForCausalLM(config, ops, weights).layers[0]
    mixer, moe, shape = layer.self_attn, layer.mlp, config.delta_net_shape
    router_bytes = moe.router.nbytes  # as the backend holds it (CUDA: [W | W], see Ops.router_weight)
    conv_state, state = ops.allocate_linear_attention_state(1, 1, shape.conv_dim, config.linear_conv_kernel_dim,
                                                            shape.num_v_heads, shape.k_dim, shape.v_dim)[0]
    state_bytes = 2 * (conv_state.nbytes + state.nbytes)  # read and written
    attn = one_sequence_step(ops, 1, cached=CACHED)
    h, hv, dv = config.hidden_size, shape.num_v_heads, shape.v_dim
    x, residual = make.matrix((1, h), 1), make.matrix((1, h), 1)
    projected = make.matrix((1, shape.conv_dim + hv * dv + 2 * hv), 1)
    mixed, z, b, a = ops.split_columns(projected, [shape.conv_dim, hv * dv, hv, hv])
    g, beta = ops.delta_net_gates(a, b, mixer.a_log, mixer.dt_bias)
    core = make.matrix((1, hv * dv), 1)
    y, router_input, _ = ops.add_rmsnorm_for_router(x, residual, layer.post_attention_layernorm, config.rms_norm_eps)
    routed_out = make.matrix((1, h), 1)  # what the shared expert's gated output is added to

    def shared_expert():
        gate_up, down, gate = moe.shared_expert
        shared = ops.linear(ops.linear_silu_and_mul(y, gate_up), down)
        return ops.mul_sigmoid(shared, ops.linear(y, gate), add_to=routed_out)

    def route():
        """moe_router's one launch, as sparse_moe makes it at one token: (weights, alignment)."""
        weights, expert_ids = ops._routing_outputs(1, config.num_experts, moe.top_k, folded)
        alignment = moe_routing.MoeAlignment.allocate(ops.allocator, routed_pairs, config.num_experts + folded)
        logits = ops.allocator.empty((1, config.num_experts + folded), DType.float32)
        moe_router.moe_router_route_align(weights, expert_ids, alignment, logits, router_input, moe.router,
                                          moe.renormalize, ops.stream, folded)
        return weights, alignment

    routed = route()
    parts = [  # (name, work, bytes it must move, launches)
        ("delta net mixer, norm to out_proj",
         lambda: mixer.forward(None, x, residual, layer.input_layernorm, attn, (conv_state, state)),
         mixer_bytes + state_bytes, None),
        ("  input norm + in_proj", lambda: ops.add_rmsnorm_linear(x, residual, layer.input_layernorm,
                                                                  config.rms_norm_eps, mixer.in_proj),
         mixer.in_proj.nbytes, None),
        ("  conv + SiLU", lambda: ops.causal_conv1d_silu(mixed, mixer.conv_weight, conv_state, attn),
         mixer.conv_weight.nbytes + 2 * conv_state.nbytes, 1),
        ("  gates", lambda: ops.delta_net_gates(a, b, mixer.a_log, mixer.dt_bias), 0, 1),
        ("  delta rule (recurrent)", lambda: ops.gated_delta_rule(mixed, g, beta, state, attn, shape),
         2 * state.nbytes, 1),
        ("  gated RMSNorm", lambda: ops.gated_rmsnorm(core, z, mixer.norm_weight, config.rms_norm_eps), 0, 1),
        ("  the three in one (gated_delta_net)",
         lambda: ops.gated_delta_net(mixed, a, b, mixer.a_log, mixer.dt_bias, z, mixer.norm_weight,
                                     config.rms_norm_eps, state, attn, shape), 2 * state.nbytes, 1),
        ("  out_proj", lambda: ops.linear(core, mixer.out_proj), mixer.out_proj.nbytes, 1),
        ("MoE block, norm to shared expert", lambda: moe.forward(x, residual, layer.post_attention_layernorm),
         router_bytes + config.num_experts_per_tok * expert_bytes + shared_bytes, None),
        ("  routed experts (sparse_moe, combined in the next norm)" + (", the shared one among them" if folded else ""),
         lambda: ops.sparse_moe(y, router_input, moe.router, moe.gate_up_proj, moe.down_proj, moe.top_k,
                                moe.renormalize, folded),
         router_bytes + routed_pairs * expert_bytes, None),
        ("    router, routing, alignment", route, router_bytes, 1),
        ("    experts: gate_up, down", lambda: ops._aligned_experts(y, moe.gate_up_proj, moe.down_proj, *routed),
         routed_pairs * expert_bytes, 2),
    ]
    if not folded:
        parts.append(("  shared expert, its gate, the add", shared_expert, shared_bytes, 4))
    print(f"# {ops.device.name}: copy {copy_rate / 1e12:.2f} TB/s; Qwen3-Next-80B-A3B delta-net layer, batch-1 decode, "
          f"{CACHED} cached tokens\n")
    print("| part | us | floor us | floor / time | launches |\n| --- | --- | --- | --- | --- |")
    for name, work, nbytes, launches in parts:
        seconds = timed_graph(ops.stream, work, ITERS)
        floor = nbytes / copy_rate
        print(f"| {name} | {seconds * 1e6:.1f} | {floor * 1e6:.1f} | {floor / seconds:.2f} | "
              f"{launches if launches is not None else '-'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
