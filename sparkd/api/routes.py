"""The HTTP endpoints: OpenAI routes, /health, /version, /metrics."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from .. import __version__
from .errors import body_too_large, decode_json, engine_dead, shutting_down
from .generation import Submission
from .job import Job
from .metrics import CONTENT_TYPE
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import ModelCard, ModelList
from .serving_chat import prepare_chat
from .serving_completions import prepare_completion
from .sse import EventStreamResponse
from .state import ServerState
from .streaming import collect, sse_events

def json_response(payload: msgspec.Struct | dict, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status, media_type="application/json")


def _state(request: Request) -> ServerState:
    return request.app.state.sparkd


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes: by its Content-Length at once, and
    by counting as it arrives, so a chunked body (no Content-Length) cannot slip past."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def completions(request: Request) -> Response:
    state = _state(request)
    req = decode_json(await read_body(request, state.limits.max_body_bytes), CompletionRequest)
    return await _respond(state, prepare_completion(state, req), request)


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    req = decode_json(await read_body(request, state.limits.max_body_bytes), ChatCompletionRequest)
    return await _respond(state, prepare_chat(state, req), request)


async def _respond(state: ServerState, job: Job, request: Request):
    sub = Submission(state, job)
    if job.stream:
        return EventStreamResponse(sse_events(sub, job), on_close=sub.abort)
    outputs = await collect(sub, request.receive)
    if outputs is None:  # the client left; nobody reads this
        return Response(status_code=499)
    return json_response(job.fmt.response(outputs, job.params.n, sub.usage()))


async def models(request: Request) -> Response:
    state = _state(request)
    cards = [ModelCard(name, state.started, state.engine.max_model_len) for name in state.served_model_names]
    return json_response(ModelList(cards))


async def health(request: Request) -> Response:
    """200 while this process takes work; 503 once it is draining or its engine died,
    so a load balancer stops sending it requests."""
    state = _state(request)
    if state.engine.is_dead:
        return engine_dead(state.engine.dead_reason).response()
    if state.draining:
        return shutting_down().response()
    return Response(status_code=200)


async def version(request: Request) -> Response:
    return json_response({"version": __version__})


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)
