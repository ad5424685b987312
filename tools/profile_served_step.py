"""Where a served batch-1 decode step's device time goes, outside its graph and in it.

  python tools/profile_served_step.py [--model llama|moe|hybrid] [--layers N] [--steps 200]

Builds the model of bench_decode.py, bench_moe.py or bench_hybrid.py (random bf16 weights on
the device), measures the decode forward alone (back-to-back graph replays), then serves a
128-token prompt twice through the AsyncEngine loop of `sparkd serve` (one engine): the first
request as it runs, for the served rate; the second with CUDA events recorded around each part
of a step (the inputs' upload, the graph replay, the sampling, and inside it the parameters'
upload and the sampling launch), by wrapping those functions. Prints the two rates against
the bandwidth roofline and each part's median over the timed steps (the first 30 dropped).
Each event record costs the stream ~1-2 us, so the timed run is slower and its parts are
upper bounds; the untimed rate is the one to compare.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_decode  # noqa: E402
import bench_hybrid  # noqa: E402
import bench_moe  # noqa: E402

from sparkd.backend.cuda import decode_graphs, graphs  # noqa: E402
from sparkd.backend.cuda import ops as cuda_ops  # noqa: E402
from sparkd.backend.cuda.driver import Event  # noqa: E402
from sparkd.backend.cuda.kernels import sampling  # noqa: E402
from sparkd.engine.async_engine import AsyncEngine  # noqa: E402

MODELS = {"llama": (bench_decode, 32), "moe": (bench_moe, 24), "hybrid": (bench_hybrid, 12)}
PROMPT_LEN = 128
STEP_PARTS = ("upload", "graph", "sample")  # a step's top-level parts, in stream order
SKIPPED = 30  # marks of the first timed steps, left out


class StepTimer:
    """CUDA events around wrapped functions, once `on`; marks: (part, start, end) in call order."""

    def __init__(self, stream):
        self.stream = stream
        self.on = False
        self.marks: list[tuple[str, Event, Event]] = []

    def wrap(self, owner, name: str, part: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.on:
                return original(*args, **kwargs)
            start, end = Event(timing=True), Event(timing=True)
            start.record(self.stream)
            result = original(*args, **kwargs)
            end.record(self.stream)
            self.marks.append((part, start, end))
            return result

        setattr(owner, name, timed)

    def medians(self) -> tuple[dict[str, float], float]:
        """Each part's median us, and the median gap between a step's consecutive parts."""
        self.stream.synchronize()
        kept = self.marks[SKIPPED:]
        parts: dict[str, list[float]] = {}
        for part, start, end in kept:
            parts.setdefault(part, []).append(1e3 * start.elapsed_ms(end))
        steps = [mark for mark in kept if mark[0] in STEP_PARTS]
        gaps = [1e3 * a[2].elapsed_ms(b[1]) for a, b in zip(steps, steps[1:])]
        return {part: statistics.median(times) for part, times in parts.items()}, statistics.median(gaps)


def model_parser(description: str, default: str) -> argparse.ArgumentParser:
    """A parser with --model (a key of MODELS) and --layers, for the profiling tools."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default=default)
    parser.add_argument("--layers", type=int, help="decoder layers (default: the benchmark's)")
    return parser


def built_model(args: argparse.Namespace, steps: int) -> tuple[cuda_ops.CudaOps, float, bench_decode.Model]:
    """(ops, copy rate in bytes/s, the benchmark's model) for model_parser's arguments, on a bf16
    CudaOps with the ceilings measured and printed; `steps` sizes its context as the bench's."""
    bench, layers = MODELS[args.model]
    num_layers = args.layers or layers
    ops, copy_rate, _ = bench_decode.measure_ceilings(f"{args.model}, {num_layers} layers")
    return ops, copy_rate, bench.build_model(ops, num_layers, steps, 0.5)


def main(argv: list[str] | None = None) -> int:
    parser = model_parser(__doc__, "llama")
    parser.add_argument("--steps", type=int, default=200, help="decode steps served per run")
    args = parser.parse_args(argv)
    ops, copy_rate, model = built_model(args, args.steps)
    rng = np.random.default_rng(0)
    _, forward_seconds, floor_seconds = bench_decode.run_decode(model, 1, PROMPT_LEN, 32, copy_rate, rng)

    timer = StepTimer(ops.stream)
    timer.wrap(decode_graphs.DecodeGraphRunner, "_upload_step", "upload")
    timer.wrap(graphs.CudaGraph, "replay", "graph")
    timer.wrap(cuda_ops.CudaOps, "sample_async", "sample")
    timer.wrap(sampling, "upload_inputs", "sampling parameters' upload")
    timer.wrap(sampling, "launch_sample", "sampling launch")
    timer.wrap(sampling, "launch_greedy", "sampling launch")
    add_request, requests = AsyncEngine.add_request, []

    def add_and_time_the_second(engine, *args, **kwargs):
        requests.append(None)
        timer.on = len(requests) == 2
        return add_request(engine, *args, **kwargs)

    AsyncEngine.add_request = add_and_time_the_second
    served, timed = bench_decode.run_served_decode(model, [(1, PROMPT_LEN)] * 2, args.steps, rng)
    parts, gap = timer.medians()
    print(f"| {args.model} | forward {1 / forward_seconds:.1f} tok/s ({floor_seconds / forward_seconds:.3f}) | "
          f"served {served:.1f} ({served * floor_seconds:.3f}) | timed {timed:.1f} |", flush=True)
    for part, us in parts.items():
        print(f"| {part} | {us:.1f} us |")
    print(f"| gap between parts | {gap:.1f} us |\n| step (parts + 3 gaps) | "
          f"{sum(parts[p] for p in STEP_PARTS if p in parts) + 3 * gap:.1f} us |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
