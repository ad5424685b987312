"""Prefill attention on Hopper: the wgmma kernel against the mma.sync one, in us/call and TFLOP/s.

  python tools/bench_attention_prefill.py [--dtype bfloat16] [--iters 20]

Cases: a 4096-token prompt with Qwen3-30B-A3B heads (32 q, 4 kv), an 8192-token prompt with
Llama-3.1-8B heads (32 q, 8 kv) and 8 prompts of 1024 with Llama heads; then the ones that place
the wgmma kernel's MIN_QUERY_LEN: one prompt of 1024 and of 512, 16 of 512 and 16 of 128; head_dim
128, blocks of 16 tokens scattered over the cache. FLOPs are causal: 4 * Hq * D per (query, visible key).
As in bench_attention.py, each case cycles through caches worth twice the L2 and the timed
launches are replayed from one CUDA graph.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_attention import HEAD_DIM, NUM_Q_HEADS, Bench, causal_flops  # noqa: E402
from bench_common import bench_parser, timed_graph  # noqa: E402

from sparkd.backend.cuda.kernels import attention, attention_prefill_wgmma  # noqa: E402
from sparkd.backend.dtypes import DType  # noqa: E402

CASES = (("Qwen3-30B-A3B, one prompt", 4, [4096]), ("Llama-3.1-8B, one prompt", 8, [8192]),
         ("Llama-3.1-8B, 8 prompts", 8, [1024] * 8), ("Qwen3-30B-A3B, one prompt", 4, [1024]),
         ("Qwen3-30B-A3B, one prompt", 4, [512]), ("Llama-3.1-8B, 16 prompts", 8, [512] * 16),
         ("Qwen3-30B-A3B, 16 prompts", 4, [128] * 16))
KERNELS = (("mma.sync", attention.prefill_attention), ("wgmma", attention_prefill_wgmma.prefill_attention_wgmma))


def seconds_per_call(bench: Bench, launcher, query_lens: list[int], num_kv_heads: int) -> float:
    meta, num_blocks = bench.step(query_lens, query_lens)
    q = bench.ones((sum(query_lens), NUM_Q_HEADS, HEAD_DIM))
    out = bench.allocator.empty(q.shape, bench.dtype)
    rotation = itertools.cycle(bench.caches(num_blocks, num_kv_heads))
    seconds = timed_graph(bench.stream, lambda: launcher(out, q, *next(rotation), meta, HEAD_DIM ** -0.5,
                                                         bench.stream), bench.iters)
    bench.stream.synchronize()
    bench.allocator.release_cached()  # the next case's caches need the room
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, 20, ("bfloat16", "float16"))
    args = parser.parse_args(argv)

    bench = Bench(DType.parse(args.dtype), args.iters)
    print(f"# {bench.device.name} ({bench.device.arch}), {args.dtype}, Hq {NUM_Q_HEADS}, D {HEAD_DIM}, block 16")
    print("| case | kv heads | tokens | mma.sync us | mma.sync TFLOP/s | wgmma us | wgmma TFLOP/s | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, num_kv_heads, query_lens in CASES:
        flops = causal_flops(query_lens, query_lens)
        times = [seconds_per_call(bench, launcher, query_lens, num_kv_heads) for _, launcher in KERNELS]
        cells = " | ".join(f"{s * 1e6:.0f} | {flops / s / 1e12:.0f}" for s in times)
        print(f"| {name} | {num_kv_heads} | {sum(query_lens)} | {cells} | {times[0] / times[1]:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
