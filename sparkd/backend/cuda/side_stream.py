"""`Ops.beside` on CUDA: side work on a second stream, forked from the main stream and joined back.

The fork records an event on the main stream and makes the side stream wait for it, so the side
work starts after everything enqueued before it; the join records one on the side stream and
makes the main stream wait for it, so what follows sees the side's outputs. In a graph capture
the same records and waits pull the side stream into the capture and join it back: the side work
becomes a parallel branch of the graph. Should anything raise in between, the join is still made
(quietly, when an invalidated capture refuses it); the capture guard then ends the capture on the
main stream, which takes every stream of that capture out of capture mode.

Memory. The caching allocator hands a freed block to the next allocation at once, which is safe in
one stream's order but not across two. So between fork and join nothing freed in the active pool
goes back to its free lists (`MemoryPool.holding_frees`):
- a block the side work allocates or reads reaches no main-stream work before the join, even if
  Python drops it early; after the join's wait, main-stream work runs after the side's last use;
- the side work's allocations take only blocks freed before the fork, whose users were all
  enqueued before the fork's event (in a capture: nodes the side's first node depends on through
  it; a graph pool's blocks serve its graphs only, which replay one after another on the main stream).
All the side work is enqueued at the fork, before the main-stream work beside it, so these two
cover every pair of kernels that may run at once.

What stays on the main stream: host transfers (the staging ring copies on it) and sampling, which
CudaOps refuses inside side work (`require_main`), and the kernels that count arrivals on a
module-level device counter (decode attention, the MoE router), which assume that their launches
never overlap: side work is the shared expert's GEMMs. The side lane has its own cuBLASLt
workspace (its `Gemm`), as two GEMMs running at once must not share one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from ..side_branch import SideBranch
from .driver import CudaError, Event, Stream
from .memory import DeviceAllocator

if TYPE_CHECKING:
    from .gemm import Gemm

Result = TypeVar("Result")


@dataclass(frozen=True)
class Lane:
    """A stream and the GEMM runner that enqueues on it."""

    stream: Stream
    gemm: Gemm


class Lanes:
    """The main lane, the side lane, and which of them the calling thread's ops enqueue on."""

    def __init__(self, allocator: DeviceAllocator, main: Lane, side: Lane):
        self.allocator = allocator
        self.main, self.side = main, side
        self._forked, self._joined = Event(), Event()
        self._current = threading.local()

    @property
    def current(self) -> Lane:
        return getattr(self._current, "lane", self.main)

    def require_main(self, what: str) -> None:
        """RuntimeError naming `what` unless the calling thread's ops are on the main lane."""
        if self.current is not self.main:
            raise RuntimeError(f"{what} inside side work: the work given to Ops.beside enqueues device compute only")

    @contextmanager
    def beside(self, work: Callable[[], Result]) -> Iterator[SideBranch[Result]]:
        """`Ops.beside`: fork, enqueue all of work() on the side lane, yield to the with-block on the
        main lane, join."""
        self.require_main("Ops.beside")
        with self.allocator.pool.holding_frees():
            self._forked.record(self.main.stream)
            self.side.stream.wait_event(self._forked)
            try:
                self._current.lane = self.side
                try:
                    branch = SideBranch(work())
                finally:
                    self._current.lane = self.main
                yield branch
            except BaseException:
                self._join(quiet=True)
                raise
            self._join()
        branch.joined = True

    def _join(self, quiet: bool = False) -> None:
        """The main stream waits for the side work. quiet: an exception is on its way, and a capture
        it invalidated refuses these calls (ending that capture frees the side stream too)."""
        try:
            self._joined.record(self.side.stream)
            self.main.stream.wait_event(self._joined)
        except CudaError:
            if not quiet:
                raise
