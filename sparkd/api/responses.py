"""Response bodies and stream chunks of the OpenAI routes, as msgspec Structs.

Fields that OpenAI sends as `null` stay in the JSON as `null`; only `usage`
on stream chunks is left out unless the client asked for it.
"""

from __future__ import annotations

import msgspec

from .errors import ErrorInfo


class UsageInfo(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# ---- /v1/completions ----
class CompletionLogprobs(msgspec.Struct):
    """Legacy completions format; one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM extra: the stop string or token id that matched


class CompletionResponse(msgspec.Struct, omit_defaults=True):
    """Both the full response and a stream chunk (OpenAI uses one object type for both)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions ----
class ChatTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


# ---- /v1/models ----
class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "sparkd"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


# ---- /v1/ws ----
class WSChunk(msgspec.Struct, kw_only=True):
    id: str
    type: str = "chunk"
    data: CompletionResponse | ChatCompletionChunk


class WSDone(msgspec.Struct, kw_only=True):
    """The last frame of a request; `cancelled` is set when the client cancelled it."""

    id: str
    type: str = "done"
    usage: UsageInfo
    cancelled: bool = False


class WSError(msgspec.Struct, kw_only=True):
    id: str | None
    type: str = "error"
    error: ErrorInfo
