"""The synchronous engine: one step = schedule, execute, post-process.

`LLM` drives it in a plain loop; `AsyncEngine` pipelines it (schedule and
launch step N+1, then collect and post-process step N) with the device work in
a worker thread, so the event loop never blocks on the forward.

The KV block pool is sized once the weights are loaded: on a GPU from
`--gpu-memory-utilization` (what the weights left, less an activation reserve),
on the CPU from `kv_cache_memory_gb`; never more than `max_num_seqs` sequences
of `max_model_len` tokens can use.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..backend import create_backend
from ..backend.base import Ops
from ..backend.dtypes import DType
from ..models.registry import load_model
from ..models.safetensors_reader import checkpoint_numel
from .args import EngineArgs
from .model_runner import LaunchedStep, ModelRunner, SampledToken, nvtx_range
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .request import Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .tokenizer import load_tokenizer

log = logging.getLogger("sparkd.engine")

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"
DEMO_MODEL_NAME = "sparkd-demo"
_SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads the seeds of n > 1 siblings over the 64-bit key space
_GiB = float(1 << 30)
# Kept back from the KV pool besides the activations: loaded kernels, cuBLASLt, the
# sampler's staging, the decode graphs' scratch.
_FIXED_RESERVE_BYTES = 1 << 30
_ALLOCATOR_ROUNDING = 1.25  # the caching allocator's size classes waste at most 25%
# Hybrid models: linear-attention state snapshots the prefix cache keeps, per sequence that can run.
_SNAPSHOTS_PER_SEQUENCE = 4


@dataclass
class LoadedModel:
    """A model with its weights on a backend, ready to serve.

    `load_checkpoint` builds one from EngineArgs; benchmarks build one in memory."""

    ops: Ops
    model: Any  # e.g. DenseForCausalLM: .config, .forward, .compute_logits
    tokenizer: Any  # sparkd.engine.tokenizer.Tokenizer, or None (prompts must be token ids)
    name: str  # the served model name
    source: str  # where it came from, for the logs


def load_checkpoint(args: EngineArgs, progress: Callable[[str], None] | None = None) -> LoadedModel:
    """`args.model` (None: the embedded demo model) on the backend `args.device` asks for.
    progress: gets weight-loading status lines."""
    model_dir = Path(args.model) if args.model else DEMO_MODEL_DIR
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}: --model must be a local Hugging Face checkpoint directory")
    ops = create_backend(args.device, args.dtype, _checkpoint_dtype(model_dir))
    ops.check_weights_fit(checkpoint_numel(model_dir) * ops.dtype.itemsize, args.gpu_memory_utilization)
    name = args.served_model_name or (args.model if args.model else DEMO_MODEL_NAME)
    return LoadedModel(ops, load_model(model_dir, ops, progress), load_tokenizer(model_dir), name, str(model_dir))


class RequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None,
                 progress: Callable[[str], None] | None = None):
        """Serve `loaded`, or the checkpoint `args` names when it is None.
        progress: gets one-line status messages while loading and warming up."""
        self.args = args
        loaded = loaded or load_checkpoint(args, progress)
        self.ops, self.model, self.tokenizer = loaded.ops, loaded.model, loaded.tokenizer
        self.model_name = loaded.name
        self.model_config = cfg = self.model.config
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        hybrid = bool(cfg.linear_attention_layers)
        # A hybrid model's linear-attention state: one slot per sequence that can run at once, then
        # the prefix cache's snapshots of it (StateSnapshots). It comes out of the KV budget first.
        num_state_slots = args.max_num_seqs if hybrid else 0
        num_snapshots = _SNAPSHOTS_PER_SEQUENCE * args.max_num_seqs if hybrid and args.enable_prefix_caching else 0
        # One more slot, last, for a decode graph's padding rows.
        num_pool_slots = num_state_slots + num_snapshots + 1 if hybrid else 0
        state_bytes = num_pool_slots * self._state_slot_bytes()
        num_blocks = args.num_gpu_blocks_override or self._num_kv_blocks(state_bytes)
        log.info("model %s on %s: %d KV blocks of %d tokens (%.2f GiB)", loaded.source, self.ops.name, num_blocks,
                 args.block_size, num_blocks * self._kv_block_bytes() / _GiB)
        self.runner = ModelRunner(self.model, self.ops, self._allocate_caches(num_blocks, num_pool_slots),
                                  args.block_size, args.max_num_seqs, self.max_model_len,
                                  num_pool_slots - 1 if hybrid else None)
        self.ops.load_kernels(progress)
        if args.capture_graphs_at_startup and self.runner.decode_graphs is not None:
            if progress is not None:
                progress("capturing the decode graphs")
            started = time.monotonic()
            self.runner.capture_graphs()
            log.info("captured the decode graphs in %.1f s", time.monotonic() - started)
        self.scheduler = Scheduler(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            num_blocks=num_blocks,
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            num_state_slots=num_state_slots,
            num_state_snapshots=num_snapshots,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        eos = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._rng = np.random.default_rng(args.seed)
        self._groups: dict[str, list[str]] = {}  # user request id -> sequence ids
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def _kv_block_bytes(self) -> int:
        """K and V of one block over the attention layers, in the backend's dtype."""
        cfg = self.model_config
        return (2 * len(cfg.attention_layers) * cfg.num_kv_heads * self.args.block_size * cfg.head_dim
                * self.ops.dtype.itemsize)

    def _allocate_caches(self, num_blocks: int, num_state_slots: int) -> list:
        """Per layer, its (k_cache, v_cache), or for a linear-attention layer its (conv_state,
        recurrent_state) with num_state_slots slots (the running sequences', then the snapshots')."""
        cfg, ops = self.model_config, self.ops
        kv = iter(ops.allocate_kv_cache(len(cfg.attention_layers), num_blocks, self.args.block_size, cfg.num_kv_heads,
                                        cfg.head_dim))
        states = iter([])
        if cfg.linear_attention_layers:
            shape = cfg.delta_net_shape
            states = iter(ops.allocate_linear_attention_state(len(cfg.linear_attention_layers), num_state_slots,
                                                              shape.conv_dim, cfg.linear_conv_kernel_dim,
                                                              shape.num_v_heads, shape.k_dim, shape.v_dim,
                                                              self._state_dtype))
            log.info("linear-attention state: %d slots of %.1f MiB (%s)", num_state_slots,
                     self._state_slot_bytes() / 2**20, self._state_dtype.name)
        return [next(states) if cfg.is_linear_attention_layer(i) else next(kv) for i in range(cfg.num_layers)]

    def _num_kv_blocks(self, state_bytes: int) -> int:
        """The KV pool's blocks: what the budget leaves after `state_bytes` of linear-attention state."""
        args = self.args
        block_bytes = self._kv_block_bytes()
        wanted = args.max_num_seqs * -(-self.max_model_len // args.block_size)
        if hasattr(self.ops, "plan_kv_cache"):  # device memory: what the loaded weights left
            plan = self.ops.plan_kv_cache(block_bytes, args.gpu_memory_utilization,
                                          self._activation_reserve_bytes() + state_bytes)
            return min(wanted, plan.num_blocks)
        budget = int(args.kv_cache_memory_gb * 2**30) - state_bytes
        if state_bytes and budget < block_bytes:
            raise ValueError(f"the linear-attention state pool ({state_bytes / _GiB:.2f} GiB: a slot per sequence "
                             f"of --max-num-seqs and their prefix-cache snapshots) leaves no room for the KV cache in "
                             f"--kv-cache-memory-gb {args.kv_cache_memory_gb}; lower --max-num-seqs or raise it")
        return max(1, min(wanted, budget // block_bytes))

    @property
    def _state_dtype(self) -> DType:
        return DType.parse(self.args.mamba_cache_dtype)

    def _state_slot_bytes(self) -> int:
        """One slot of the linear-attention state over every delta-net layer: the conv window and
        the recurrent state, in --mamba-cache-dtype; 0 for a model without such layers."""
        cfg = self.model_config
        shape = cfg.delta_net_shape
        per_layer = self._state_dtype.itemsize * (shape.conv_dim * max(cfg.linear_conv_kernel_dim - 1, 0)
                                                  + shape.num_v_heads * shape.k_dim * shape.v_dim)
        return len(cfg.linear_attention_layers) * per_layer

    def _activation_reserve_bytes(self) -> int:
        """Device memory one step may need besides weights and KV cache, kept out of the pool.

        The peak is a prefill step of max_num_batched_tokens tokens: per token, the
        widest intermediates alive together (gate_up and its activation, qkv, rotated
        q, the attention output, four hidden-size tensors; with experts, also each of
        the k (token, expert) pairs' hidden and fp32 output rows and the router logits); plus fp32 logits and the
        sampler's workspace for max_num_seqs rows, and the logits every decode graph
        keeps: one [bucket, V] block per batch-size bucket (1, 2, 4, then multiples of
        8 up to max_num_seqs = n), at most n^2 / 16 + 3n / 2 + 7 rows in all. The short-context
        graphs of the buckets whose attention splits (fewer sequences than the device has SMs)
        keep a block each too, out of _FIXED_RESERVE_BYTES: on an H200 15 rows for Llama-3.1-8B,
        159 for Qwen3-Next (92 MiB), whatever n. A hybrid model's delta nets add their in_proj
        and conv outputs and the delta rule's scratch."""
        cfg, args = self.model_config, self.args
        qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        per_token = 3 * cfg.intermediate_size + qkv_width + 2 * cfg.num_heads * cfg.head_dim + 4 * cfg.hidden_size
        if cfg.num_experts:  # per (token, expert) pair: its SiLU'd hidden row, its fp32 output row; router logits
            k = cfg.num_experts_per_tok + cfg.folds_shared_expert  # a folded shared expert is a pair more
            logits = cfg.num_experts + cfg.folds_shared_expert
            per_token += k * cfg.moe_intermediate_size + (2 * k * cfg.hidden_size + logits) * 4 // self.ops.dtype.itemsize
        activations = args.max_num_batched_tokens * per_token * self.ops.dtype.itemsize
        if cfg.linear_attention_layers:  # a delta net's in_proj and conv outputs, its rule's scratch
            shape = cfg.delta_net_shape
            in_proj_width = shape.conv_dim + shape.num_v_heads * (shape.v_dim + 2)
            activations += (args.max_num_batched_tokens * (in_proj_width + shape.conv_dim) * self.ops.dtype.itemsize
                            + self.ops.delta_rule_scratch_bytes(args.max_num_batched_tokens, shape))
        n = args.max_num_seqs
        logits_rows = 2 * n + n * n // 16 + 3 * n // 2 + 7
        return int(_ALLOCATOR_ROUNDING * (activations + logits_rows * cfg.vocab_size * 4)) + _FIXED_RESERVE_BYTES

    # ---- requests ----
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send the prompt as token ids", "prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})", "prompt")
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Validate, tokenize and queue; returns the request id. Raises RequestError."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._groups:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        ids = self.tokenize_prompt(prompt)
        n, limit = len(ids), self.max_model_len
        if n >= limit:
            raise RequestError(f"the prompt is {n} tokens long, but this model's maximum context length is {limit} "
                               f"tokens (the prompt must leave room for at least one generated token)", "prompt")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise RequestError(f"this model's maximum context length is {limit} tokens, but {n + params.max_tokens} were "
                               f"requested ({n} in the prompt, {params.max_tokens} for the completion)", "max_tokens")
        vocab = self.model_config.vocab_size
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"stop token id {bad} is outside the vocabulary [0, {vocab})", "stop_token_ids")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; use stop_token_ids", "stop")
        base_seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
        sequences = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            sequences.append(Request(
                request_id=seq_id, prompt_token_ids=ids, sampling_params=params,
                seed=(base_seed + i * _SEED_STRIDE) % 2**64, eos_token_ids=self.eos_token_ids,
                group_id=request_id, sample_index=i,
            ))
        self.output_processor.add_request(request_id, prompt if isinstance(prompt, str) else None, ids, params, sequences)
        for seq in sequences:
            self.scheduler.add_request(seq)
        self._groups[request_id] = [s.request_id for s in sequences]
        self.prompt_tokens_total += n
        return request_id

    def abort(self, request_id: str) -> None:
        """Finish every sequence of the request and free its blocks; unknown ids are ignored."""
        for seq_id in self._groups.pop(request_id, ()):
            self.scheduler.finish_request(seq_id, RequestStatus.FINISHED_ABORTED)
        self.output_processor.abort(request_id)

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """End one request with an error; the others go on."""
        for seq_id in self._groups.pop(request_id, ()):
            self.scheduler.finish_request(seq_id, RequestStatus.FINISHED_ERROR)
        return self.output_processor.fail(request_id, message)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ----
    def schedule(self) -> SchedulerOutput:
        with nvtx_range("schedule"):
            return self.scheduler.schedule()

    def execute(self, output: SchedulerOutput) -> list[SampledToken | None]:
        """Run the step on the backend. Any exception leaves the step's requests to be
        failed by the caller (`fail`), except DeviceLostError: then the process must exit."""
        return self.runner.execute(output)

    def launch(self, output: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueue the step (async scheduling); `previous` is the step still in flight.
        Errors as for `execute`."""
        return self.runner.launch(output, previous)

    def collect(self, step: LaunchedStep) -> list[SampledToken | None]:
        """Wait for a launched step's tokens. Errors as for `execute`."""
        return self.runner.collect(step)

    def postprocess(self, output: SchedulerOutput, sampled: list[SampledToken | None]) -> list[RequestOutput]:
        updated = self.scheduler.update(output, sampled)
        self.generation_tokens_total += sum(s is not None for s in sampled)
        outputs, stopped, failed = self.output_processor.process(updated)
        for seq_id, _ in stopped:
            self.scheduler.finish_request(seq_id, RequestStatus.FINISHED_STOPPED)
        for seq_id in failed:
            self.scheduler.finish_request(seq_id, RequestStatus.FINISHED_ERROR)
        for out in outputs:
            if out.finished:
                self._groups.pop(out.request_id, None)
        return outputs

    def step(self) -> list[RequestOutput]:
        output = self.schedule()
        if not output.scheduled:
            return []
        return self.postprocess(output, self.execute(output))

    def close(self) -> None:
        """Release the decode graphs; call only while the device is healthy."""
        self.runner.close()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
        )

    # ---- chat ----
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer, so chat is unavailable", "messages")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)


def _checkpoint_dtype(model_dir: Path) -> str:
    cfg = json.loads((model_dir / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"
