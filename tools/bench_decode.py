"""Llama-3.1-8B-shaped bf16 decode and prefill through the engine, against the rooflines and transformers.

  python tools/bench_decode.py [--layers 32] [--steps 64] [--no-transformers]

Random weights are made on the device, so no checkpoint is needed. Decode runs three
ways: served (the AsyncEngine loop of `sparkd serve`, which prepares step N+1 while
step N runs: what a request sees), sequential (`LLMEngine.step`: scheduling, input
preparation, graph replay, sampling, output processing one after the other), and
the forward alone (back-to-back replays of the captured decode graph, timed by
events), so host overhead shows as the gaps between them.
- batch-1 decode after a 128-token prompt;
- batch-64 decode, every context 1k tokens;
- one 8k-token prompt, computed in a single prefill step.
Ceilings, measured in the same run: a decode step must read every weight but the
embedding table, plus the KV cache of every context, at the device-to-device copy
rate (bytes read plus written, as GPU-FACTS.md counts it); the prefill's model FLOPs
(2 per weight per token, 4 * Hq * D per causal (query, key) pair) run at most at the
rate of a bf16 8192^3 GEMM. The peer: transformers' generate with the static cache
(which it compiles), batch 1, in the same process, the best of 3 runs after a warm-up,
when torch and CUDA are there (bench_peer.py).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import RandomDeviceWeights, best_seconds, copy_bandwidth, verdict  # noqa: E402
from bench_gemm import gemm_rate  # noqa: E402
from bench_peer import print_peer, transformers_decode  # noqa: E402

from sparkd import SamplingParams  # noqa: E402
from sparkd.backend.cuda.ops import CudaOps  # noqa: E402
from sparkd.backend.cuda.tensor import DeviceTensor  # noqa: E402
from sparkd.engine.args import EngineArgs  # noqa: E402
from sparkd.engine.async_engine import AsyncEngine  # noqa: E402
from sparkd.engine.llm_engine import LLMEngine, LoadedModel  # noqa: E402
from sparkd.engine.model_runner import prepare_inputs  # noqa: E402
from sparkd.models.config import ModelConfig  # noqa: E402
from sparkd.models.dense import DenseForCausalLM  # noqa: E402

LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}
PROMPT_LEN = 128
BATCH, CONTEXT = 64, 1024
PREFILL_LEN = 8192
WARMUP_STEPS = 2  # the first decode step of a batch size captures its graph
# The targets.
BATCH1_ROOFLINE, BATCH1_TOKENS_PER_S, VS_TRANSFORMERS = 0.85, 225.0, 1.8
BATCH64_ROOFLINE, PREFILL_GEMM = 0.70, 0.55


def random_device_weights(config: ModelConfig, ops: CudaOps, seed: int = 0,
                          mlp_weights=None) -> dict[str, DeviceTensor]:
    """Every weight DenseForCausalLM takes, made on the device in ops.dtype
    (RandomDeviceWeights): matrices ~ N(0, 1/fan_in) (the embedding N(0, 1)), norms 1, biases 0.

    mlp_weights(prefix, matrix) -> {name: tensor}: a layer's MLP weights in place of the
    dense MLP's (mixture of experts), matrix(shape, fan_in) making each."""
    make = RandomDeviceWeights(ops.allocator, ops.stream, ops.dtype, seed)
    matrix, filled = make.matrix, make.filled
    c = config
    hidden, q_width = c.hidden_size, c.num_heads * c.head_dim
    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    weights = {"model.embed_tokens.weight": matrix((c.vocab_size, hidden), 1), "model.norm.weight": filled(hidden, 1)}
    if not c.tie_word_embeddings:
        weights["lm_head.weight"] = matrix((c.vocab_size, hidden), hidden)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": filled(hidden, 1), p + "post_attention_layernorm.weight": filled(hidden, 1),
            p + "self_attn.qkv_proj.weight": matrix((qkv_rows, hidden), hidden),
            p + "self_attn.o_proj.weight": matrix((hidden, q_width), q_width),
        }
        if mlp_weights is not None:
            weights |= mlp_weights(p + "mlp.", matrix)
        else:
            weights |= {p + "mlp.gate_up_proj.weight": matrix((2 * c.intermediate_size, hidden), hidden),
                        p + "mlp.down_proj.weight": matrix((hidden, c.intermediate_size), c.intermediate_size)}
        optional = {  # name: (present, size, value)
            "self_attn.qkv_proj.bias": (c.qkv_bias, qkv_rows, 0),
            "self_attn.o_proj.bias": (c.o_proj_bias, hidden, 0),
            "mlp.gate_up_proj.bias": (c.mlp_bias, 2 * c.intermediate_size, 0),
            "mlp.down_proj.bias": (c.mlp_bias, hidden, 0),
            "self_attn.q_norm.weight": (c.qk_norm, c.head_dim, 1),
            "self_attn.k_norm.weight": (c.qk_norm, c.head_dim, 1),
        }
        weights |= {p + name: filled(size, value) for name, (present, size, value) in optional.items() if present}
    return weights


