"""The MoE kernels around the expert GEMMs at Qwen3-30B-A3B shapes (E = 128 experts,
top-8, hidden 2048): routing, alignment, both in one call, and the weighted combine;
then the decode router (router GEMM, routing and alignment) in two launches against one;
time per call and bandwidth as a fraction of the device-to-device copy rate.

  python tools/bench_moe_routing.py [--tokens 1 64 4096] [--router-tokens 1 2 4]
                                    [--router-shapes 128:8 512:10] [--iters 50]

Routing, alignment and moe_route_align are latency-bound: their bytes (logits read,
ids and alignment written) are tiny, and the time is what a graph-replayed step pays,
launch included. "route + align" is the two calls in sequence; "route_align" is one
call (a single launch up to 64 tokens, the two otherwise). The combine reads the
k bf16 expert rows of every token and writes one bf16 row: at 4096 tokens that is
the copy rate's territory. The logits are random normal, so the routing spreads the
pairs over the experts as real traffic does; the timed launches are replayed from
one CUDA graph, so Python launch overhead is not counted.

The decode router reads router_input [T, 2H] = [y | y_lo] against the router [E, 2H] = [W | W]
in bf16 (K = 4096: 1 MB of weights at E 128, 4 MB at Qwen3-Next's E 512), as CudaOps.sparse_moe
does, for each E:k of --router-shapes and each T of --router-tokens with T * k <= 32: "router GEMM
+ route_align" is the GEMM (gemm.Gemm: the measured table's pick, gemv or cuBLASLt) into fp32
logits, then moe_route_align; "router_route_align" is moe_router's one launch. Successive calls
read different copies of the router, 64 MB or more in all, so its weights come from DRAM as in a
decode step.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import DeviceBench, bench_parser, copy_bandwidth, timed_graph

from sparkd.backend.cuda.gemm import Gemm
from sparkd.backend.cuda.kernels import moe_router, moe_routing
from sparkd.backend.cuda.tensor import DeviceTensor
from sparkd.backend.dtypes import DType

HIDDEN, EXPERTS, TOP_K = 2048, 128, 8
ROUTERS_BYTES = 64 << 20  # the router's copies together: more than the H200's 60 MiB of L2


class Bench(DeviceBench):
    def __init__(self, iters: int):
        super().__init__(DType.bfloat16, iters)
        self.copy_rate = copy_bandwidth(self.allocator, self.stream)
        self.rng = np.random.default_rng(0)

    def report(self, name: str, shape: str, work, nbytes: float) -> None:
        seconds = timed_graph(self.stream, work, self.iters)
        rate = nbytes / seconds
        print(f"| {name} | {shape} | {seconds * 1e6:.1f} | {rate / 1e9:.0f} | {rate / self.copy_rate:.3f} |",
              flush=True)


def bench_tokens(b: Bench, tokens: int) -> None:
    pairs = tokens * TOP_K
    logits = b.upload(b.rng.standard_normal((tokens, EXPERTS)).astype(np.float32), DType.bfloat16)
    weights = b.allocator.empty((tokens, TOP_K), DType.float32)
    expert_ids = b.allocator.empty((tokens, TOP_K), DType.int32)
    alignment = moe_routing.MoeAlignment.allocate(b.allocator, pairs, EXPERTS)
    route_bytes = tokens * EXPERTS * 2 + pairs * 8  # logits in, weights and ids out
    align_bytes = 4 * (pairs + EXPERTS + 1 + 2 * pairs + min(EXPERTS, pairs) + 1)  # ids in, the alignment out
    shape = f"{tokens}x{EXPERTS}, k={TOP_K}"

    def route() -> None:
        moe_routing.moe_route(weights, expert_ids, logits, True, b.stream)

    def align() -> None:
        moe_routing.moe_align(alignment, expert_ids, b.stream)

    def route_then_align() -> None:
        route()
        align()

    def route_align() -> None:
        moe_routing.moe_route_align(weights, expert_ids, alignment, logits, True, b.stream)

    b.report("moe_route", shape, route, route_bytes)
    blocks, _ = moe_routing.align_grid(pairs, EXPERTS)
    b.report(f"moe_align ({blocks} block{'s' if blocks > 1 else ''})", shape, align, align_bytes)
    b.report("route + align", shape, route_then_align, route_bytes + align_bytes)
    b.report("route_align", shape, route_align, route_bytes + align_bytes)

    route_align()  # the combine gathers through this routing's row_of_pair
    expert_out = b.ones((pairs, HIDDEN))
    out = b.allocator.empty((tokens, HIDDEN), b.dtype)
    b.report("moe_combine", f"{tokens}x{TOP_K}x{HIDDEN} bf16 -> bf16",
             lambda: moe_routing.moe_combine(out, expert_out, weights, alignment.row_of_pair, b.stream),
             (pairs + tokens) * HIDDEN * b.dtype.itemsize)


def bench_router(b: Bench, gemm: Gemm, routers: list[DeviceTensor], tokens: int, top_k: int) -> None:
    """Each call reads the next of `routers` (more MB than L2 holds), so that the router's weights come
    from DRAM, as in a decode step, where every other layer's weights pass through L2 in between."""
    experts, width = routers[0].shape
    router_input = b.upload(b.rng.standard_normal((tokens, width)).astype(np.float32), DType.bfloat16)
    next_router = itertools.cycle(routers).__next__
    router_logits = b.allocator.empty((tokens, experts), DType.float32)
    weights = b.allocator.empty((tokens, top_k), DType.float32)
    expert_ids = b.allocator.empty((tokens, top_k), DType.int32)
    alignment = moe_routing.MoeAlignment.allocate(b.allocator, tokens * top_k, experts)
    pairs = tokens * top_k
    nbytes = ((experts + tokens) * width * 2 + tokens * experts * 4  # router and rows in, logits out
              + pairs * 8 + 4 * (experts + 1 + 2 * pairs + min(experts, pairs) + 1))  # the routing and alignment out
    shape = f"{tokens}x{width} @ {experts}x{width} bf16, k={top_k}"

    def two_launches() -> None:
        gemm(router_logits, router_input, next_router())
        moe_routing.moe_route_align(weights, expert_ids, alignment, router_logits, True, b.stream)

    def one_launch() -> None:
        moe_router.moe_router_route_align(weights, expert_ids, alignment, router_logits, router_input, next_router(),
                                          True, b.stream)

    b.report("router GEMM + route_align", shape, two_launches, nbytes)
    b.report("router_route_align", shape, one_launch, nbytes)


