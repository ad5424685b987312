"""POST /v1/completions: prompts in, `text_completion` objects out."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from ..engine.outputs import CompletionOutput, RequestOutput
from .errors import bad_request
from .job import Job
from .logprobs import TokenText, completion_logprobs, new_logprobs
from .params import completion_sampling_params
from .protocol import CompletionRequest
from .responses import CompletionChoice, CompletionResponse, UsageInfo
from .state import ServerState

# One request may not flood the scheduler with prompts.
MAX_PROMPTS = 256


def prepare_completion(state: ServerState, req: CompletionRequest) -> Job:
    model = state.resolve_model(req.model)
    params = completion_sampling_params(req, state.limits)
    prompts = _prompt_list(req.prompt)
    fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", int(time.time()), model,
                           state.token_text if params.logprobs is not None else None)
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return Job(fmt.id, prompts, params, req.stream, include_usage, fmt)


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""

    def is_token_ids(x: object) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if is_token_ids(prompt):
        prompts = [prompt]
    elif all(isinstance(p, str) for p in prompt) or all(is_token_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids, "
                          "or a list of lists of token ids", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    return prompts


@dataclass
class CompletionFormat:
    """Builds chunks and the final body; token_text is None when no logprobs were asked for."""

    id: str
    created: int
    model: str
    token_text: TokenText | None

    def opening_chunks(self, num_choices: int) -> list[CompletionResponse]:
        return []

    def chunk(self, index: int, seq: CompletionOutput) -> CompletionResponse:
        logprobs = None
        if self.token_text is not None:
            start = len(seq.text) - len(seq.text_delta)
            logprobs = completion_logprobs(new_logprobs(seq), self.token_text, start)
        choice = CompletionChoice(index, seq.text_delta, logprobs, seq.finish_reason, seq.stop_reason)
        return self._body([choice])

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return self._body([], usage)

    def response(self, outputs: list[RequestOutput], n: int, usage: UsageInfo) -> CompletionResponse:
        choices = []
        for prompt_index, out in enumerate(outputs):
            for seq in out.outputs:
                logprobs = None
                if self.token_text is not None:
                    logprobs = completion_logprobs(seq.logprobs or [], self.token_text, 0)
                choices.append(CompletionChoice(prompt_index * n + seq.index, seq.text, logprobs,
                                                seq.finish_reason, seq.stop_reason))
        choices.sort(key=lambda c: c.index)
        return self._body(choices, usage)

    def _body(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(self.id, "text_completion", self.created, self.model, choices, usage)
