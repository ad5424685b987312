"""The synchronous engine: one step = schedule, execute, post-process.

`LLM` drives it in a plain loop; `AsyncEngine` runs `execute` in a worker
thread so the event loop never blocks on the forward.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..backend import create_backend
from ..models.registry import load_model
from .args import EngineArgs
from .model_runner import ModelRunner, SampledToken
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
    def __init__(self, args: EngineArgs):
        self.args = args
        model_dir = Path(args.model) if args.model else DEMO_MODEL_DIR
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}: --model must be a local Hugging Face checkpoint directory")
        self.model_name = args.served_model_name or (args.model if args.model else DEMO_MODEL_NAME)
        self.ops = create_backend(args.device, args.dtype, _checkpoint_dtype(model_dir))
        self.model = load_model(model_dir, self.ops)
        self.model_config = cfg = self.model.config
        self.tokenizer = load_tokenizer(model_dir)
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        num_blocks = args.num_gpu_blocks_override or self._kv_blocks_for_budget()
        log.info("model %s on %s: %d KV blocks of %d tokens", model_dir, self.ops.name, num_blocks, args.block_size)
        kv_caches = self.ops.allocate_kv_cache(cfg.num_layers, num_blocks, args.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.runner = ModelRunner(self.model, self.ops, kv_caches, args.block_size, args.max_num_seqs, self.max_model_len)
        self.scheduler = Scheduler(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            num_blocks=num_blocks,
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
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

    def _kv_blocks_for_budget(self) -> int:
        cfg, bs = self.model_config, self.args.block_size
        bytes_per_block = 2 * cfg.num_layers * cfg.num_kv_heads * bs * cfg.head_dim * 4
        wanted = self.args.max_num_seqs * -(-self.max_model_len // bs)
        return max(1, min(wanted, int(self.args.kv_cache_memory_gb * 2**30 // bytes_per_block)))

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
        return self.scheduler.schedule()

    def execute(self, output: SchedulerOutput) -> list[SampledToken | None]:
        return self.runner.execute(output)

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
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"
