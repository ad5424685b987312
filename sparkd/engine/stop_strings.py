"""Stop strings on streamed text.

A stop string may arrive split over several deltas, so the matcher keeps the
tail of the text it has seen. Unless the stop string is to be included, the
longest tail that could still grow into a stop string is held back: it is
released once it can no longer match, and dropped if it does. When several stop
strings match, the one that completes first in the text wins (the earliest end,
then the longest), so the result does not depend on how the text was split
into deltas.
"""

from __future__ import annotations

from typing import Sequence


class StopStringMatcher:
    """Filters one sequence's text deltas.

    feed(delta) -> (text safe to emit now, the stop string that matched or None).
    After a match everything past the stop string (and the stop string itself,
    unless include_in_output) is dropped, and the matcher ignores further text.
    """

    def __init__(self, stop: Sequence[str], include_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = list(stop)
        self._include = include_in_output
        self._context_len = max((len(s) for s in self._stop), default=1) - 1
        self._emitted_tail = ""  # last `_context_len` chars already emitted
        self._held = ""  # unemitted text that may be the start of a stop string
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, str | None]:
        if self.matched is not None or not delta:
            return "", None
        if not self._stop:
            return delta, None
        # A match always ends in `delta`. It can begin in emitted text when it is
        # included in the output (nothing is held then) or when that text was fed
        # unchecked; what was emitted stays emitted.
        text = self._emitted_tail + self._held + delta
        start = len(self._emitted_tail)
        match = self._first_match(text)
        if match is not None:
            stop, match_start = match
            self.matched = stop
            end = match_start + len(stop) if self._include else match_start
            self._held = ""
            return text[start:max(start, end)], stop
        pending = text[start:]
        hold = 0 if self._include else self._partial_match_len(pending)
        emit = pending[: len(pending) - hold]
        self._held = pending[len(pending) - hold:]
        self._remember(emit)
        return emit, None

    def feed_unchecked(self, delta: str) -> str:
        """Text that stop strings do not apply to yet (min_tokens not reached):
        emitted as is, and kept as context for matches that end later."""
        text, self._held = self._held + delta, ""
        self._remember(text)
        return text

    def flush(self) -> str:
        """The sequence ended without a match: release the held-back text."""
        held, self._held = self._held, ""
        return held

    def _remember(self, emitted: str) -> None:
        if self._context_len:
            self._emitted_tail = (self._emitted_tail + emitted)[-self._context_len:]

    def _first_match(self, text: str) -> tuple[str, int] | None:
        """(stop string, start index) completing earliest in `text`, or None."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            index = text.find(stop)
            if index >= 0:
                key = (index + len(stop), index, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[2], best[1])

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._context_len), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self._stop):
                return length
        return 0
