"""POST /v1/chat/completions: messages rendered by the model's chat template, then generated."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from ..engine.outputs import CompletionOutput, RequestOutput
from .errors import bad_request
from .job import Job
from .logprobs import TokenText, chat_logprobs, new_logprobs
from .params import chat_sampling_params
from .protocol import ChatCompletionRequest
from .responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    UsageInfo,
)
from .state import ServerState

# Template inputs a client may not set through chat_template_kwargs: they have request fields,
# or (tokenize) would change what the renderer returns.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tokenize",
                                       "tools", "documents"})


def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> Job:
    model = state.resolve_model(req.model)
    params = chat_sampling_params(req, state.limits)
    prompt = _prompt_token_ids(state, req)
    fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model,
                     state.token_text if params.logprobs is not None else None)
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return Job(fmt.id, [prompt], params, req.stream, include_usage, fmt)


def _prompt_token_ids(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """The rendered conversation as token ids. The template writes every special token
    it wants (a BOS included), so encoding adds none, as transformers does."""
    text = _render(state, req)
    return state.engine.tokenizer.encode(text, add_special_tokens=False)


def _render(state: ServerState, req: ChatCompletionRequest) -> str:
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = _RESERVED_TEMPLATE_KWARGS.intersection(kwargs)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs")
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt set to false",
                              "continue_final_message")
        if req.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be from the assistant",
                              "continue_final_message")
    messages = [m.to_template_dict() for m in req.messages]
    try:
        text = state.engine.render_chat(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the template runs on client input: any failure is the request's
        raise bad_request(f"could not apply the chat template: {exc}", "messages") from None
    if req.continue_final_message:
        # As transformers does: cut what the template writes after the final message's text.
        content = messages[-1]["content"]
        end = text.rfind(content) if content else -1
        if end < 0:
            raise bad_request("continue_final_message: the template does not show the final message's text",
                              "continue_final_message")
        text = text[:end + len(content)]
    return text


@dataclass
class ChatFormat:
    """Builds chunks and the final body; token_text is None when no logprobs were asked for."""

    id: str
    created: int
    model: str
    token_text: TokenText | None

    def opening_chunks(self, num_choices: int) -> list[ChatCompletionChunk]:
        return [self._chunk([ChatChunkChoice(i, ChatDelta(role="assistant", content=""), None, None)])
                for i in range(num_choices)]

    def chunk(self, index: int, seq: CompletionOutput) -> ChatCompletionChunk:
        logprobs = None
        if self.token_text is not None:
            logprobs = chat_logprobs(new_logprobs(seq), self.token_text)
        choice = ChatChunkChoice(index, ChatDelta(content=seq.text_delta), logprobs, seq.finish_reason,
                                 seq.stop_reason)
        return self._chunk([choice])

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def response(self, outputs: list[RequestOutput], n: int, usage: UsageInfo) -> ChatCompletionResponse:
        choices = []
        for seq in outputs[0].outputs:
            logprobs = None
            if self.token_text is not None:
                logprobs = chat_logprobs(seq.logprobs or [], self.token_text)
            choices.append(ChatChoice(seq.index, ChatMessageOut("assistant", seq.text), logprobs,
                                      seq.finish_reason, seq.stop_reason))
        return ChatCompletionResponse(self.id, "chat.completion", self.created, self.model, choices, usage)

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, self.model, choices, usage)
