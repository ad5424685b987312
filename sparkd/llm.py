"""Offline batch generation in the spirit of vLLM's `LLM`."""

from __future__ import annotations

from typing import Sequence

from .engine.args import EngineArgs
from .engine.llm_engine import LLMEngine
from .engine.outputs import RequestOutput
from .engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM(model_dir, device="auto"|"cpu"|"cuda", **engine_args)`; model None = the demo model."""

    def __init__(self, model: str | None = None, device: str = "auto", **engine_args):
        self.engine = LLMEngine(EngineArgs(model=model, device=device, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. A prompt is text or a list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             add_generation_prompt: bool = True, **template_kwargs) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.render_chat(c, add_generation_prompt, **template_kwargs) for c in conversations]
        token_ids = [self.engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_ids, params)
