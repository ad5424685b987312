"""The non-attention kernels at Llama-3.1-8B shapes: time per call and bandwidth as a
fraction of the device-to-device copy rate measured in the same run.

  python tools/bench_kernels.py [--dtype bfloat16] [--tokens 1 64 8192] [--iters 50]

Bytes count what a kernel must read plus write at least once (the copy rate counts
read plus written too), so 1.0 is the ceiling. At one token the data sit in L2 and
the figure mostly shows launch latency inside a graph (a few microseconds), which
is what a decode step pays. Sampling runs on fp32 logits [B, V]; its "bytes" are one
read of the logits, so the ratio says how many passes over the row it costs.
The timed launches are replayed from one CUDA graph, so Python launch overhead is
not counted.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import DeviceBench, bench_parser, copy_bandwidth, timed_graph

from sparkd.backend.cuda.kernels import (
    activation,
    embedding,
    norm,
    rope_kv,
    sampling,
)
from sparkd.backend.cuda.transfer import StagingRing
from sparkd.backend.dtypes import DType
from sparkd.engine.request import Request
from sparkd.engine.sampling_batch import build_sampling_tensors
from sparkd.engine.sampling_params import SamplingParams

HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 4096, 32, 8, 128, 14336, 128256
BLOCK_SIZE = 16


class Bench(DeviceBench):
    def __init__(self, dtype: DType, iters: int):
        super().__init__(dtype, iters)
        self.staging = StagingRing(self.allocator, self.stream)
        self.copy_rate = copy_bandwidth(self.allocator, self.stream)
        self.rng = np.random.default_rng(0)

    def report(self, name: str, shape: str, work, nbytes: float) -> None:
        seconds = timed_graph(self.stream, work, self.iters)
        rate = nbytes / seconds
        print(f"| {name} | {shape} | {seconds * 1e6:.1f} | {rate / 1e9:.0f} | {rate / self.copy_rate:.2f} |", flush=True)


def bench_layer_ops(b: Bench, tokens: int) -> None:
    item = b.dtype.itemsize
    table = b.ones((VOCAB, HIDDEN))
    ids = b.upload(b.rng.integers(0, VOCAB, size=tokens).astype(np.int32), DType.int32)
    hidden = b.ones((tokens, HIDDEN))
    out = b.allocator.empty((tokens, HIDDEN), b.dtype)
    b.report("embedding", f"{tokens}x{HIDDEN}", lambda: embedding.embedding(out, ids, table, b.stream),
             2 * tokens * HIDDEN * item)

    weight = b.ones((HIDDEN,))
    b.report("rmsnorm", f"{tokens}x{HIDDEN}", lambda: norm.rmsnorm(out, hidden, weight, 1e-5, b.stream),
             2 * tokens * HIDDEN * item)
    residual = b.allocator.empty((tokens, HIDDEN), DType.float32)  # the fp32 residual stream, updated in place
    b.report("add_rmsnorm", f"{tokens}x{HIDDEN}",
             lambda: norm.add_rmsnorm(out, residual, residual, hidden, weight, 1e-5, b.stream),
             (2 * item + 2 * 4) * tokens * HIDDEN)

    width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = b.ones((tokens, width))
    q, k, v = (qkv.column_slice(start, heads * HEAD_DIM).split_last(heads, HEAD_DIM) for start, heads in
               ((0, Q_HEADS), (Q_HEADS * HEAD_DIM, KV_HEADS), ((Q_HEADS + KV_HEADS) * HEAD_DIM, KV_HEADS)))
    q_out = b.allocator.empty(q.shape, b.dtype)
    head_weight = b.ones((HEAD_DIM,))
    b.report("q head norm", f"{tokens}x{Q_HEADS}x{HEAD_DIM}",
             lambda: norm.rmsnorm(q_out, q, head_weight, 1e-6, b.stream), 2 * q.numel * item)

    num_blocks = -(-tokens // BLOCK_SIZE)
    k_cache = b.ones((num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM))
    v_cache = b.ones((num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM))
    positions = b.upload(np.arange(tokens, dtype=np.int32), DType.int32)
    slots = b.upload(b.rng.permutation(num_blocks * BLOCK_SIZE)[:tokens].astype(np.int32), DType.int32)
    cos_sin = b.ones((max(tokens, 1), HEAD_DIM), DType.float32)
    b.report("rope_write_kv", f"{tokens}x({Q_HEADS}+2x{KV_HEADS})x{HEAD_DIM}",
             lambda: rope_kv.rope_write_kv(q_out, q, k, v, positions, cos_sin, k_cache, v_cache, slots, b.stream),
             2 * tokens * width * item)

    gate_up = b.ones((tokens, 2 * INTERMEDIATE))
    act = b.allocator.empty((tokens, INTERMEDIATE), b.dtype)
    b.report("silu_and_mul", f"{tokens}x2x{INTERMEDIATE}", lambda: activation.silu_and_mul(act, gate_up, b.stream),
             3 * tokens * INTERMEDIATE * item)


def bench_sampling(b: Bench, rows: int) -> None:
    raw = b.upload(3 * b.rng.standard_normal((rows, VOCAB), dtype=np.float32), DType.float32)
    prompt = b.rng.integers(0, VOCAB, size=1024).tolist()
    workspace = b.allocator.empty((rows, VOCAB), DType.float32)
    for mode, params in {
        "greedy": SamplingParams(temperature=0.0),
        "temperature": SamplingParams(),
        "top-k 50 + top-p 0.9": SamplingParams(top_k=50, top_p=0.9),
        "top-p 0.9 + 5 logprobs": SamplingParams(top_p=0.9, logprobs=5),
        "repetition penalty, 1k prompt": SamplingParams(repetition_penalty=1.2),
    }.items():
        tensors = build_sampling_tensors([Request(str(i), prompt, params, seed=i) for i in range(rows)])
        inputs = sampling.upload_inputs(tensors, b.staging)
        out = sampling.SamplerBuffers.allocate(b.allocator, rows, sampling.num_top_logprobs(tensors.num_logprobs, VOCAB))
        b.report(f"sample: {mode}", f"{rows}x{VOCAB}",
                 partial(sampling.launch_sample, out, raw, inputs, workspace, b.stream), rows * VOCAB * 4)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, 50, ("bfloat16", "float16", "float32"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 8192])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64], help="sampling batch sizes")
    args = parser.parse_args(argv)

    bench = Bench(DType.parse(args.dtype), args.iters)
    print(bench.header(bench.copy_rate, f", {args.dtype}"))
    print("| kernel | shape | us/call | GB/s | fraction of copy |")
    print("| --- | --- | --- | --- | --- |")
    for tokens in args.tokens:
        bench_layer_ops(bench, tokens)
        bench.stream.synchronize()
        bench.allocator.release_cached()
    for rows in args.rows:
        bench_sampling(bench, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
