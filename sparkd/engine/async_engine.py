"""AsyncEngine: the asyncio loop that owns the engine.

Scheduling, input bookkeeping and output processing run on the event loop; the
step's device work (`LLMEngine.execute`) runs in one worker thread, so SSE writes
and new requests keep flowing while the model computes. On CUDA that thread
enqueues the step on the stream and then waits in the sampler's device-to-host
copy (cuStreamSynchronize releases the GIL); the loop awaits the thread's future,
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

Not done yet: preparing step N+1 on the host while step N runs on the GPU. It
needs (1) a sampler that ends the step with an event instead of host results, so
the ids can stay on the device; (2) the scheduler to schedule N+1 before N's
tokens are known, assuming one token per running decode and discarding it for
requests that N finished (vLLM's async scheduling); (3) decode graphs that read
their input ids from N's sampler output on the device instead of a host upload.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from ..backend.base import DeviceLostError
from .args import EngineArgs
from .llm_engine import EngineStats, LLMEngine, RequestError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger("sparkd.engine")

__all__ = ["AsyncEngine", "EngineDeadError", "RequestError", "RequestStream"]


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

    @classmethod
    def from_args(cls, args: EngineArgs) -> AsyncEngine:
        return cls(LLMEngine(args))

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

    def _apply_aborts(self) -> None:
        while self._pending_aborts:
            self.core.abort(self._pending_aborts.pop())

    # ---- the loop ----
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        try:
            while True:
                if not core.has_unfinished_requests():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                output = core.schedule()
                if not output.scheduled:
                    await asyncio.sleep(0.001)
                    continue
                self._step_running = True
                try:
                    sampled = await loop.run_in_executor(self._executor, core.execute, output)
                except Exception as exc:
                    self._step_running = False
                    if isinstance(exc, DeviceLostError):
                        log.exception("the device is lost")
                        self._die(f"the device is lost: {exc}")
                        return
                    # One bad batch fails its own requests, not the server.
                    log.exception("forward failed; failing the %d requests of this step", len(output.scheduled))
                    self._fail_step(output, exc)
                    self._apply_aborts()
                    continue
                self._step_running = False
                self._apply_aborts()
                self._dispatch(core.postprocess(output, sampled))
                await asyncio.sleep(0)  # let SSE writers run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._die(f"engine loop crashed: {exc!r}")
            raise

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_step(self, output, exc: Exception) -> None:
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