@dataclass
class Model:
    engine: LLMEngine
    config: ModelConfig
    decode_weight_bytes: int  # what one decode step reads of the weights: all but the embedding table

    def step_weight_bytes(self, batch: int) -> float:
        """Weight bytes a decode step of `batch` sequences reads."""
        return self.decode_weight_bytes

    def kv_bytes(self, num_tokens: float) -> float:
        c = self.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.engine.ops.dtype.itemsize * num_tokens

    def prefill_flops(self, length: int) -> float:
        """Model FLOPs of one prompt: every linear layer per token, causal attention, lm_head for the last token."""
        c = self.config
        per_layer = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size \
            + c.num_heads * c.head_dim * c.hidden_size + 3 * c.intermediate_size * c.hidden_size
        attention_pairs = length * (length + 1) / 2
        return (2 * per_layer * length + 4 * c.num_heads * c.head_dim * attention_pairs) * c.num_layers \
            + 2 * c.vocab_size * c.hidden_size


def build_model(ops: CudaOps, num_layers: int, steps: int, gpu_memory_utilization: float) -> Model:
    config = ModelConfig.from_hf({**LLAMA_3_1_8B, "num_hidden_layers": num_layers})
    weights = random_device_weights(config, ops)
    weight_bytes = sum(t.nbytes for t in weights.values())
    if not config.tie_word_embeddings:
        weight_bytes -= weights["model.embed_tokens.weight"].nbytes  # decode reads one row of it per sequence
    model = DenseForCausalLM(config, ops, weights)
    args = EngineArgs(device="cuda", dtype="bfloat16", max_model_len=PREFILL_LEN + steps + 16, max_num_seqs=BATCH,
                      max_num_batched_tokens=PREFILL_LEN, enable_prefix_caching=False,
                      gpu_memory_utilization=gpu_memory_utilization)
    loaded = LoadedModel(ops, model, None, "llama-3.1-8b-shaped", "random bf16 weights made on the device")
    return Model(LLMEngine(args, loaded), config, weight_bytes)


def run_decode(model: Model, batch: int, context: int, steps: int, copy_rate: float, rng) -> tuple[float, float, float]:
    """(engine tokens/s, forward seconds, floor seconds per step) over `steps` decode steps of
    `batch` sequences with `context`-token prompts."""
    engine = model.engine
    # Sequences whose prompts finish early decode while later prompts are computed: leave them room.
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 64, ignore_eos=True)
    ids = [engine.add_request(rng.integers(0, model.config.vocab_size, context).tolist(), params)
           for _ in range(batch)]
    scheduler = engine.scheduler
    while scheduler.num_waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        engine.step()  # the prompts, in steps of PREFILL_LEN tokens
    for _ in range(WARMUP_STEPS):
        engine.step()
    forward_seconds = decode_forward_seconds(engine)
    context_tokens = sum(request.num_tokens for request in scheduler.running)
    start = time.perf_counter()
    for _ in range(steps):
        outputs = engine.step()
        assert len(outputs) == batch, "every sequence must decode in every timed step"
    engine_seconds = time.perf_counter() - start
    for request_id in ids:
        engine.abort(request_id)
    kv_bytes = model.kv_bytes(context_tokens + batch * steps / 2)  # the mean over the timed steps
    floor_seconds = (model.step_weight_bytes(batch) + kv_bytes) / copy_rate
    return batch * steps / engine_seconds, forward_seconds, floor_seconds


