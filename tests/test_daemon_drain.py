"""Graceful drain: SIGTERM lets accepted requests finish, refuses new ones with 503, exits 0.

With --max-num-seqs 1 the streams run one after the other, so the drain lasts long
enough to probe it, and the queued streams prove that "in flight" includes requests
accepted but not yet scheduled. A drain timeout shorter than the work ends what is
left with an SSE error event, and the process still exits 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx

from server_fixtures import MAX_MODEL_LEN, start_server

MAX_TOKENS = MAX_MODEL_LEN - 16
NUM_STREAMS = 8  # about 0.3 s each on the tiny model, one at a time
STREAM_BODY = {"prompt": "The asyncio module", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}


async def read_stream(client: httpx.AsyncClient, first_token: asyncio.Event) -> list:
    """Every SSE event of one streaming completion, parsed ("[DONE]" stays a string)."""
    events = []
    async with client.stream("POST", "/v1/completions", json=STREAM_BODY) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                first_token.set()
    return events


def token_count(events: list) -> int:
    return sum(len(e["choices"]) for e in events if isinstance(e, dict) and "choices" in e)


async def start_streams(server) -> tuple[httpx.AsyncClient, list[asyncio.Task]]:
    """NUM_STREAMS streams, returned once the first of them is generating."""
    client = httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60)
    first_token = asyncio.Event()
    tasks = [asyncio.create_task(read_stream(client, first_token)) for _ in range(NUM_STREAMS)]
    await asyncio.wait_for(first_token.wait(), 30)
    return client, tasks


async def wait_draining(client: httpx.AsyncClient, timeout: float = 10.0) -> None:
    """Until /health answers 503: the signal was handled on the server's event loop."""
    deadline = time.monotonic() + timeout
    while (await client.get("/health")).status_code != 503:
        assert time.monotonic() < deadline, "SIGTERM did not start a drain"
        await asyncio.sleep(0.05)


async def wait_exit(server, timeout: float) -> int:
    return await asyncio.to_thread(server.process.wait, timeout)


async def test_sigterm_lets_streams_finish_and_refuses_new_requests(served_model_dir, tmp_path):
    server = start_server(served_model_dir, tmp_path / "serve.log", "--max-num-seqs", "1", "--drain-timeout", "60")
    try:
        client, streams = await start_streams(server)
        server.process.send_signal(signal.SIGTERM)
        await wait_draining(client)

        refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["retry-after"]) > 0
        assert "shutting down" in refused.json()["error"]["message"]
        assert not any(stream.done() for stream in streams), "the drain was over before it could be probed"

        results = await asyncio.gather(*streams)
        await client.aclose()
        exit_code = await wait_exit(server, 30)
    finally:
        server.stop()
    assert exit_code == 0, server.log_tail()
    for events in results:
        assert events[-1] == "[DONE]"
        assert token_count(events) == MAX_TOKENS
        assert events[-2]["choices"][0]["finish_reason"] == "length"


async def stop_while_streaming(server, num_signals: int) -> tuple[list, int, float]:
    """Start the streams, then SIGTERM (a second one once the server drains, with
    num_signals=2) -> (each stream's events, exit code, seconds from the last signal to exit)."""
    try:
        client, streams = await start_streams(server)
        for i in range(num_signals):
            if i:
                await wait_draining(client)
            signalled = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*streams)
        await client.aclose()
        exit_code = await wait_exit(server, 30)
        return results, exit_code, time.monotonic() - signalled
    finally:
        server.stop()


async def test_a_drain_timeout_ends_the_rest_with_an_error_event(served_model_dir, tmp_path):
    drain_timeout_s = 0.5
    server = start_server(served_model_dir, tmp_path / "serve.log", "--max-num-seqs", "1",
                          "--drain-timeout", str(drain_timeout_s))
    results, exit_code, took_s = await stop_while_streaming(server, num_signals=1)
    assert exit_code == 0, server.log_tail()
    assert took_s < drain_timeout_s + 10
    cut = [events for events in results if token_count(events) < MAX_TOKENS]
    assert cut, "every stream finished within the drain timeout: make the work longer"
    for events in cut:
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert "shutting down" in error["message"] and "Traceback" not in error["message"]


async def test_a_second_sigterm_ends_the_drain_at_once(served_model_dir, tmp_path):
    server = start_server(served_model_dir, tmp_path / "serve.log", "--max-num-seqs", "1", "--drain-timeout", "60")
    results, exit_code, took_s = await stop_while_streaming(server, num_signals=2)
    assert exit_code == 0, server.log_tail()
    assert took_s < 10
    assert any("error" in events[-2] for events in results)
