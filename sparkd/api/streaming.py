"""Drive a Submission to the client: as chunks (SSE and WebSocket share them) or as one body.

A chunk goes out for every update that added tokens to a choice, so with one
token per engine step there is one event per token; a choice's last chunk
also carries its finish_reason.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncGenerator

import msgspec

from ..engine.outputs import RequestOutput
from .errors import APIError, server_error
from .generation import Submission
from .job import Job
from .sse import DONE, sse_error, sse_event, wait_for_disconnect

log = logging.getLogger("sparkd.api")


async def chunk_stream(sub: Submission, job: Job) -> AsyncGenerator[msgspec.Struct, None]:
    """Chunks in order; raises APIError if the request fails in the engine."""
    n = job.params.n
    for chunk in job.fmt.opening_chunks(n * len(job.prompts)):
        yield chunk
    finish_sent: set[int] = set()
    async for prompt_index, out in sub.outputs():
        for seq in out.outputs:
            index = prompt_index * n + seq.index
            if seq.num_new_tokens == 0 and (not seq.finished or index in finish_sent):
                continue
            if seq.finished:
                finish_sent.add(index)
            yield job.fmt.chunk(index, seq)


async def sse_events(sub: Submission, job: Job) -> AsyncGenerator[bytes, None]:
    """The SSE body: chunks, the usage chunk if asked for, then [DONE]; a failure
    mid-stream becomes an error event (the status line has already gone out)."""
    try:
        async for chunk in chunk_stream(sub, job):
            yield sse_event(chunk)
        if job.include_usage:
            yield sse_event(job.fmt.usage_chunk(sub.usage()))
    except APIError as exc:
        yield sse_error(exc.info())
    except Exception:  # noqa: BLE001 - a bug; the client gets a bare error event, the log the traceback
        yield sse_error(unexpected_error(job.id).info())
    yield DONE


def unexpected_error(request_id: str) -> APIError:
    """A bug met mid-request: logged with its traceback here, a bare 500 for the client."""
    log.exception("unhandled error in request %s", request_id)
    return server_error()


async def collect(sub: Submission, receive) -> list[RequestOutput] | None:
    """Each prompt's final output, or None if the client went away first (the
    request is then aborted). Raises APIError if the request fails in the engine."""
    finishing = asyncio.ensure_future(sub.final_outputs())
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    done: set = set()
    try:
        done, _ = await asyncio.wait((finishing, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (finishing, watcher):
            task.cancel()
        await asyncio.gather(finishing, watcher, return_exceptions=True)
    if finishing not in done:
        return None
    return finishing.result()