def run_served_decode(model: Model, cases: list[tuple[int, int]], steps: int, rng) -> list[float]:
    """Tokens/s of each (batch, context) decode case through the AsyncEngine loop on uvloop,
    over the steps in which every sequence of the batch got a token (prompts and the first
    WARMUP_STEPS decode steps excluded). Shuts the engine down at the end."""
    import uvloop

    engine = AsyncEngine(model.engine)
    core = model.engine
    step_times: list[tuple[float, int]] = []
    postprocess = core.postprocess
    core.postprocess = lambda output, sampled: (step_times.append((time.perf_counter(), len(output.scheduled))),
                                                postprocess(output, sampled))[1]

    async def one_case(batch: int, context: int) -> float:
        # The first sequences decode while later prompts are computed: leave them room for that too.
        prefill_steps = -(-batch * context // core.args.max_num_batched_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=prefill_steps + WARMUP_STEPS + steps, ignore_eos=True)
        step_times.clear()
        streams = [engine.add_request(rng.integers(0, model.config.vocab_size, context).tolist(), params)
                   for _ in range(batch)]
        for stream in streams:
            async for _ in stream:
                pass
        full = [t for t, n in step_times if n == batch][WARMUP_STEPS:]
        if len(full) < 2:
            raise RuntimeError(f"only {len(full)} timed steps had all {batch} sequences: raise --steps")
        return batch * (len(full) - 1) / (full[-1] - full[0])

    async def scenario() -> list[float]:
        await engine.start()
        try:
            return [await one_case(batch, context) for batch, context in cases]
        finally:
            await engine.shutdown()

    return uvloop.run(scenario())


def decode_forward_seconds(engine: LLMEngine, reps: int = 20) -> float:
    """GPU seconds of one decode forward: back-to-back replays of the next step's graph.
    The step is then run for real, so the engine's books stay straight."""
    output = engine.schedule()
    runner = engine.runner
    inputs = prepare_inputs(output.scheduled, runner.block_table, engine.args.block_size, runner.uses_state_slots)
    assert inputs.is_decode, "the next step is not a decode step"

    def forwards() -> None:
        for _ in range(reps):
            runner.decode_graphs.run(runner.decode_forward, inputs.token_ids, inputs.positions, inputs.attn)

    seconds = best_seconds(engine.ops.stream, forwards, reps=3) / reps
    engine.postprocess(output, engine.execute(output))
    return seconds


def run_prefill(model: Model, length: int, reps: int, rng) -> tuple[float, float]:
    """(best, median) seconds of `reps` engine steps that each compute a `length`-token prompt and
    sample its first token. The best is what the GEMM-rate ceiling is taken as too (best_seconds)."""
    engine = model.engine
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times = []
    for rep in range(reps + 1):  # the first run plans this shape's GEMMs
        engine.add_request(rng.integers(0, model.config.vocab_size, length).tolist(), params)
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        assert len(outputs) == 1 and outputs[0].finished, "the prompt must be computed in one step"
        if rep:
            times.append(seconds)
    return min(times), statistics.median(times)


def measure_ceilings(shape: str, fused_norms: bool = False) -> tuple[CudaOps, float, float]:
    """Set up logging and a bf16 CudaOps (with fused_norms, one that runs a one-row step's pre-norms
    inside the GEMVs); measure and print the copy rate (bytes/s) and the bf16 8192^3 GEMM rate (FLOP/s)."""
    logging.basicConfig(level=logging.WARNING, format="# %(name)s: %(message)s")
    logging.getLogger("sparkd").setLevel(logging.INFO)  # the KV plan and the graph captures
    ops = CudaOps(dtype="bfloat16")
    ops.fuse_norms = fused_norms
    if fused_norms:
        shape += ", pre-norms inside the GEMVs at batch 1"
    copy_rate = copy_bandwidth(ops.allocator, ops.stream)
    gemm_flops = gemm_rate(ops.gemm, ops.allocator, ops.stream, ops.dtype)
    print(f"# {ops.device.name}: copy {copy_rate / 1e12:.2f} TB/s (read + written), bf16 GEMM 8192^3 "
          f"{gemm_flops / 1e12:.0f} TFLOP/s; {shape}", flush=True)
    return ops, copy_rate, gemm_flops


def print_engine_measures(model: Model, cases, prefill: tuple[int, float | None, int], steps: int, copy_rate: float,
                          gemm_flops: float, rng) -> list[float]:
    """Print the table: each (batch, context, target) decode case sequential and forward-only, the
    (length, target, reps) prefill, then each case served (a target None: the issue sets none).
    Returns the served tokens/s per case."""
    print("\n| measure | sparkd | ceiling | fraction | target |\n| --- | --- | --- | --- | --- |")
    measured = []
    for batch, context, target in cases:
        tokens_per_s, forward_seconds, floor_seconds = run_decode(model, batch, context, steps, copy_rate, rng)
        measured.append((batch, context, target, batch / floor_seconds))
        for how, value in (("sequential step", tokens_per_s), ("forward only", batch / forward_seconds)):
            print_decode_row(batch, context, how, value, batch / floor_seconds, target)
    length, target, reps = prefill
    prefill_seconds, median_seconds = run_prefill(model, length, reps=reps, rng=rng)
    prefill_flops = model.prefill_flops(length) / prefill_seconds
    print(f"| {length}-token prefill, engine step (best {prefill_seconds * 1e3:.1f} ms, median "
          f"{median_seconds * 1e3:.1f} ms of {reps}) | "
          f"{prefill_flops / 1e12:.0f} TFLOP/s | {gemm_flops / 1e12:.0f} TFLOP/s | {prefill_flops / gemm_flops:.3f} | "
          f"{verdict(prefill_flops / gemm_flops, target)} |", flush=True)
    served = run_served_decode(model, [(batch, context) for batch, context, _, _ in measured], steps, rng)
    for (batch, context, target, roofline), tokens_per_s in zip(measured, served):
        print_decode_row(batch, context, "served (AsyncEngine)", tokens_per_s, roofline, target)
    return served


def print_decode_row(batch: int, context: int, how: str, tokens_per_s: float, roofline: float,
                     target: float | None) -> None:
    print_rate_row(f"batch-{batch} decode, {context}-token context, {how}", tokens_per_s, roofline, target)


def print_rate_row(measure: str, tokens_per_s: float, roofline: float, target: float | None) -> None:
    """A table row: tokens/s against a roofline in tokens/s, their fraction and its verdict."""
    print(f"| {measure} | {tokens_per_s:.1f} tok/s | {roofline:.1f} tok/s | {tokens_per_s / roofline:.3f} | "
          f"{verdict(tokens_per_s / roofline, target)} |", flush=True)


def parse_bench_args(description: str, layers: int, steps: int, argv: list[str] | None) -> argparse.Namespace:
    """The options bench_decode.py and bench_moe.py share; `layers`: the real shape's count."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=layers, help=f"decoder layers ({layers} for the real shape)")
    parser.add_argument("--steps", type=int, default=steps, help="timed decode steps per case")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="sparkd's share of the GPU; the rest is left to transformers (default %(default)s)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--fused-norms", action="store_true",
                        help="run a batch-1 step's pre-norms inside the GEMVs after them (gemv_norm.cu), "
                             "against the default's norm kernels")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_bench_args(__doc__, layers=32, steps=64, argv=argv)
    ops, copy_rate, gemm_flops = measure_ceilings(f"Llama-3.1-8B shape with {args.layers} layers",
                                                  args.fused_norms)
    model = build_model(ops, args.layers, args.steps, args.gpu_memory_utilization)
    rng = np.random.default_rng(0)
    cases = ((1, PROMPT_LEN, BATCH1_ROOFLINE), (BATCH, CONTEXT, BATCH64_ROOFLINE))
    served = print_engine_measures(model, cases, (PREFILL_LEN, PREFILL_GEMM, 5), args.steps, copy_rate, gemm_flops, rng)
    batch1_tokens_per_s = served[0]
    # The issue's own roofline (GPU-FACTS.md's: 16.06 GB / 4.29 TB/s = 267 tok/s, whence its 225
    # tok/s) counts the embedding table too, which the ceiling above leaves out.
    every_weight = copy_rate / (model.decode_weight_bytes + model.config.vocab_size * model.config.hidden_size
                                * ops.dtype.itemsize)
    print_rate_row("batch-1 decode, served, against every weight byte at the copy rate (GPU-FACTS.md's roofline)",
                   batch1_tokens_per_s, every_weight, BATCH1_ROOFLINE)
    print(f"| batch-1 decode, served | {batch1_tokens_per_s:.1f} tok/s | | | "
          f"{verdict(batch1_tokens_per_s, BATCH1_TOKENS_PER_S)} tok/s (on an H200) |", flush=True)

    peer = None if args.no_transformers else transformers_decode(LLAMA_3_1_8B, "llama", args.layers, PROMPT_LEN,
                                                                 PROMPT_LEN)
    print_peer(peer, "static cache, compiled", PROMPT_LEN, PROMPT_LEN, batch1_tokens_per_s, VS_TRANSFORMERS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
