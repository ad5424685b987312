"""The decode-path expert GEMMs (moe_gemm: gate_up, down) and the whole `moe_experts` op
at Qwen3-30B-A3B (or Mixtral, or Qwen3-Next-80B-A3B) shapes: time per call and the bandwidth of the chosen
experts' weights as a fraction of the device-to-device copy rate measured in the same run.

  python tools/bench_moe_kernels.py [--model qwen3|mixtral|qwen3-next] [--tokens 1 4 16 64] [--iters 48]

T tokens each choose k distinct experts uniformly at random. Bytes count the weights
of the experts actually chosen (gate_up: 2I x H, down: H x I each), read once, so 1.0
is the ceiling; activations and outputs are not counted. The op adds the alignment and
the combine launches (at 16+ rows per expert on average in bf16 it runs the grouped
GEMM instead). Each timed graph cycles over --copies sets of expert weights, each with
its own routing, so a call finds none of its weights in L2 from the call before.
The timed launches are replayed from one CUDA graph, so Python launch overhead is not
counted.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import DeviceBench, bench_parser, copy_bandwidth, timed_graph

from sparkd.backend.cuda.kernels import moe_gemm, moe_routing
from sparkd.backend.cuda.ops import CudaOps
from sparkd.backend.cuda.tensor import DeviceTensor
from sparkd.backend.dtypes import DType

# (E, k, H, I)
MODELS = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336), "qwen3-next": (512, 10, 2048, 512)}


@dataclass
class Layer:
    """One set of expert weights and one routing of the batch over them, with the buffers
    the kernels write."""

    gate_up: DeviceTensor  # [E, 2I, H]
    down: DeviceTensor  # [E, H, I]
    expert_ids: DeviceTensor  # [T, k] int32
    weights: DeviceTensor  # [T, k] float32
    alignment: moe_routing.MoeAlignment
    hidden: DeviceTensor  # [P, I]
    expert_out: DeviceTensor  # [P, H] in the bench's dtype
    num_active: int  # experts the routing chose


class Bench(DeviceBench):
    def __init__(self, dtype: DType, iters: int, model: str, copies: int):
        super().__init__(dtype, iters)
        self.copy_rate = copy_bandwidth(self.allocator, self.stream)
        self.ops = CudaOps(dtype.name)
        self.rng = np.random.default_rng(0)
        self.num_experts, self.top_k, self.hidden_size, self.inter_size = MODELS[model]
        self.weight_sets = [(self.ones((self.num_experts, 2 * self.inter_size, self.hidden_size)),
                             self.ones((self.num_experts, self.hidden_size, self.inter_size)))
                            for _ in range(copies)]

    def layers(self, tokens: int) -> list[Layer]:
        """A fresh uniform routing of `tokens` tokens over each weight set, aligned on the device."""
        num_pairs = tokens * self.top_k
        out = []
        for gate_up, down in self.weight_sets:
            ids = np.argsort(self.rng.random((tokens, self.num_experts)), axis=1)[:, :self.top_k].astype(np.int32)
            expert_ids = self.upload(ids, DType.int32)
            alignment = moe_routing.MoeAlignment.allocate(self.allocator, num_pairs, self.num_experts)
            moe_routing.moe_align(alignment, expert_ids, self.stream)
            out.append(Layer(gate_up, down, expert_ids,
                             self.upload(np.full((tokens, self.top_k), 1 / self.top_k, np.float32), DType.float32),
                             alignment, self.allocator.empty((num_pairs, self.inter_size), self.dtype),
                             self.allocator.empty((num_pairs, self.hidden_size), self.dtype),
                             np.unique(ids).size))
        self.stream.synchronize()
        return out

    def report(self, name: str, tokens: int, layers: list[Layer], plan: str, launch, expert_bytes: int) -> None:
        """Times launch(layer), cycling over the layers, against the chosen experts' bytes."""
        turn = itertools.count()
        seconds = timed_graph(self.ops.stream, lambda: launch(layers[next(turn) % len(layers)]), self.iters)
        experts = np.mean([layer.num_active for layer in layers])
        rate = experts * expert_bytes / seconds
        print(f"| {name} | {tokens} | {experts:.1f} | {plan} | {seconds * 1e6:.1f} | {rate / 1e9:.0f} "
              f"| {rate / self.copy_rate:.2f} |", flush=True)


def plan_text(gemm_plan: moe_gemm.ExpertGemmPlan) -> str:
    return f"kM {gemm_plan.rows_per_pass}, split {gemm_plan.k_split}"


def bench_tokens(b: Bench, tokens: int) -> None:
    e, k, h, i = b.num_experts, b.top_k, b.hidden_size, b.inter_size
    item, num_pairs, sms = b.dtype.itemsize, tokens * k, b.device.sm_count
    layers = b.layers(tokens)
    x = b.upload(b.rng.standard_normal((tokens, h), dtype=np.float32), b.dtype)
    stream = b.ops.stream

    def gate_up(layer: Layer) -> None:
        a = layer.alignment
        moe_gemm.moe_gate_up(layer.hidden, x, layer.gate_up, a.sorted_pairs, a.offsets, a.active_experts,
                             a.num_active, k, stream)

    def down(layer: Layer) -> None:
        a = layer.alignment
        moe_gemm.moe_down(layer.expert_out, layer.hidden, layer.down, a.offsets, a.active_experts, a.num_active,
                          stream)

    gate_up_plan = moe_gemm.plan(num_pairs, e, moe_gemm.gate_up_tiles(i), h, b.dtype, sms)
    down_plan = moe_gemm.plan(num_pairs, e, moe_gemm.down_tiles(h), i, b.dtype, sms)
    b.report("moe_gate_up", tokens, layers, plan_text(gate_up_plan), gate_up, 2 * i * h * item)
    b.report("moe_down", tokens, layers, plan_text(down_plan), down, h * i * item)
    b.report("moe_experts (op)", tokens, layers, "align + gemms + combine",
             lambda layer: b.ops.moe_experts(x, layer.gate_up, layer.down, layer.weights, layer.expert_ids),
             3 * i * h * item)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, 48, ("bfloat16", "float16", "float32"))
    parser.add_argument("--model", default="qwen3", choices=sorted(MODELS))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--copies", type=int, default=4, help="weight sets the graph cycles over (beats L2)")
    args = parser.parse_args(argv)
    if args.iters % args.copies:
        parser.error(f"--iters ({args.iters}) must be a multiple of --copies ({args.copies}): every set runs as often")

    bench = Bench(DType.parse(args.dtype), args.iters, args.model, args.copies)
    e, k, h, i = MODELS[args.model]
    print(f"# {bench.device.name} ({bench.device.arch}), {args.dtype}, {args.model}: E {e}, k {k}, H {h}, I {i}; "
          f"device-to-device copy {bench.copy_rate / 1e12:.2f} TB/s (read + written)")
    print("| kernel | T | experts read | plan | us/call | GB/s | fraction of copy |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for tokens in args.tokens:
        bench_tokens(bench, tokens)
        bench.ops.stream.synchronize()
        bench.allocator.release_cached()
        bench.ops.allocator.release_cached()
    return 0


if __name__ == "__main__":
    sys.exit(main())
