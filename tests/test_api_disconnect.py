"""A client that goes away mid-request (SSE, plain HTTP or WebSocket) aborts its request:
nothing keeps running and the KV cache drops back to its idle usage."""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.asyncio.client import connect

from server_fixtures import MAX_MODEL_LEN

MAX_TOKENS = MAX_MODEL_LEN - 8  # long enough that the client always leaves first
LONG = {"prompt": "x", "max_tokens": MAX_TOKENS, "ignore_eos": True}


@pytest.fixture
def idle(server):
    """Metrics before the test; afterwards the server must be idle again, with the same KV usage."""
    before = server.wait_idle()
    yield before
    after = server.wait_idle(timeout=5)
    assert after["sparkd:kv_cache_usage_perc"] == before["sparkd:kv_cache_usage_perc"] == 0.0


def generated_since(server, before) -> float:
    return server.metrics()["sparkd:generation_tokens_total"] - before["sparkd:generation_tokens_total"]


def test_sse_disconnect_mid_stream_aborts(server, idle):
    with server.client() as client, client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        pieces = r.iter_raw()  # (dropping this iterator would close the connection)
        assert next(pieces).startswith(b"data: ")
        assert server.metrics()["sparkd:num_requests_running"] == 1
    # leaving the block closed the connection
    server.wait_idle(timeout=5)
    assert generated_since(server, idle) < MAX_TOKENS


def test_chat_sse_disconnect_aborts(server, idle):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": MAX_TOKENS // 2,
            "ignore_eos": True, "n": 3}
    with server.client() as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        pieces = r.iter_raw()
        assert next(pieces).startswith(b"data: ")
        assert server.metrics()["sparkd:num_requests_running"] == 3
    server.wait_idle(timeout=5)
    assert generated_since(server, idle) < 3 * MAX_TOKENS // 2


def test_non_streaming_disconnect_aborts(server, idle):
    with server.client(timeout=httpx.Timeout(10, read=0.05)) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={**LONG, "n": 4})
    server.wait_idle(timeout=5)
    assert generated_since(server, idle) < 4 * MAX_TOKENS


async def test_websocket_close_aborts_every_request_on_it(server, idle):
    async with connect(server.ws_url, additional_headers=server.headers, proxy=None) as sock:
        for i in range(3):
            await sock.send(json.dumps({"id": str(i), "type": "completions", "body": LONG}))
        first = json.loads(await sock.recv())
        assert first["type"] == "chunk"
    server.wait_idle(timeout=5)
    assert generated_since(server, idle) < 3 * MAX_TOKENS
