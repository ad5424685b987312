"""Request body -> SamplingParams, with errors that name the client's field.

The server's limits (ServerLimits) are checked first, so a value over them is
refused in the server's words; SamplingParams then checks every value range."""

from __future__ import annotations

from ..engine.sampling_params import SamplingParams
from .errors import APIError, bad_request
from .limits import ServerLimits
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

_DEFAULT_LIMITS = ServerLimits()


def completion_sampling_params(req: CompletionRequest, limits: ServerLimits = _DEFAULT_LIMITS) -> SamplingParams:
    return _build(req, limits, max_tokens=req.max_tokens, logprobs=req.logprobs, renamed={})


def chat_sampling_params(req: ChatCompletionRequest, limits: ServerLimits = _DEFAULT_LIMITS) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # max_completion_tokens replaces the deprecated max_tokens; it wins when both are sent.
    if req.max_completion_tokens is not None:
        max_tokens, max_tokens_field = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_tokens_field = req.max_tokens, "max_tokens"
    return _build(req, limits, max_tokens=max_tokens, logprobs=logprobs,
                  renamed={"logprobs": "top_logprobs", "max_tokens": max_tokens_field})


def _build(req: SamplingFields, limits: ServerLimits, *, max_tokens: int | None, logprobs: int | None,
           renamed: dict[str, str]) -> SamplingParams:
    """renamed: SamplingParams field -> the request field it came from (for error messages)."""
    limits.check_sampling(n=req.n, max_tokens=max_tokens, max_tokens_field=renamed.get("max_tokens", "max_tokens"),
                          min_tokens=req.min_tokens, stop=req.stop)
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            skip_special_tokens=req.skip_special_tokens,
        )
    except ValueError as exc:
        raise _named(exc, renamed) from None


def _named(exc: ValueError, renamed: dict[str, str]) -> APIError:
    """SamplingParams says "<field> must be ..."; point `param` at the client's name for it."""
    message = str(exc)
    field = message.split(" ", 1)[0]
    if field not in SamplingParams.__dataclass_fields__:
        return bad_request(message)
    param = renamed.get(field, field)
    if param != field:
        message = param + message[len(field):]
    return bad_request(message, param)
