"""The engine's host cost per decode step: everything `LLMEngine.step` does but the device work.

    python tools/bench_engine_overhead.py [--batch 1 64 256] [--steps 128] [--generated 0] [--profile 64]

Runs on the CPU: the real LLMEngine (scheduler, KV manager, model runner, sampling
tensors, output processing with the demo model's tokenizer) around a stub model and
stub ops whose forward and sample return at once. The stub still does the host work
of the CUDA backend's decode step that needs no device: it stages the inputs in the
decode graph's layout and packs the sampling parameters. What it leaves out are the
CUDA calls themselves (the copies, the graph launch, the sampler's launch and wait).
Every sequence decodes with a 1k-token context (--generated of it its own output);
greedy and sampled parameters, logprobs off; max_model_len 128k as Llama-3.1-8B's.
Prints ms/step and us/sequence, the best of --repeats timings; --profile B prints
where a batch-B step spends its time (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparkd.backend.base import SampledTokens, SamplerOutput, SamplingTensors  # noqa: E402
from sparkd.backend.cuda.decode_staging import DecodeLayout, stage_decode_inputs  # noqa: E402
from sparkd.backend.cuda.graphs import bucket_for, default_buckets  # noqa: E402
from sparkd.backend.cuda.kernels.sampling import host_inputs  # noqa: E402
from sparkd.backend.cuda.transfer import pack_into, pack_layout  # noqa: E402
from sparkd.engine.args import EngineArgs  # noqa: E402
from sparkd.engine.llm_engine import DEMO_MODEL_DIR, LLMEngine, LoadedModel  # noqa: E402
from sparkd.engine.sampling_params import SamplingParams  # noqa: E402
from sparkd.engine.tokenizer import load_tokenizer  # noqa: E402
from sparkd.models.config import ModelConfig  # noqa: E402

CONTEXT = 1024
MAX_MODEL_LEN = 131072  # Llama-3.1-8B's: sets the width of the padded decode block tables
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
    "sampled": SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=None, ignore_eos=True),
}


def corpus_ids(tokenizer) -> np.ndarray:
    """Real text as token ids (Python's own sources), so the detokenizer sees what it would serve."""
    text = "".join(Path(module.__file__).read_text() for module in (argparse, json.decoder, pstats))
    return np.array(tokenizer.encode(text, add_special_tokens=False), np.int64)


class StubModel:
    """The demo model's config around a forward that computes nothing."""

    def __init__(self, config: ModelConfig):
        self.config = config

    def forward(self, token_ids, positions, attn, kv_caches):
        return token_ids

    def compute_logits(self, hidden, logits_indices):
        return logits_indices  # stands for the logits [B, V]


class HostStaging:
    """StagingRing.upload's host work: pack the arrays into one (here unpinned) slot."""

    def __init__(self):
        self.slot = np.empty(1 << 20, np.uint8)

    def upload(self, arrays) -> None:
        arrays = [np.ascontiguousarray(a) for a in arrays]
        offsets, total = pack_layout([a.nbytes for a in arrays])
        if self.slot.nbytes < total:
            self.slot = np.empty(2 * total, np.uint8)
        pack_into(self.slot, arrays, offsets)


class HostDecodeGraphs:
    """DecodeGraphRunner.run's host work: stage the step in its bucket's layout."""

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int):
        self.buckets = default_buckets(max_batch_size)
        self.layouts = {size: DecodeLayout.for_bucket(size, max_blocks_per_seq) for size in self.buckets}
        self.slot = np.empty(max(layout.total for layout in self.layouts.values()), np.uint8)

    def capture_all(self, forward) -> None:
        pass  # nothing to capture: the stub replays no graph

    def run(self, forward, token_ids, positions, meta, drawn=None):
        layout = self.layouts[bucket_for(len(token_ids), self.buckets)]
        stage_decode_inputs(self.slot, layout, token_ids, positions, meta, drawn=drawn)
        return np.arange(len(token_ids))