def router_shape(text: str) -> tuple[int, int]:
    """(E, k) from "E:k", e.g. "512:10"."""
    experts, top_k = text.split(":")
    return int(experts), int(top_k)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, 50)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 64, 4096],
                        help="routing batches (none: only the decode router)")
    parser.add_argument("--router-tokens", type=int, nargs="+", default=[1, 2, 4],
                        help="decode batches of the router rows (those with T * k <= 32 run)")
    parser.add_argument("--router-shapes", type=router_shape, nargs="+", default=[(EXPERTS, TOP_K)],
                        help="the decode router's experts and choices, E:k (Qwen3-30B-A3B 128:8, Qwen3-Next 512:10)")
    args = parser.parse_args(argv)

    bench = Bench(args.iters)
    print(bench.header(bench.copy_rate))
    print("| kernel | shape | us/call | GB/s | fraction of copy |")
    print("| --- | --- | --- | --- | --- |")
    for tokens in args.tokens:
        bench_tokens(bench, tokens)
        bench.stream.synchronize()
        bench.allocator.release_cached()
    gemm = Gemm(bench.allocator, bench.stream)
    width = 2 * HIDDEN  # [y | y_lo] against [W | W]
    for experts, top_k in args.router_shapes:
        router = (bench.rng.standard_normal((experts, width)) / np.sqrt(width)).astype(np.float32)
        routers = [bench.upload(router, DType.bfloat16) for _ in range(-(-ROUTERS_BYTES // (router.size * 2)))]
        for tokens in args.router_tokens:
            if tokens * top_k <= moe_routing.WARP_MAX_PAIRS:
                bench_router(bench, gemm, routers, tokens, top_k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
