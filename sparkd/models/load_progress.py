"""Weight-loading progress: a bar on a terminal, status lines for a supervisor.

The total is the checkpoint's stored bytes (from the safetensors headers), so the
bar is exact before the first tensor is read. `report` (e.g. systemd's STATUS=)
gets a line at most once a second and once at the end.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO

log = logging.getLogger("sparkd.models")

_GiB = float(1 << 30)
_BAR_WIDTH = 30
_DRAW_INTERVAL_S = 0.25
_REPORT_INTERVAL_S = 1.0


class LoadProgress:
    def __init__(self, total_bytes: int, report: Callable[[str], None] | None = None, stream: TextIO = sys.stderr):
        self.total_bytes = max(total_bytes, 1)
        self.done_bytes = 0
        self.report = report
        self.stream = stream
        self._start = time.monotonic()
        self._last_draw = self._last_report = float("-inf")

    def track(self, items: Iterable[tuple[str, object]], nbytes_of: Callable[[str], int]) -> Iterator[tuple[str, object]]:
        """Yield (name, item) pairs, counting one as loaded once the consumer asks for the next."""
        for name, item in items:
            yield name, item
            self.advance(nbytes_of(name))
        self.finish()

    def advance(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        now = time.monotonic()
        if now - self._last_draw >= _DRAW_INTERVAL_S and self.stream.isatty():
            self._last_draw = now
            self.stream.write(f"\r{self.bar()}")
            self.stream.flush()
        if self.report is not None and now - self._last_report >= _REPORT_INTERVAL_S:
            self._last_report = now
            self.report(self.line())

    def bar(self) -> str:
        filled = _BAR_WIDTH * min(self.done_bytes, self.total_bytes) // self.total_bytes
        return f"loading weights [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {self.line()}"

    def line(self) -> str:
        seconds = max(time.monotonic() - self._start, 1e-9)
        return (f"loading weights: {self.done_bytes / _GiB:.2f}/{self.total_bytes / _GiB:.2f} GiB "
                f"({100 * self.done_bytes / self.total_bytes:.0f}%, {self.done_bytes / _GiB / seconds:.2f} GiB/s)")

    def finish(self) -> None:
        if self.stream.isatty():
            self.stream.write(f"\r{self.bar()}\n")
            self.stream.flush()
        if self.report is not None:
            self.report(self.line())
        log.info("loaded %.2f GiB of weights in %.1f s", self.done_bytes / _GiB, time.monotonic() - self._start)
