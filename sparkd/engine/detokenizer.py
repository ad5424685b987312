"""Incremental detokenization: one sequence's token ids in, text deltas out.

Decoding a single token alone is wrong in two ways: a byte-level token may hold
only part of a UTF-8 character (CJK, emoji), and some decoders change a token's
text depending on its neighbours (SentencePiece strips the leading space of the
first token). So each step decodes a short window that starts a little before
the new tokens and emits only what the new tokens added to it:

    ids:  ... | prefix_offset ... read_offset | new tokens
                 (already emitted, context)     (not yet emitted)

    delta = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

While the window's text ends in U+FFFD the last character is incomplete, so
nothing is emitted and the tokens wait for the bytes that complete them.

The text of the context part is kept from the step before (it was that step's
window), so a step costs one decode. Once the window holds more than
`SLIDE_AFTER` tokens, an emission slides its start up to the tokens just emitted
and decodes the new context once: the cost per token stays O(1) amortised.
Deltas concatenate to `tokenizer.decode(all_ids)` once `flush()` has released
whatever is still held at the end.
"""

from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"
# A window this long decodes hardly slower than two tokens (the call dominates), while
# sliding less often saves the context's extra decode: ~1.2 decodes per token.
SLIDE_AFTER = 6


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer (sparkd's Tokenizer wrapper or a
    `tokenizers.Tokenizer`)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for one sequence, fed with its output token ids as they arrive."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])

    def feed(self, token_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete ("" while a character is split)."""
        self._token_ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the sequence: release held text, even an incomplete
        character (as U+FFFD, exactly as a full decode shows it)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        num_ids = len(self._token_ids)
        if self._read_offset == num_ids:
            return ""
        window_text = self._decode(self._prefix_offset, num_ids)
        if window_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        prefix_text = self._prefix_text
        read_offset, self._read_offset = self._read_offset, num_ids
        if len(window_text) <= len(prefix_text):
            # The new tokens added no text (e.g. skipped special tokens): consume
            # them but keep the old context for the next window.
            self._prefix_text = window_text
            return ""
        if num_ids - self._prefix_offset > SLIDE_AFTER:
            self._prefix_offset = read_offset
            self._prefix_text = self._decode(read_offset, num_ids)
        else:
            self._prefix_text = window_text
        return window_text[len(prefix_text):]

    def _decode(self, start: int, end: int) -> str:
        if start == end:
            return ""
        return self._tokenizer.decode(self._token_ids[start:end], skip_special_tokens=self._skip_special_tokens)
