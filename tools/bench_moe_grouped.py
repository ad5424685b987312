"""The prefill-path expert GEMMs (gate_up, down) at Qwen3-30B-A3B and Mixtral shapes: time per
call and TFLOP/s in active FLOPs of the mma.sync kernels (moe_grouped_gemm) and, on sm_90, of
the wgmma ones (moe_grouped_wgmma, with their speed-up over mma.sync), against cuBLASLt running
one dense GEMM of the same FLOPs and against the bf16 8192^3 GEMM rate measured in the same run.

  python tools/bench_moe_grouped.py [--model qwen3 mixtral] [--tokens 512 4096] [--iters 10]

T tokens each choose k distinct experts uniformly at random (P = T*k rows). Active FLOPs
count the rows routed to each expert, nothing of the padding of its last 128-row tile:
gate_up 2 * P * 2I * H, down 2 * P * H * I. The cuBLASLt line is [P, 2I] = [P, H] @ [2I, H]^T
for gate_up and [P, H] = [P, I] @ [H, I]^T for down, both written in the dtype as the kernels
write them: the rate a dense GEMM of that size reaches, the ceiling of a grouped one. "tile rows"
is the rows the 128-row M-tiles span over the active rows (wgmma computes an M-tile's second
64 rows only where it has any). Weights hold 1.0 and x random values;
the values do not change the timing. The timed launches are replayed from one CUDA graph,
so Python launch overhead is not counted; the routing, alignment and tile plan are done once
beforehand.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import DeviceBench, bench_parser, timed_graph
from bench_gemm import gemm_rate

from sparkd.backend.cuda.gemm import Gemm
from sparkd.backend.cuda.kernels import moe_grouped_gemm, moe_grouped_wgmma, moe_routing
from sparkd.backend.cuda.tensor import DeviceTensor
from sparkd.backend.dtypes import DType

# (E, k, H, I)
MODELS = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336), "qwen3-235b": (128, 8, 4096, 1536),
          "qwen3-next": (512, 10, 2048, 512)}


class Bench(DeviceBench):
    def __init__(self, dtype: DType, iters: int):
        super().__init__(dtype, iters)
        self.gemm = Gemm(self.allocator, self.stream)
        self.gemm_rate = gemm_rate(self.gemm, self.allocator, self.stream, dtype)
        self.rng = np.random.default_rng(0)

    def row(self, model: str, tokens: int, name: str, seconds: float, flops: float, tile_rows: str) -> None:
        rate = flops / seconds
        print(f"| {model} | {tokens} | {name} | {seconds * 1e6:.1f} | {rate / 1e12:.0f} | "
              f"{rate / self.gemm_rate:.2f} | {tile_rows} |", flush=True)


def bench_model(b: Bench, model: str, token_counts: list[int]) -> None:
    num_experts, _, hidden_size, inter = MODELS[model]
    gate_up = b.ones((num_experts, 2 * inter, hidden_size))
    down = b.ones((num_experts, hidden_size, inter))
    for tokens in token_counts:
        bench_tokens(b, model, tokens, gate_up, down)
        b.stream.synchronize()
        b.allocator.release_cached()


def bench_tokens(b: Bench, model: str, tokens: int, gate_up: DeviceTensor, down: DeviceTensor) -> None:
    """Both kernels and their dense references for one uniform random routing of `tokens` tokens."""
    num_experts, top_k, hidden_size, inter = MODELS[model]
    num_pairs = tokens * top_k
    ids = np.argsort(b.rng.random((tokens, num_experts)), axis=1)[:, :top_k].astype(np.int32)
    counts = np.bincount(ids.ravel(), minlength=num_experts)
    tile_rows = f"{np.sum(-(-counts // moe_grouped_gemm.TILE_M)) * moe_grouped_gemm.TILE_M / num_pairs:.2f}"
    alignment = moe_routing.MoeAlignment.allocate(b.allocator, num_pairs, num_experts)
    moe_routing.moe_align(alignment, b.upload(ids, DType.int32), b.stream)
    tile_starts = b.allocator.empty((num_experts + 1,), DType.int32)
    moe_grouped_gemm.plan_tiles(tile_starts, alignment.offsets, b.stream)
    x = b.upload(b.rng.standard_normal((tokens, hidden_size), dtype=np.float32), b.dtype)
    hidden = b.allocator.empty((num_pairs, inter), b.dtype)
    expert_out = b.allocator.empty((num_pairs, hidden_size), b.dtype)

    def gate_up_call(gemms) -> None:
        gemms.moe_grouped_gate_up(hidden, x, gate_up, alignment.sorted_pairs, alignment.offsets, tile_starts, top_k,
                                  b.stream)

    def down_call(gemms) -> None:
        gemms.moe_grouped_down(expert_out, hidden, down, alignment.offsets, tile_starts, b.stream)

    gate_up_flops = 2 * num_pairs * 2 * inter * hidden_size
    down_flops = 2 * num_pairs * hidden_size * inter
    grouped_rows(b, model, tokens, "moe_grouped_gate_up", gate_up_call, gate_up_flops, tile_rows)
    b.row(model, tokens, f"cuBLASLt {num_pairs}x{2 * inter}x{hidden_size}",
          dense_seconds(b, num_pairs, 2 * inter, hidden_size), gate_up_flops, "1.00")
    grouped_rows(b, model, tokens, "moe_grouped_down", down_call, down_flops, tile_rows)
    b.row(model, tokens, f"cuBLASLt {num_pairs}x{hidden_size}x{inter}",
          dense_seconds(b, num_pairs, hidden_size, inter), down_flops, "1.00")


def grouped_rows(b: Bench, model: str, tokens: int, name: str, launch, flops: float, tile_rows: str) -> None:
    """`name` on mma.sync, then on wgmma where the device has it; launch(gemms) runs one call of a
    kernel module (moe_grouped_gemm or moe_grouped_wgmma)."""
    mma_seconds = timed_graph(b.stream, lambda: launch(moe_grouped_gemm), b.iters)
    b.row(model, tokens, f"{name} (mma.sync)", mma_seconds, flops, tile_rows)
    if moe_grouped_wgmma.use_wgmma(b.device.arch):
        seconds = timed_graph(b.stream, lambda: launch(moe_grouped_wgmma), b.iters)
        b.row(model, tokens, f"{name} (wgmma, {mma_seconds / seconds:.2f}x mma.sync)", seconds, flops, tile_rows)


def dense_seconds(b: Bench, m: int, n: int, k: int) -> float:
    """Seconds per cuBLASLt call of out [m, n] = x [m, k] @ weight [n, k]^T, all in the bench's dtype."""
    x, weight, out = b.ones((m, k)), b.ones((n, k)), b.allocator.empty((m, n), b.dtype)
    return timed_graph(b.stream, lambda: b.gemm.cublaslt(out, x, weight), b.iters)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, 10, ("bfloat16", "float16"))
    parser.add_argument("--model", nargs="+", default=["qwen3", "mixtral"], choices=sorted(MODELS))
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    args = parser.parse_args(argv)
    if any(tokens < 1 for tokens in args.tokens):
        parser.error(f"--tokens values must be >= 1, got {args.tokens}")

    bench = Bench(DType.parse(args.dtype), args.iters)
    stages = moe_grouped_gemm.pipeline_stages(bench.device.max_shared_per_block_optin)
    wgmma = "; wgmma: persistent, 4 stages, clusters by expert count" if moe_grouped_wgmma.use_wgmma(bench.device.arch) else ""
    print(f"# {bench.device.name} ({bench.device.arch}), {args.dtype}; {args.dtype} GEMM 8192^3 through cuBLASLt: "
          f"{bench.gemm_rate / 1e12:.0f} TFLOP/s; mma.sync pipeline {stages} stages deep{wgmma}")
    print("| model | T | kernel | us/call | TFLOP/s | of GEMM 8192^3 | tile rows / rows |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model in args.model:
        bench_model(bench, model, args.tokens)
        bench.allocator.release_cached()
    return 0


if __name__ == "__main__":
    sys.exit(main())
