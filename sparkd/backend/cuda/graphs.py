"""CUDA graphs: capture with the abort-capture guard, and the decode batch buckets.

The guard (see GPU-FACTS.md): any exception while a stream captures ends the
capture (cuStreamEndCapture, which reports CAPTURE_INVALIDATED after an illegal
call), destroys whatever partial graph came back, and leaves the stream usable.
Capture runs in THREAD_LOCAL mode, so CUDA calls from other threads (a waiter
thread, a weight loader) cannot invalidate it.

Set SPARKD_TEST_FAIL_GRAPH_CAPTURE=1 to make every capture fail. TEST-ONLY: it
exists so tests can prove a failed capture leaves the server working.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, TypeVar

from cuda.bindings import driver

from .driver import CudaError, Stream, call, releases_held

log = logging.getLogger("sparkd.cuda.graphs")

FAIL_CAPTURE_ENV = "SPARKD_TEST_FAIL_GRAPH_CAPTURE"

Result = TypeVar("Result")


class GraphCaptureError(RuntimeError):
    """Capturing a graph failed. Nothing of the step ran on the device; the stream is usable."""

    def __init__(self, message: str, bucket: int | None = None):
        super().__init__(message)
        self.bucket = bucket


class InjectedCaptureFailure(RuntimeError):
    """Raised inside a capture when FAIL_CAPTURE_ENV is set (tests only)."""


class CudaGraph:
    """An instantiated graph; `replay` enqueues it on a stream."""

    def __init__(self, graph_exec: driver.CUgraphExec):
        self.graph_exec = graph_exec

    def replay(self, stream: Stream) -> None:
        call(driver.cuGraphLaunch, self.graph_exec, stream.handle)

    def destroy(self) -> None:
        if self.graph_exec is not None:
            call(driver.cuGraphExecDestroy, self.graph_exec)
            self.graph_exec = None


def capture(stream: Stream, work: Callable[[], Result]) -> tuple[CudaGraph, Result]:
    """Record what `work()` enqueues on `stream` into a graph, without running it.

    On any exception the capture is aborted (see module doc) and the exception
    propagates; the stream can then run eager work as before. Resources whose last
    reference dies meanwhile are released after it (`releases_held`)."""
    with releases_held():
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        call(driver.cuStreamBeginCapture, stream.handle, mode)
        try:
            result = work()
            if os.environ.get(FAIL_CAPTURE_ENV, "0") not in ("", "0"):
                _inject_failure(stream)
        except BaseException:
            abort_capture(stream)
            raise
        graph = call(driver.cuStreamEndCapture, stream.handle)
    try:
        graph_exec = call(driver.cuGraphInstantiate, graph, 0)
    finally:
        call(driver.cuGraphDestroy, graph)  # the executable graph does not need its template
    return CudaGraph(graph_exec), result


def abort_capture(stream: Stream) -> None:
    """End a capture that went wrong and drop its partial graph."""
    status, graph = driver.cuStreamEndCapture(stream.handle)
    if graph is not None and int(graph) != 0:
        driver.cuGraphDestroy(graph)
    if status not in (driver.CUresult.CUDA_SUCCESS, driver.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED):
        log.warning("ending an aborted capture returned %s", driver.CUresult(status).name)


def _inject_failure(stream: Stream) -> None:
    # A stream synchronize is illegal while capturing: it invalidates the capture the
    # way a real mistake would (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED).
    try:
        stream.synchronize()
    except CudaError as err:
        raise InjectedCaptureFailure(f"{FAIL_CAPTURE_ENV} is set: injected {err.name} during capture") from err
    raise InjectedCaptureFailure(f"{FAIL_CAPTURE_ENV} is set: injected failure during capture")


def default_buckets(max_batch_size: int) -> list[int]:
    """Padded decode batch sizes, as vLLM: 1, 2, 4, then multiples of 8 up to the maximum."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
    sizes = [s for s in (1, 2, 4) if s < max_batch_size] + list(range(8, max_batch_size, 8))
    return sizes + [max_batch_size]


def bucket_for(batch_size: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `batch_size`, or None when it is larger than all."""
    return next((b for b in buckets if b >= batch_size), None)


@dataclass
class GraphSlot:
    """A decode graph's state: its graph once captured, or eager_only after a failed capture.

    size: the padded batch size; max_seq_len: the context bound its attention is planned for."""

    size: int
    max_seq_len: int
    graph: CudaGraph | None = None
    eager_only: bool = False
    num_replays: int = 0
