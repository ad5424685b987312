"""A storm of 300 streaming clients (SSE completions, SSE chat, WebSocket) that all go away at
random points: halfway through sending the request, before the first response byte, after
k events, or in the middle of an event; some close politely, some reset the connection.
Afterwards nothing is running or waiting, the KV cache is back to empty, and the server
still serves. The plan of every client comes from a seeded RNG, so a failure replays."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from websockets.asyncio.client import connect

from server_fixtures import MAX_MODEL_LEN

NUM_CLIENTS = 300
SEED = 20261129
MAX_TOKENS = MAX_MODEL_LEN - 32  # far more than any client waits for: every client leaves first
MAX_EVENTS_READ = 20
HTTP_KINDS = ("completions", "chat")
LEAVE_POINTS = ("mid-request", "before-first-byte", "after-events", "mid-event")
# Ends every SSE event; JSON holds no raw line feed and HTTP's own framing uses CRLF.
EVENT_END = b"\n\n"


@dataclass
class Plan:
    kind: str  # completions | chat | websocket
    leave: str  # one of LEAVE_POINTS (HTTP) or "after-events" (WebSocket)
    events: int  # events (WebSocket: frames) to read before leaving
    cut: float  # where in the bytes to cut, as a fraction (mid-request, mid-event)
    reset: bool  # leave with a TCP reset instead of a clean close
    requests: int  # WebSocket: requests multiplexed on the socket
    cancel: bool  # WebSocket: cancel the first request before leaving
    n: int  # choices per request


def make_plans(rng: random.Random) -> list[Plan]:
    plans = []
    for _ in range(NUM_CLIENTS):
        kind = rng.choice(HTTP_KINDS + ("websocket",))
        leave = "after-events" if kind == "websocket" else rng.choice(LEAVE_POINTS)
        plans.append(Plan(kind, leave, events=rng.randint(0 if kind == "websocket" else 1, MAX_EVENTS_READ),
                          cut=rng.random(), reset=rng.random() < 0.5, requests=rng.randint(1, 3),
                          cancel=rng.random() < 0.3, n=rng.choice((1, 1, 2))))
    return plans


def request_body(kind: str, i: int, n: int) -> dict:
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": f"storm client {i}"}]}
    else:
        body = {"prompt": f"storm client {i} says"}
    return {**body, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, "n": n}


def leave_socket(sock: socket.socket | None, reset: bool) -> None:
    """A reset (SO_LINGER 0) drops the connection at once, as a crashed client or a proxy timeout does."""
    if reset and sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def sse_client(server, i: int, plan: Plan) -> int:
    """Raw HTTP/1.1, so the client can leave at any byte. Returns the data events it read."""
    url = urlsplit(server.base_url)
    body = json.dumps(request_body(plan.kind, i, plan.n)).encode()
    path = "/v1/chat/completions" if plan.kind == "chat" else "/v1/completions"
    head = (f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {server.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    received = b""
    try:
        if plan.leave == "mid-request":
            writer.write(head + body[: int(plan.cut * len(body))])
            await writer.drain()
            return 0
        writer.write(head + body)
        await writer.drain()
        if plan.leave == "before-first-byte":
            return 0
        while received.count(EVENT_END) < plan.events:
            chunk = await reader.read(4096)
            assert chunk, f"client {i}: the stream ended after {received.count(EVENT_END)} events"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200"), received[:300]
        if plan.leave == "mid-event":  # read on into the next event, and leave inside it
            target = len(received) + 1 + int(plan.cut * 150)
            while len(received) < target:
                received += await reader.read(target - len(received))
        return received.count(EVENT_END)
    finally:
        leave_socket(writer.get_extra_info("socket"), plan.reset)
        writer.close()


async def websocket_client(server, i: int, plan: Plan) -> int:
    """Several requests on one socket, read some frames, maybe cancel one, then go."""
    sock = await connect(server.ws_url, additional_headers=server.headers, proxy=None)
    frames = 0
    try:
        for r in range(plan.requests):
            kind = ("completions", "chat.completions")[r % 2]
            body = request_body("chat" if r % 2 else "completions", i, plan.n)
            await sock.send(json.dumps({"id": f"{i}-{r}", "type": kind, "body": body}))
        for _ in range(plan.events):
            frame = json.loads(await sock.recv())
            assert frame["type"] == "chunk", frame
            frames += 1
        if plan.cancel:
            await sock.send(json.dumps({"id": f"{i}-0", "type": "cancel"}))
        return frames
    finally:
        if plan.reset:
            leave_socket(sock.transport.get_extra_info("socket"), True)
            sock.transport.abort()
        else:
            await sock.close()


async def test_disconnect_storm_leaves_nothing_running(server):
    before = server.wait_idle()
    log_mark = server.log_size()
    plans = make_plans(random.Random(SEED))
    clients = [websocket_client(server, i, p) if p.kind == "websocket" else sse_client(server, i, p)
               for i, p in enumerate(plans)]
    events = await asyncio.wait_for(asyncio.gather(*clients), timeout=120)
    # the storm really reached the engine: every client that waited for tokens got them
    readers = [(p, e) for p, e in zip(plans, events, strict=True) if p.leave in ("after-events", "mid-event")]
    assert all(e >= p.events for p, e in readers)
    assert sum(e > 0 for _, e in readers) > NUM_CLIENTS // 3

    deadline = time.monotonic() + 15
    while True:
        m = server.metrics()
        idle = (m["sparkd:num_requests_running"], m["sparkd:num_requests_waiting"], m["sparkd:kv_cache_usage_perc"])
        if idle == (0, 0, 0.0):
            break
        assert time.monotonic() < deadline, f"(running, waiting, KV usage) still {idle} after the storm"
        await asyncio.sleep(0.1)
    assert before["sparkd:kv_cache_usage_perc"] == 0.0
    generated = m["sparkd:generation_tokens_total"] - before["sparkd:generation_tokens_total"]
    assert generated < NUM_CLIENTS * MAX_TOKENS  # nobody ran to the end

    assert server.process.poll() is None
    # a client that leaves is routine, not an error: nothing to log with a traceback
    storm_log = server.log_since(log_mark)
    assert "Traceback" not in storm_log, storm_log[-3000:]
    with server.client() as client:
        assert client.get("/health").status_code == 200
        out = client.post("/v1/completions", json={"prompt": "after the storm", "max_tokens": 5, "ignore_eos": True})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 5
