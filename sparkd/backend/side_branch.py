"""Work that runs beside what follows it: `Ops.beside`, the handle it yields, and its in-order form.

A model says "run this beside what follows" for work that needs only tensors made already:
Qwen3-Next's shared expert beside the routed experts. A GPU enqueues that work on a second stream,
so its kernels take the SMs the router's routing block leaves idle (`cuda/side_stream.py`); a
backend with one queue (numpy) runs it first, then the rest. Every op computes what it would in
sequence either way, so the results are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Generic, Protocol, TypeVar

Result = TypeVar("Result")


class SideBranch(Generic[Result]):
    """What `Ops.beside` yields: the side work's result, readable once the with-block has joined it."""

    def __init__(self, result: Result):
        self._result = result
        self.joined = False

    @property
    def result(self) -> Result:
        # Before the join a GPU may still be computing it: reading it there would race.
        if not self.joined:
            raise RuntimeError("a side branch's result is readable only after its with-block, which joins it")
        return self._result


class Branching(Protocol):
    def beside(self, work: Callable[[], Result]) -> AbstractContextManager[SideBranch[Result]]:
        """`with ops.beside(work) as side:` enqueues `work()` (ops returning tensors) at once, runs it
        beside the with-block's ops and joins the two at the block's end; then `side.result` is
        what work returned.

        The two must be independent: work reads only tensors made before the with-block, the
        block neither reads work's outputs (they exist after the join) nor writes what work reads.
        work runs device compute only: no uploads, downloads or sampling, and no `beside` of its
        own. Results are those of work() then the block, bit for bit."""


@contextmanager
def in_order(work: Callable[[], Result]) -> Iterator[SideBranch[Result]]:
    """`Ops.beside` on a backend that runs one op at a time: work, then the with-block."""
    branch = SideBranch(work())
    yield branch
    branch.joined = True
