"""Request bodies of the OpenAI routes, as msgspec Structs.

Fields follow the OpenAI API plus vLLM's sampling extras. Unknown fields are
rejected with 400, as OpenAI itself does (vLLM instead ignores them with a
warning): a parameter we silently drop would change the result behind the
client's back. Types are checked strictly ("5" is not an integer); value
ranges are checked by `SamplingParams`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

# vLLM bounds the seed to a signed 64-bit integer.
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions. `prompt` is a string, a list of strings, a list of
    token ids, or a list of token-id lists (a batch: each prompt gets `n` choices)."""

    prompt: str | list[Any]
    max_tokens: int | None = 16
    logprobs: int | None = None


class TextPart(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    text: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content always a string."""
        out = msgspec.structs.asdict(self)
        if isinstance(self.content, list):
            out["content"] = "\n".join(part.text for part in self.content)
        elif self.content is None:
            out["content"] = ""
        return {k: v for k, v in out.items() if v is not None}


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions. max_tokens None means up to the context length."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM extras for the chat template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class WSClientMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One frame a WebSocket client sends: a request (with `body`) or a cancel.
    `body` stays raw until `type` says which Struct to decode it into; empty when absent."""

    id: str
    type: Literal["chat.completions", "completions", "cancel"]
    body: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


REQUEST_TYPES: dict[str, type[SamplingFields]] = {
    "chat.completions": ChatCompletionRequest,
    "completions": CompletionRequest,
}