class StubOps:
    """Ops whose device work is free. `sample` draws the next token of each row from a text
    corpus (row offset from its seed, position from its step), after packing the sampling
    parameters as the CUDA sampler does."""

    name = "stub"
    dtype = np.dtype(np.float32)

    def __init__(self, corpus: np.ndarray):
        self.corpus = corpus
        self.staging = HostStaging()

    def upload(self, array, dtype=None):
        return array

    def allocate_kv_cache(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim):
        return [(None, None)] * num_layers

    def allocate_linear_attention_state(self, num_layers, num_slots, *sizes):
        return [(None, None)] * num_layers  # the demo model is a hybrid: its delta nets' state

    def bind_thread(self) -> None:
        pass

    def load_kernels(self, progress=None) -> None:
        pass

    def decode_graph_runner(self, max_batch_size, max_blocks_per_seq, max_seq_len, padding_state_slot=None):
        return HostDecodeGraphs(max_batch_size, max_blocks_per_seq)

    def prepare_attention(self, meta):
        return meta

    def sample_async(self, logits, params: SamplingTensors) -> SampledTokens:
        self.staging.upload(host_inputs(params))
        rows = (params.seeds % len(self.corpus)).astype(np.int64) + params.steps
        out = SamplerOutput(token_ids=self.corpus[rows % len(self.corpus)])
        return SampledTokens(out.token_ids.astype(np.int32), lambda: out)

    def copy_drawn_tokens_(self, token_ids, drawn) -> None:
        pass  # the stub forward reads no token ids


def build_engine(loaded: LoadedModel, batch: int, steps: int, repeats: int, block_size: int = 16) -> LLMEngine:
    # Early prompts decode while later ones are computed: room for those tokens too, and
    # for the warm-up, the timed (repeats times) and the profiled steps.
    max_tokens_per_seq = 2 * CONTEXT + (repeats + 1) * steps + 64
    args = EngineArgs(max_model_len=MAX_MODEL_LEN, max_num_seqs=batch, block_size=block_size,
                      num_gpu_blocks_override=batch * -(-max_tokens_per_seq // block_size))
    return LLMEngine(args, loaded)


def start_decoding(engine: LLMEngine, corpus: np.ndarray, batch: int, params: SamplingParams, generated: int) -> None:
    """Queue `batch` distinct prompts of CONTEXT - `generated` tokens and step until every
    sequence has generated at least `generated` tokens (and one more for the warm-up)."""
    prompt_len = CONTEXT - generated
    for i in range(batch):
        start = (i * 7919) % (len(corpus) - prompt_len)
        engine.add_request(corpus[start : start + prompt_len].tolist(), params)
    scheduler = engine.scheduler
    while scheduler.num_waiting or min(r.num_output_tokens for r in scheduler.running) <= generated:
        engine.step()
    for _ in range(16):  # warm-up
        engine.step()


def time_steps(engine: LLMEngine, batch: int, steps: int) -> float:
    """Mean seconds per `LLMEngine.step` over `steps` all-decode steps."""
    start = time.perf_counter()
    for _ in range(steps):
        outputs = engine.step()
        if len(outputs) != batch:
            raise RuntimeError("a sequence stopped or was preempted; the step's shape changed")
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=128, help="timed decode steps per case")
    parser.add_argument("--repeats", type=int, default=3, help="report the best of this many timings "
                        "(other processes on the machine only ever add time)")
    parser.add_argument("--generated", type=int, default=0, help="tokens each sequence generates before the "
                        "timed steps, out of its CONTEXT-token context: costs that grow with the output show")
    parser.add_argument("--profile", type=int, metavar="B", help="cProfile the sampled batch-B case")
    parser.add_argument("--profile-lines", type=int, default=30)
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    config = ModelConfig.from_hf(json.loads((DEMO_MODEL_DIR / "config.json").read_text()))
    corpus = corpus_ids(tokenizer)
    print(f"# host cost of LLMEngine.step, device work stubbed; {CONTEXT}-token contexts ({args.generated} "
          f"generated), max_model_len {MAX_MODEL_LEN}, demo tokenizer, logprobs off")
    print("\n| batch | params | ms/step | us/sequence |\n| --- | --- | --- | --- |")
    for batch in args.batch:
        for name, params in PARAMS.items():
            loaded = LoadedModel(StubOps(corpus), StubModel(config), tokenizer, "stub", "stub")
            engine = build_engine(loaded, batch, args.steps, args.repeats)
            start_decoding(engine, corpus, batch, params, args.generated)
            seconds = min(time_steps(engine, batch, args.steps) for _ in range(args.repeats))
            print(f"| {batch} | {name} | {seconds * 1e3:.3f} | {seconds * 1e6 / batch:.1f} |", flush=True)
            if args.profile == batch and name == "sampled":
                profiler = cProfile.Profile()
                profiler.runcall(time_steps, engine, batch, args.steps)
                print(f"\n# cProfile, batch {batch}, {args.steps} steps")
                pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile_lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
