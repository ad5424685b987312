"""Device sampling per call at decode batch sizes: the launch `sample_async` makes
(rows spread over many blocks where `plan_split` allows it) against one block per
row, and the time to read the fp32 logits once at the device-to-device copy rate.

  python tools/bench_sampling.py [--rows 1 8 64 256] [--vocab 128256 151936] [--iters 50]

Logits look like a model's (a broad background plus a few strong ids), so the
top-k / top-p cuts land where they would in a real decode. "full" is temperature
0.8, top-k 50, top-p 0.9, min-p 0.05, repetition penalty 1.1 and presence penalty
0.3 over a 1k-token prompt and 64 output tokens. Timed launches are replayed from
one CUDA graph (tools/bench_common.timed_graph), so no Python overhead is counted.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import DeviceBench, bench_parser, copy_bandwidth, timed_graph

from sparkd.backend.base import SamplingTensors
from sparkd.backend.cuda.kernels import sampling
from sparkd.backend.cuda.transfer import StagingRing
from sparkd.backend.dtypes import DType

PROMPT_LEN, OUTPUT_LEN = 1024, 64
MODES = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top-p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "full": {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
             "presence_penalty": 0.3},
}


def sampling_tensors(rng: np.random.Generator, rows: int, vocab: int, mode: dict) -> SamplingTensors:
    """`rows` identical requests in `mode`, each with its own seed and prompt / output ids."""
    def per_row(name: str, neutral: float, dtype) -> np.ndarray:
        return np.full(rows, mode.get(name, neutral), dtype)

    return SamplingTensors(
        temperature=per_row("temperature", 1.0, np.float32), top_k=per_row("top_k", 0, np.int32),
        top_p=per_row("top_p", 1.0, np.float32), min_p=per_row("min_p", 0.0, np.float32),
        repetition_penalty=per_row("repetition_penalty", 1.0, np.float32),
        presence_penalty=per_row("presence_penalty", 0.0, np.float32),
        frequency_penalty=per_row("frequency_penalty", 0.0, np.float32),
        prompt_token_ids=rng.integers(0, vocab, size=(rows, PROMPT_LEN), dtype=np.int32),
        output_token_ids=rng.integers(0, vocab, size=(rows, OUTPUT_LEN), dtype=np.int32),
        banned_token_ids=np.full((rows, 0), -1, np.int32),
        seeds=rng.integers(0, 2**64, size=rows, dtype=np.uint64),
        steps=np.full(rows, OUTPUT_LEN, np.int64), num_logprobs=-1)


def llm_like_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    logits = 3 * rng.standard_normal((rows, vocab), dtype=np.float32)
    for row in logits:
        row[rng.integers(0, vocab, size=5)] += 8
    return logits


def bench_shape(bench: DeviceBench, staging: StagingRing, copy_rate: float, rows: int, vocab: int,
                rng: np.random.Generator) -> None:
    logits = bench.upload(llm_like_logits(rng, rows, vocab), DType.float32)
    workspace = bench.allocator.empty((rows, vocab), DType.float32)
    read_once = rows * vocab * 4 / copy_rate
    plan = sampling.device_split_plan(rows, vocab)
    layout = f"{plan.splits} x {plan.chunk}" if plan else "1 block/row"
    for name, mode in MODES.items():
        inputs = sampling.upload_inputs(sampling_tensors(rng, rows, vocab, mode), staging)
        out = sampling.SamplerBuffers.allocate(bench.allocator, rows, -1)
        times = [timed_graph(bench.stream, partial(sampling.launch_sample, out, logits, inputs, workspace,
                                                   bench.stream, split=split), bench.iters)
                 for split in (True, False)]
        print(f"| {rows} | {vocab} | {name} | {layout} | {times[0] * 1e6:.1f} | {times[1] * 1e6:.1f} "
              f"| {read_once * 1e6:.2f} | {times[0] / read_once:.0f} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, 50)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[128256, 151936])
    args = parser.parse_args(argv)

    bench = DeviceBench(DType.float32, args.iters)
    staging = StagingRing(bench.allocator, bench.stream)
    copy_rate = copy_bandwidth(bench.allocator, bench.stream)
    rng = np.random.default_rng(0)
    print(bench.header(copy_rate, f", {bench.device.sm_count} SMs"))
    print("| rows | vocab | mode | blocks a row x ids | us/call | us/call, 1 block/row | us to read logits once "
          "| x read once |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for rows in args.rows:
        for vocab in args.vocab:
            bench_shape(bench, staging, copy_rate, rows, vocab, rng)
            bench.stream.synchronize()
            bench.allocator.release_cached()
    return 0


if __name__ == "__main__":
    sys.exit(main())
