"""One API request in the engine: its prompts queued, their outputs merged, aborted on exit.

A completions request may carry several prompts; each becomes one engine
request and the API merges their outputs. Leaving `outputs()` early for any
reason (client gone, cancel, error) aborts every engine request still running,
so their KV blocks go back to the pool at once.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncGenerator

from ..engine.async_engine import AsyncEngine, EngineDeadError, RequestError, RequestStream
from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams
from .errors import bad_request, engine_dead, server_error
from .metrics import RequestTimer, ServerMetrics
from .responses import UsageInfo


class Submission:
    """The engine requests behind one API request, prompt i -> streams[i]."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, prompts: list[str | list[int]],
                 params: SamplingParams, request_id: str):
        self.engine = engine
        self.streams: list[RequestStream] = []
        self.timers: list[RequestTimer] = []
        self.last: list[RequestOutput | None] = [None] * len(prompts)
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                self.timers.append(metrics.timer())
                self.streams.append(engine.add_request(prompt, params, rid))
        except RequestError as exc:
            self.abort()
            param = exc.param
            if param == "prompt" and len(prompts) > 1:
                param = f"prompt[{len(self.streams)}]"  # the one that was refused
            raise bad_request(exc.message, param) from None
        except EngineDeadError as exc:
            self.abort()
            raise engine_dead(str(exc)) from None

    def abort(self) -> None:
        for stream in self.streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    def usage(self) -> UsageInfo:
        """Token counts so far: the prompt once per prompt (not per choice), every generated token."""
        prompt = sum(len(out.prompt_token_ids) for out in self.last if out is not None)
        completion = sum(len(seq.token_ids) for out in self.last if out is not None for seq in out.outputs)
        return UsageInfo(prompt, completion, prompt + completion)

    async def outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, output) in arrival order until every prompt has finished.
        Raises APIError when the engine fails the request (500) or has died (503)."""
        merged = _single(self.streams[0]) if len(self.streams) == 1 else _merge(self.streams)
        try:
            async with aclosing(merged):  # stops _merge's pump tasks however we leave
                async for index, out in merged:
                    self.timers[index].on_output(out)
                    if out.error is not None:
                        raise server_error(out.error)
                    self.last[index] = out
                    yield index, out
        except EngineDeadError as exc:
            raise engine_dead(str(exc)) from None
        finally:
            self.abort()

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
