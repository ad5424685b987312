"""Device time of every kernel of one engine step, measured by Nsight Compute.

  python tools/profile_step.py [--model moe|llama|hybrid] [--layers 2] [--case decode1 ...]

For each case this runs itself under `ncu` (which must be on PATH), profiling only the
one step between cuProfilerStart and cuProfilerStop, and prints a table per case: each
kernel's name, launches, total and per-launch microseconds. Caches and clocks are left
as they are (`--cache-control none --clock-control none`) so the figures are what the
kernels take in a real step; ncu serializes the launches, so the launch gaps of a graph
replay are not in them: the sum is the step's kernel time, and the gap between that
sum and the forward's measured time is what launching costs.

Cases (the shapes of bench_decode.py, bench_moe.py and bench_hybrid.py, random bf16 weights on the device):
  decode1   batch-1 decode after a 128-token prompt (the captured graph's kernels);
  decode64  batch-64 decode, 1k-token contexts;
  prefill   one prompt of the bench's prefill length, in one step.
"""

from __future__ import annotations

import argparse
import csv
import io
import logging
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_decode  # noqa: E402
import bench_hybrid  # noqa: E402
import bench_moe  # noqa: E402
from cuda.bindings import driver  # noqa: E402

from sparkd import SamplingParams  # noqa: E402
from sparkd.backend.cuda.driver import call  # noqa: E402
from sparkd.backend.cuda.ops import CudaOps  # noqa: E402

CASES = ("decode1", "decode64", "prefill")
MODELS = {"llama": bench_decode, "moe": bench_moe, "hybrid": bench_hybrid}
CHILD_ENV = "SPARKD_PROFILE_STEP_CHILD"  # set in the process ncu runs


def profiled_step(model_name: str, num_layers: int, case: str) -> None:
    """Build the model, bring the engine to the case's step and run that one step between
    cuProfilerStart and cuProfilerStop (what ncu profiles)."""
    logging.basicConfig(level=logging.WARNING)
    bench = MODELS[model_name]
    ops = CudaOps(dtype="bfloat16")
    model = bench.build_model(ops, num_layers, steps=8, gpu_memory_utilization=0.9)
    engine, rng = model.engine, np.random.default_rng(0)
    vocab = model.config.vocab_size
    if case == "prefill":
        params = SamplingParams(temperature=0.0, max_tokens=1)
        engine.add_request(rng.integers(0, vocab, bench.PREFILL_LEN).tolist(), params)
        engine.step()  # plans this shape's GEMMs
        engine.add_request(rng.integers(0, vocab, bench.PREFILL_LEN).tolist(), params)
    else:
        batch, context = (1, bench.PROMPT_LEN) if case == "decode1" else (bench.BATCH, bench.CONTEXT)
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for _ in range(batch):
            engine.add_request(rng.integers(0, vocab, context).tolist(), params)
        scheduler = engine.scheduler
        while scheduler.num_waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
            engine.step()
        for _ in range(bench_decode.WARMUP_STEPS):
            engine.step()
    ops.synchronize()
    call(driver.cuProfilerStart)
    engine.step()
    ops.synchronize()
    call(driver.cuProfilerStop)


def kernel_table(ncu_csv: str) -> list[tuple[str, int, float]]:
    """(kernel name, launches, total microseconds) from ncu's raw CSV, longest total first."""
    lines = [line for line in ncu_csv.splitlines() if line.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    totals: dict[str, list[float]] = defaultdict(list)
    metric = "gpu__time_duration.sum"
    unit = rows[0][metric] if rows and rows[0]["ID"] == "" else "nsecond"  # ncu's units row
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[unit]
    for row in rows:
        if row["ID"] == "":
            continue
        name = row["Kernel Name"].split("(")[0].removeprefix("void ")  # template arguments kept
        totals[name].append(float(row[metric].replace(",", "")))
    table = [(name, len(times), sum(times) * scale) for name, times in totals.items()]
    return sorted(table, key=lambda entry: -entry[2])


def profile(model_name: str, num_layers: int, case: str) -> None:
    command = ["ncu", "--profile-from-start", "off", "--cache-control", "none", "--clock-control", "none",
               "--metrics", "gpu__time_duration.sum", "--csv", "--page", "raw",
               sys.executable, __file__, "--model", model_name, "--layers", str(num_layers), "--case", case]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, CHILD_ENV: "1"})
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-3000:], sep="\n")
        raise SystemExit(f"ncu failed with exit {result.returncode} for {case}")
    try:
        table = kernel_table(result.stdout)
    except (KeyError, ValueError) as error:
        print(result.stdout[:3000])
        raise SystemExit(f"could not read ncu's CSV for {case}: {error!r}") from error
    total = sum(us for _, _, us in table)
    launches = sum(n for _, n, _ in table)
    print(f"\n## {model_name}, {num_layers} layers, {case}: {launches} launches, {total:.1f} us of kernel time "
          f"({total / num_layers:.1f} us a layer, lm_head and sampling included)\n")
    print("| kernel | launches | total us | us per launch | share |")
    print("| --- | --- | --- | --- | --- |")
    for name, count, us in table:
        print(f"| {name} | {count} | {us:.1f} | {us / count:.2f} | {us / total:.1%} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="moe")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (few: the step is per layer)")
    parser.add_argument("--case", choices=CASES, action="append", help="cases to profile (default: all)")
    args = parser.parse_args(argv)
    if os.environ.get(CHILD_ENV):
        profiled_step(args.model, args.layers, args.case[0])
        return 0
    for case in args.case or CASES:
        profile(args.model, args.layers, case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
