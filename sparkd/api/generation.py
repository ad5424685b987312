"""One API request in the engine: admitted, its prompts queued, their outputs merged, aborted on exit.

A completions request may carry several prompts; each becomes one engine
request and the API merges their outputs. Leaving `outputs()` early for any
reason (client gone, cancel, error, the server's request timeout) aborts every
engine request still running, so their KV blocks go back to the pool at once.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import replace
from typing import AsyncGenerator

from ..engine.async_engine import EngineDeadError, RequestError, RequestStream
from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams
from .errors import bad_request, engine_dead, request_timed_out, server_error, shutting_down
from .job import Job
from .metrics import RequestTimer
from .request_log import log_request
from .responses import UsageInfo
from .state import ServerState


class _TimedOut(Exception):
    """Put on a request's stream when its deadline passes, to wake whoever reads it."""


class Submission:
    """The engine requests behind one API request, prompt i -> streams[i].
    Raises APIError at once when the request is not admitted or the engine refuses it."""

    def __init__(self, state: ServerState, job: Job):
        state.admit()
        self.state = state
        self.engine = state.engine
        self.streams: list[RequestStream] = []
        self.timers: list[RequestTimer] = []
        self.last: list[RequestOutput | None] = [None] * len(job.prompts)
        self.timed_out = False
        self._deadline: asyncio.TimerHandle | None = None
        if state.limits.log_requests:
            log_request(job, self.engine.tokenizer, state.limits.max_log_len)
        try:
            for i, prompt in enumerate(job.prompts):
                rid = job.id if len(job.prompts) == 1 else f"{job.id}-{i}"
                self.timers.append(state.metrics.timer())
                self.streams.append(self.engine.add_request(*self._engine_request(prompt, job.params), rid))
        except RequestError as exc:
            self.abort()
            param = exc.param
            if param == "prompt" and len(job.prompts) > 1:
                param = f"prompt[{len(self.streams)}]"  # the one that was refused
            raise bad_request(exc.message, param) from None
        except EngineDeadError as exc:
            self.abort()
            raise engine_dead(str(exc)) from None
        timeout = state.limits.request_timeout_s
        if timeout is not None:
            self._deadline = asyncio.get_running_loop().call_later(timeout, self._time_out)

    def _engine_request(self, prompt: str | list[int],
                        params: SamplingParams) -> tuple[str | list[int], SamplingParams]:
        """The prompt and params the engine gets. With a server max_tokens limit, a request
        that names no max_tokens is capped by it, which needs the prompt's length: a text
        prompt is tokenized here (as the engine would) and goes to the engine as ids."""
        if params.max_tokens is not None or self.state.limits.max_tokens is None:
            return prompt, params
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                return prompt, params  # the engine refuses it with its own message
            prompt = self.engine.tokenizer.encode(prompt)
        max_tokens = self.state.limits.default_max_tokens(len(prompt), self.engine.max_model_len, params.min_tokens)
        return prompt, replace(params, max_tokens=max_tokens)

    def abort(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        for stream in self.streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    def _time_out(self) -> None:
        """The deadline passed: abort what has not been read to its end (freeing its KV
        blocks now) and wake its reader. A request already read to its end is not cut."""
        for stream in self.streams:
            if not stream.finished:
                self.timed_out = True
                self.engine.abort(stream.request_id)
                stream.put(_TimedOut())

    def usage(self) -> UsageInfo:
        """Token counts so far: the prompt once per prompt (not per choice), every generated token."""
        prompt = sum(len(out.prompt_token_ids) for out in self.last if out is not None)
        completion = sum(len(seq.token_ids) for out in self.last if out is not None for seq in out.outputs)
        return UsageInfo(prompt, completion, prompt + completion)

    async def outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, output) in arrival order until every prompt has finished.
        Raises APIError when the engine fails or ends the request (500; 503 while draining),
        has died (503), or the request outlives the server's request timeout (504)."""
        merged = _single(self.streams[0]) if len(self.streams) == 1 else _merge(self.streams)
        try:
            async with aclosing(merged):  # stops _merge's pump tasks however we leave
                async for index, out in merged:
                    self.timers[index].on_output(out)
                    if out.error is not None:
                        raise shutting_down(out.error) if self.state.draining else server_error(out.error)
                    self.last[index] = out
                    yield index, out
        except EngineDeadError as exc:
            raise engine_dead(str(exc)) from None
        except _TimedOut:
            pass  # the check below raises, as for a stream that ended without being read to its end
        finally:
            self.abort()
        if self.timed_out:
            raise request_timed_out(self.state.limits.request_timeout_s)
        if not all(out is not None and out.finished for out in self.last):
            # The engine closed the stream without a final output: the server aborted it.
            raise shutting_down() if self.state.draining else server_error("the server ended the request early")

    async def final_outputs(self) -> list[RequestOutput]:
        """Run to the end and return each prompt's last (cumulative) output."""
        async for _ in self.outputs():
            pass
        return [out for out in self.last if out is not None]


async def _single(stream: RequestStream) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    async for out in stream:
        yield 0, out


async def _merge(streams: list[RequestStream]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
