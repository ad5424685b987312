"""GET /v1/ws: many requests multiplexed on one WebSocket.

Client frames:  {"id": "<client id>", "type": "chat.completions" | "completions", "body": {...}}
                {"id": "<client id>", "type": "cancel"}
Server frames:  {"id", "type": "chunk", "data": <the chunk SSE would send>}
                {"id", "type": "done", "usage": {...}, "cancelled": bool}   (last frame of a request)
                {"id", "type": "error", "error": {"message", "type", "param", "code"}}

A request's frames go out in order; frames of different requests interleave.
The body is the HTTP body; `stream` and `stream_options` are ignored (a
WebSocket request always streams and "done" always carries usage). A cancel
for an id that is not in flight is ignored, since the request may just have
finished. Closing the socket aborts every request on it. A request the HTTP
routes would refuse (a frame over the body limit, a full queue, a draining
server) gets the same error as an error frame, and the socket lives on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import msgspec
from starlette.websockets import WebSocket

from .errors import APIError, bad_request, body_too_large, decode_json
from .generation import Submission
from .job import Job
from .protocol import REQUEST_TYPES, WSClientMessage
from .responses import WSChunk, WSDone, WSError
from .serving_chat import prepare_chat
from .serving_completions import prepare_completion
from .state import ServerState
from .streaming import chunk_stream, unexpected_error

log = logging.getLogger("sparkd.api")

_PREPARE: dict[str, Callable[[ServerState, msgspec.Struct], Job]] = {
    "chat.completions": prepare_chat,
    "completions": prepare_completion,
}


async def websocket_endpoint(ws: WebSocket) -> None:
    await ws.accept()
    await _Session(ws, ws.app.state.sparkd).run()


class _Session:
    """One socket's requests. `in_flight` maps a client id to its task and Submission
    until the request's last frame is queued, so the id is free again the moment
    the client can see that frame."""

    def __init__(self, ws: WebSocket, state: ServerState):
        self.ws = ws
        self.state = state
        self.in_flight: dict[str, tuple[asyncio.Task, Submission]] = {}
        self.send_lock = asyncio.Lock()  # one frame at a time on the wire
        self.open = True

    async def run(self) -> None:
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                await self._handle(message.get("text") or message.get("bytes") or b"")
        finally:
            self.open = False
            for task, sub in self.in_flight.values():
                task.cancel()
                sub.abort()  # the task may never have started, so its own cleanup may not run
            await asyncio.gather(*(task for task, _ in self.in_flight.values()), return_exceptions=True)

    async def _handle(self, raw: str | bytes) -> None:
        limit = self.state.limits.max_body_bytes
        if len(raw.encode() if isinstance(raw, str) else raw) > limit:
            await self._send(WSError(id=None, error=body_too_large(limit).info()))  # not parsed, so no id
            return
        try:
            frame = decode_json(raw, WSClientMessage)
        except APIError as exc:
            await self._send(WSError(id=_loose_id(raw), error=exc.info()))
            return
        if frame.type == "cancel":
            await self._cancel(frame.id)
            return
        try:
            job, sub = self._start(frame)
        except APIError as exc:
            await self._send(WSError(id=frame.id, error=exc.info()))
            return
        except Exception:  # noqa: BLE001 - a bug; one request fails, the socket lives on
            await self._send(WSError(id=frame.id, error=unexpected_error(frame.id).info()))
            return
        self.in_flight[frame.id] = (asyncio.create_task(self._stream(frame.id, job, sub)), sub)

    async def _cancel(self, client_id: str) -> None:
        entry = self.in_flight.pop(client_id, None)
        if entry is None:
            return  # unknown, or its last frame is already on its way
        task, sub = entry
        task.cancel()
        sub.abort()
        await self._send(WSDone(id=client_id, usage=sub.usage(), cancelled=True))

    def _start(self, frame: WSClientMessage) -> tuple[Job, Submission]:
        if frame.id in self.in_flight:
            raise bad_request(f"a request with id {frame.id!r} is already in flight on this socket", "id")
        if not frame.body:
            raise bad_request(f"a {frame.type} frame needs a body", "body")
        try:
            req = decode_json(frame.body, REQUEST_TYPES[frame.type])
        except APIError as error:
            if error.param is not None:
                error.param = f"body.{error.param}"
            raise
        job = _PREPARE[frame.type](self.state, req)
        return job, Submission(self.state, job)

    async def _stream(self, client_id: str, job: Job, sub: Submission) -> None:
        """Chunks, then done or error. Cancellation (by `_cancel` or the socket closing)
        propagates: whoever cancelled sends what is left to send."""
        last: msgspec.Struct
        try:
            async for chunk in chunk_stream(sub, job):
                await self._send(WSChunk(id=client_id, data=chunk))
            last = WSDone(id=client_id, usage=sub.usage())
        except APIError as exc:
            last = WSError(id=client_id, error=exc.info())
        except Exception:  # noqa: BLE001 - a bug; the client gets a bare error frame, the log the traceback
            last = WSError(id=client_id, error=unexpected_error(job.id).info())
        finally:
            sub.abort()
        del self.in_flight[client_id]
        await self._send(last)

    async def _send(self, frame: msgspec.Struct) -> None:
        if not self.open:
            return
        try:
            async with self.send_lock:
                await self.ws.send_text(msgspec.json.encode(frame).decode())
        except Exception:  # closed under us; run() sees the disconnect and cleans up
            self.open = False
            log.debug("websocket send failed", exc_info=True)


def _loose_id(raw: str | bytes) -> str | None:
    """The id of a frame that failed validation, if one can be read, so the client can match the error."""
    try:
        frame = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    if isinstance(frame, dict) and isinstance(frame.get("id"), str):
        return frame["id"]
    return None
