"""AsyncEngine: the asyncio loop that owns the engine.

Scheduling, input bookkeeping and output processing run on the event loop; the
step's device work (`LLMEngine.launch`, `collect`) runs in one worker thread, so
SSE writes and new requests keep flowing while the model computes. On CUDA that
thread enqueues the step on the stream, and later waits for the sampler's
device-to-host copy (cuEventSynchronize releases the GIL); the loop awaits the thread's future,
which asyncio resolves through call_soon_threadsafe. Requests talk to the loop only
through `add_request` / `abort`; each request's outputs go to its own `RequestStream`.

Failures:
- A step that raises fails its own requests (their streams end with an error
  output) and the loop goes on. A decode graph that failed to capture does that;
  its batch size then runs eagerly.
- A sticky device error (`backend.base.DeviceLostError`) kills the engine: `dead_reason`
  is set, every open stream raises EngineDeadError, new requests are refused, and
  `await engine.wait_dead()` returns the reason. The process must then exit
  non-zero (the CLI awaits `wait_dead()`, or polls `is_dead`, and exits 1) so a
  supervisor restarts it: the device cannot be recovered in-process.

Liveness: `heartbeat` is the monotonic time of the loop's last iteration; the
loop wakes at least every HEARTBEAT_INTERVAL_S while idle, so a heartbeat older
than a few intervals means the loop is stuck (a hung forward, a deadlock). The
server's watchdog pings systemd only while the heartbeat is fresh.

Set SPARKD_TEST_STALL_ENGINE_LOOP=1 to make the loop hang, as a hung GPU would,
at the first step it runs (the event loop itself stays responsive). TEST-ONLY:
it exists so tests can prove that a stuck engine stops the watchdog pings.

Async scheduling: the loop schedules and launches step N+1 before it collects
step N, so the host prepares N+1 (and post-processes N) while N runs on the
device. N+1 reads the ids N draws on the device (placeholders, see Scheduler);
a request that N stops has one wasted token in N+1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..backend.base import DeviceLostError
from .args import EngineArgs
from .llm_engine import EngineStats, LLMEngine, RequestError
from .model_runner import LaunchedStep
from .scheduler import SchedulerOutput
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger("sparkd.engine")

HEARTBEAT_INTERVAL_S = 0.5
STALL_LOOP_ENV = "SPARKD_TEST_STALL_ENGINE_LOOP"

__all__ = ["AsyncEngine", "EngineDeadError", "RequestError", "RequestStream"]


@dataclass
class _InFlight:
    """A launched step and what it was scheduled from."""

    output: SchedulerOutput
    step: LaunchedStep


class EngineDeadError(RuntimeError):
    """The engine loop died; nothing more can be served by this process."""


class RequestStream:
    """Async iterator over one request's outputs. Closing it early aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str):
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, core: LLMEngine):
        self.core = core
        self._streams: dict[str, RequestStream] = {}
        self._pending_aborts: set[str] = set()
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkd-forward")
        self._loop_task: asyncio.Task | None = None
        self._step_running = False
        self.dead_reason: str | None = None
        self._dead = asyncio.Event()
        self.heartbeat = time.monotonic()

    @classmethod
    def from_args(cls, args: EngineArgs, progress: Callable[[str], None] | None = None) -> AsyncEngine:
        """progress: called with one-line status messages while the model loads and warms up."""
        return cls(LLMEngine(args, progress=progress))

    # ---- properties the API layer reads ----
    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def model_config(self):
        return self.core.model_config

    @property
    def num_open_requests(self) -> int:
        """Requests whose stream is still open (queued, running, or with outputs not yet read)."""
        return len(self._streams)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    async def wait_dead(self) -> str:
        """Return the reason once the engine has died (it never recovers: exit non-zero then)."""
        await self._dead.wait()
        return self.dead_reason

    def stats(self) -> EngineStats:
        return self.core.stats()

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        return self.core.render_chat(messages, add_generation_prompt, **kwargs)

    # ---- lifecycle ----
    async def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name="sparkd-engine-loop")

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        for request_id in list(self._streams):
            self.abort(request_id)
        self._apply_aborts()
        self._executor.shutdown(wait=True)
        if not self.is_dead:
            self.core.close()

    # ---- requests ----
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Queue a request; raises RequestError (bad request) or EngineDeadError at once."""
        if self.is_dead:
            raise EngineDeadError(f"the engine is dead: {self.dead_reason}")
        request_id = self.core.add_request(prompt, params, request_id)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self._wakeup.set()
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Abort now if no step is in flight, else right after it (its blocks may be in use)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.finished = True
        self._pending_aborts.add(request_id)
        if not self._step_running:
            self._apply_aborts()

    def fail_all(self, message: str) -> None:
        """End every open request now with an error output carrying `message` (the
        stream's last item), and abort it (e.g. when a drain runs out of time)."""
        for request_id, stream in list(self._streams.items()):
            final = self.core.output_processor.fail(request_id, message)
            del self._streams[request_id]
            if final is not None:
                stream.put(final)  # its reader's last item, even if it is behind
            else:
                stream.finished = True
            self._pending_aborts.add(request_id)
        if not self._step_running:
            self._apply_aborts()

    def _apply_aborts(self) -> None:
        while self._pending_aborts:
            self.core.abort(self._pending_aborts.pop())

    # ---- the loop ----
    async def _run(self) -> None:
        """Async scheduling: schedule and launch step N+1, then collect and post-process
        step N while N+1 runs on the device. A step whose sampling reads earlier output
        ids (penalties) is collected before the next one is scheduled."""
        core = self.core
        stall = os.environ.get(STALL_LOOP_ENV, "0") not in ("", "0")
        in_flight: _InFlight | None = None
        try:
            while True:
                self.heartbeat = time.monotonic()
                if in_flight is None and not core.has_unfinished_requests():
                    self._wakeup.clear()
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), HEARTBEAT_INTERVAL_S)
                    except TimeoutError:
                        pass
                    continue
                if stall:
                    log.warning("%s is set: the engine loop hangs now (test-only)", STALL_LOOP_ENV)
                    await asyncio.Event().wait()
                launched = None
                if in_flight is None or not in_flight.step.reads_output_ids:
                    launched = await self._launch(core.schedule(), in_flight)
                if in_flight is not None:
                    await self._finish(in_flight)
                elif launched is None:
                    await asyncio.sleep(0.001)  # nothing could be scheduled yet
                in_flight = launched
                await asyncio.sleep(0)  # let SSE writers run between steps
        except asyncio.CancelledError:
            raise
        except DeviceLostError as exc:
            log.exception("the device is lost")
            self._die(f"the device is lost: {exc}")
        except BaseException as exc:
            self._die(f"engine loop crashed: {exc!r}")
            raise

    async def _launch(self, output: SchedulerOutput, in_flight: _InFlight | None) -> _InFlight | None:
        """Enqueue a scheduled step; None when nothing was scheduled or the launch failed."""
        if not output.scheduled:
            return None
        previous = in_flight.step if in_flight is not None else None
        try:
            step = await self._in_worker(self.core.launch, output, previous)
        except DeviceLostError:
            raise
        except Exception as exc:
            self._fail_step(output, exc)
            return None
        return _InFlight(output, step)

    async def _finish(self, in_flight: _InFlight) -> None:
        """Wait for a launched step's tokens and hand out its outputs."""
        try:
            sampled = await self._in_worker(self.core.collect, in_flight.step)
        except DeviceLostError:
            raise
        except Exception as exc:
            self._fail_step(in_flight.output, exc)
            return
        self._dispatch(self.core.postprocess(in_flight.output, sampled))

    async def _in_worker(self, fn, *args):
        """Run device work in the worker thread; aborts wait until it returns."""
        self._step_running = True
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._step_running = False
            self._apply_aborts()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_step(self, output: SchedulerOutput, exc: Exception) -> None:
        """One bad batch fails its own requests, not the server."""
        log.error("a step failed; failing its %d requests", len(output.scheduled), exc_info=exc)
        self.core.scheduler.discard_snapshots(output)
        group_ids = {s.request.group_id for s in output.scheduled}
        for group_id in group_ids:
            final = self.core.fail(group_id, f"internal error while running the model: {type(exc).__name__}")
            if final is not None:
                self._dispatch([final])

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        self._dead.set()
        log.critical(reason)
        for stream in self._streams.values():
            stream.put(EngineDeadError(reason))
        self._streams.clear()
