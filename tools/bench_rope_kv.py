"""rope_write_kv (RoPE, the optional q/k norm and the paged KV write in one launch) at
prefill shapes: time per call and bandwidth as a fraction of the device-to-device copy
rate measured in the same run.

  python tools/bench_rope_kv.py [--tokens 64 4096 8192] [--iters 50]

Shapes: Qwen3-30B-A3B (32 q heads, 4 kv heads, D 128, per-head q/k RMSNorm) and
Llama-3-8B (32 / 8, D 128, no norm), bf16, full rotary. The bytes moved are q, k and v
read from the fused qkv rows, rotated q written, k and v written to the caches, plus
each token's cos/sin row, position and slot. Positions and slots are 0 .. T-1, as a
prefill from an empty cache has them. The timed calls are replayed from one CUDA graph
and cycle through enough buffer sets to move at least twice the H200's 60 MiB L2 between
two uses of one set, so the small cases are not served from L2.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import DeviceBench, bench_parser, copy_bandwidth, timed_graph

from sparkd.backend.cuda.kernels import rope_kv
from sparkd.backend.cuda.kernels.rope_kv import rope_cos_sin
from sparkd.backend.dtypes import DType
from sparkd.models.config import rope_config

HEAD_DIM, BLOCK_SIZE = 128, 16
MODELS = [  # name, q heads, kv heads, q/k norm, rope theta
    ("Qwen3-30B-A3B", 32, 4, True, 1000000.0),
    ("Llama-3-8B", 32, 8, False, 500000.0),
]
ROTATE_BYTES = 128 << 20  # moved between two uses of one buffer set: twice the L2, and more
MAX_SETS = 64


class Bench(DeviceBench):
    def __init__(self, iters: int):
        super().__init__(DType.bfloat16, iters)
        self.copy_rate = copy_bandwidth(self.allocator, self.stream)

    def time_model(self, tokens: int, num_q_heads: int, num_kv_heads: int, with_norm: bool,
                   theta: float) -> tuple[float, int]:
        """(seconds per call, bytes moved per call) of rope_write_kv on `tokens` tokens."""
        heads = (num_q_heads, num_kv_heads, num_kv_heads)
        element = self.dtype.itemsize
        nbytes = tokens * (2 * sum(heads) * HEAD_DIM * element + HEAD_DIM * 4 + 8)
        rope = rope_config({"rope_parameters": {"rope_theta": theta}}, HEAD_DIM)
        cos_sin = self.upload(rope_cos_sin(rope, tokens), DType.float32)
        positions = self.upload(np.arange(tokens), DType.int32)
        slots = self.upload(np.arange(tokens), DType.int32)
        qk_norm = (self.ones((HEAD_DIM,)), self.ones((HEAD_DIM,)), 1e-6) if with_norm else None
        num_blocks = -(-tokens // BLOCK_SIZE)
        sets = [self.buffer_set(tokens, heads, num_blocks) for _ in range(min(MAX_SETS, -(-ROTATE_BYTES // nbytes)))]
        rotation = itertools.cycle(sets)

        def call() -> None:
            q_out, q, k, v, k_cache, v_cache = next(rotation)
            rope_kv.rope_write_kv(q_out, q, k, v, positions, cos_sin, k_cache, v_cache, slots, self.stream, qk_norm)

        seconds = timed_graph(self.stream, call, self.iters * len(sets))
        self.stream.synchronize()
        self.allocator.release_cached()
        return seconds, nbytes

    def buffer_set(self, tokens: int, heads: tuple[int, int, int], num_blocks: int) -> tuple:
        """(q_out, q, k, v, k_cache, v_cache): q, k, v views of one qkv buffer of ones."""
        qkv = self.ones((tokens, sum(heads) * HEAD_DIM))
        starts = np.cumsum([0, *heads[:-1]]) * HEAD_DIM
        q, k, v = (qkv.column_slice(int(start), n * HEAD_DIM).split_last(n, HEAD_DIM)
                   for start, n in zip(starts, heads))
        cache_shape = (num_blocks, heads[1], BLOCK_SIZE, HEAD_DIM)
        return (self.allocator.empty(q.shape, self.dtype), q, k, v,
                *(self.allocator.empty(cache_shape, self.dtype) for _ in range(2)))


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, 50)
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 4096, 8192])
    args = parser.parse_args(argv)

    bench = Bench(args.iters)
    print(bench.header(bench.copy_rate))
    print("| model | heads q/kv, D | norm | tokens | MB moved | us/call | TB/s | fraction of copy |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (name, num_q_heads, num_kv_heads, with_norm, theta), tokens in itertools.product(MODELS, args.tokens):
        seconds, nbytes = bench.time_model(tokens, num_q_heads, num_kv_heads, with_norm, theta)
        rate = nbytes / seconds
        print(f"| {name} | {num_q_heads}/{num_kv_heads}, {HEAD_DIM} | {'q/k' if with_norm else '-'} | {tokens} | "
              f"{nbytes / 1e6:.1f} | {seconds * 1e6:.1f} | {rate / 1e12:.2f} | {rate / bench.copy_rate:.3f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
