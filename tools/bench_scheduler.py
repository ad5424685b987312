"""The engine's own cost per decode step, no forward: schedule + input preparation
(flat inputs and sampling tensors) + update.

    python tools/bench_scheduler.py [--num-seqs 256] [--steps 512] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import time

from sparkd.engine.block_table import PersistentBlockTable
from sparkd.engine.model_runner import prepare_inputs
from sparkd.engine.request import Request
from sparkd.engine.sampling_batch import SamplingBatch
from sparkd.engine.sampling_params import SamplingParams
from sparkd.engine.scheduler import Scheduler

TARGET_MS_PER_STEP = 1.0


def build_running_scheduler(num_seqs: int, prompt_len: int, num_steps: int, block_size: int,
                            enable_prefix_caching: bool) -> Scheduler:
    """A scheduler whose `num_seqs` distinct prompts are computed, so every later step is all decodes."""
    # Room for the decodes of the filling steps, the warm-up and the timed steps, so no sequence stops.
    max_model_len = 2 * (prompt_len + num_steps) + 64
    blocks_per_seq = -(-max_model_len // block_size)
    scheduler = Scheduler(max_num_seqs=num_seqs, max_num_batched_tokens=max(8192, num_seqs),
                          max_model_len=max_model_len, num_blocks=num_seqs * blocks_per_seq,
                          block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [(i * prompt_len + j) % 50_000 for j in range(prompt_len)]
        scheduler.add_request(Request(f"bench-{i}", prompt, params, seed=i))
    while scheduler.num_waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        output = scheduler.schedule()
        scheduler.update(output, [(1, None)] * len(output.scheduled))
    return scheduler


def time_steps(scheduler: Scheduler, block_table: PersistentBlockTable, num_steps: int) -> float:
    """Mean milliseconds per step of schedule + prepare_inputs + sampling tensors + update."""
    sampled = [(7, None)] * scheduler.num_running  # what the sampler hands back; built once, outside the clock
    block_size = scheduler.kv.block_size
    sampling_batch = SamplingBatch()  # as the model runner keeps one
    start = time.perf_counter()
    for _ in range(num_steps):
        output = scheduler.schedule()
        prepare_inputs(output.scheduled, block_table, block_size)
        sampling_batch.tensors([s.request for s in output.scheduled])
        scheduler.update(output, sampled)
    elapsed = time.perf_counter() - start
    if scheduler.num_running != len(sampled):
        raise RuntimeError("a sequence stopped or was preempted during the benchmark; its shape changed")
    return elapsed * 1e3 / num_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    args = parser.parse_args()
    scheduler = build_running_scheduler(args.num_seqs, args.prompt_len, args.steps, args.block_size,
                                        args.enable_prefix_caching)
    block_table = PersistentBlockTable(2 * args.num_seqs, -(-scheduler.max_model_len // args.block_size))
    time_steps(scheduler, block_table, 16)  # warm-up
    ms_per_step = time_steps(scheduler, block_table, args.steps)
    print(f"schedule + prepare_inputs + sampling tensors + update: {ms_per_step:.3f} ms/step with {scheduler.num_running} running sequences, "
          f"{ms_per_step / TARGET_MS_PER_STEP:.2f}x the {TARGET_MS_PER_STEP:g} ms target "
          f"(block size {args.block_size}, prefix caching {'on' if args.enable_prefix_caching else 'off'})")


if __name__ == "__main__":
    main()
