"""Engine logprobs -> the two OpenAI shapes (legacy completions, and chat)."""

from __future__ import annotations

from typing import Callable

from ..engine.outputs import CompletionOutput, TokenLogprob
from .responses import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs

TokenText = Callable[[int], str]


def new_logprobs(seq: CompletionOutput) -> list[TokenLogprob]:
    """The logprobs of the tokens this update added (the engine's list is cumulative)."""
    if not seq.logprobs or not seq.num_new_tokens:
        return []
    return seq.logprobs[-seq.num_new_tokens:]


def completion_logprobs(entries: list[TokenLogprob], token_text: TokenText, text_offset: int) -> CompletionLogprobs:
    """text_offset: where the first of these tokens starts in the completion text."""
    tokens = [token_text(e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{token_text(t): lp for t, lp in e.top.items()} for e in entries],
        text_offset=offsets,
    )


def chat_logprobs(entries: list[TokenLogprob], token_text: TokenText) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> ChatTopLogprob:
        text = token_text(token_id)
        return ChatTopLogprob(text, logprob, list(text.encode("utf-8")))

    content = []
    for e in entries:
        text = token_text(e.token_id)
        content.append(ChatTokenLogprob(text, e.logprob, list(text.encode("utf-8")),
                                        [top(t, lp) for t, lp in e.top.items()]))
    return ChatLogprobs(content)
