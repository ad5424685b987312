"""What the engine hands back for a request, streamed step by step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Logprob of one token position: the chosen token plus the top alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float] = field(default_factory=dict)  # token id -> logprob, most likely first


@dataclass
class CompletionOutput:
    """One of the `n` sequences of a request.

    token_ids/text/logprobs are cumulative; `text_delta` and `num_new_tokens`
    describe only what this update added (for streaming).
    finish_reason: None while running, else "stop", "length", "abort" or "error".
    stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_delta: str = ""
    num_new_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A snapshot of a request after a step.

    `error` carries a message when the request failed (finish_reason "error").
    `num_cached_tokens` is the prompt prefix served from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
