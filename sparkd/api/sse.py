"""Server-Sent Events: framing, and a response that stops its stream when the client leaves.

Each event goes to the transport as soon as it is produced (one ASGI body
message per event), and the headers tell proxies not to buffer.
"""

from __future__ import annotations

import asyncio
from typing import AsyncGenerator, Callable

import msgspec

from .errors import ErrorInfo, ErrorResponse

DONE = b"data: [DONE]\n\n"

HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


# Characters JSON leaves raw but that line splitters treat as line breaks (Python's
# str.splitlines, used by e.g. httpx's aiter_lines): escaped so an event never breaks.
# Their UTF-8 bytes occur only as these characters, and only inside JSON strings.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse_event(payload: msgspec.Struct) -> bytes:
    data = msgspec.json.encode(payload)
    for raw, escaped in _LINE_BREAKS:
        data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


def sse_error(info: ErrorInfo) -> bytes:
    return sse_event(ErrorResponse(info))


class EventStreamResponse:
    """ASGI response that sends `events` and watches for the client going away.

    On disconnect the writer task is cancelled, which raises CancelledError
    inside `events` wherever it is waiting. `on_close` runs however the
    response ends, even if `events` never started, so the request behind it
    is aborted at once rather than at its next token.
    """

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], None]):
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        writer = asyncio.ensure_future(self._write(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait((writer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, watcher):
                task.cancel()
            await asyncio.gather(writer, watcher, return_exceptions=True)
            self.on_close()

    async def _write(self, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()


async def wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
