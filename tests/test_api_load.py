"""Many concurrent streaming clients all complete, and the server returns to idle: 200 on the
tiny test checkpoint, and 500 on the embedded demo model (`sparkd serve` with no model)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from server_fixtures import complete_stream_chunks, sse_payloads, start_demo_server

@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    proc = start_demo_server(tmp_path_factory.mktemp("demo") / "serve.log")
    yield proc
    proc.stop()


async def stream_one(http: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[int, dict]:
    """One client -> (token events seen, the usage chunk); the stream must be complete."""
    if i % 2:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"client {i}"}]}
    else:
        path, body = "/v1/completions", {"prompt": f"client {i} says"}
    body.update(max_tokens=max_tokens, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    async with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        chunks = complete_stream_chunks(sse_payloads(await response.aread()))
    assert chunks[-1]["choices"] == [] and [c["finish_reason"] for c in chunks[-2]["choices"]] == ["length"]
    # every chunk but the usage one and chat's opening role chunk carries one token
    token_chunks = [c for c in chunks if c["choices"] and "role" not in c["choices"][0].get("delta", {})]
    return len(token_chunks), chunks[-1]["usage"]


async def run_streams(server, num_clients: int, max_tokens: int) -> None:
    """`num_clients` streams at once; each completes with `max_tokens` tokens and the server ends idle."""
    before = server.wait_idle()
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, limits=limits,
                                 timeout=120) as http:
        results = await asyncio.gather(*(stream_one(http, i, max_tokens) for i in range(num_clients)))
    elapsed = time.perf_counter() - start
    assert len(results) == num_clients
    assert all(usage["completion_tokens"] == max_tokens for _, usage in results)
    assert all(events == max_tokens for events, _ in results)
    after = server.wait_idle(timeout=5)
    assert after["sparkd:kv_cache_usage_perc"] == before["sparkd:kv_cache_usage_perc"] == 0.0
    done = after["sparkd:e2e_request_latency_seconds_count"] - before["sparkd:e2e_request_latency_seconds_count"]
    assert done == num_clients
    generated = after["sparkd:generation_tokens_total"] - before["sparkd:generation_tokens_total"]
    assert generated == num_clients * max_tokens
    print(f"{num_clients} streams x {max_tokens} tokens in {elapsed:.1f} s")


async def test_200_concurrent_streams(server):
    await run_streams(server, 200, max_tokens=8)


async def test_500_concurrent_streams_on_the_demo_model(demo_server):
    await run_streams(demo_server, 500, max_tokens=32)
