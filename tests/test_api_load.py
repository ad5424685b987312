"""200 concurrent streaming clients all complete, and the server returns to idle."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

NUM_CLIENTS = 200
MAX_TOKENS = 8


async def stream_one(http: httpx.AsyncClient, i: int) -> tuple[int, dict]:
    """One client -> (token events seen, the usage chunk)."""
    if i % 2:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"client {i}"}]}
    else:
        path, body = "/v1/completions", {"prompt": f"client {i} says"}
    body.update(max_tokens=MAX_TOKENS, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    events = []
    async with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line:
                events.append(line)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    # every chunk but the usage one and chat's opening role chunk carries one token
    token_chunks = [c for c in chunks if c["choices"] and "role" not in c["choices"][0].get("delta", {})]
    return len(token_chunks), chunks[-1]["usage"]


async def test_200_concurrent_streams(server):
    before = server.wait_idle()
    limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=NUM_CLIENTS)
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, limits=limits,
                                 timeout=120) as http:
        results = await asyncio.gather(*(stream_one(http, i) for i in range(NUM_CLIENTS)))
    elapsed = time.perf_counter() - start
    assert len(results) == NUM_CLIENTS
    assert all(usage["completion_tokens"] == MAX_TOKENS for _, usage in results)
    assert all(events == MAX_TOKENS for events, _ in results)
    after = server.wait_idle(timeout=5)
    assert after["sparkd:kv_cache_usage_perc"] == before["sparkd:kv_cache_usage_perc"] == 0.0
    done = after["sparkd:e2e_request_latency_seconds_count"] - before["sparkd:e2e_request_latency_seconds_count"]
    assert done == NUM_CLIENTS
    generated = after["sparkd:generation_tokens_total"] - before["sparkd:generation_tokens_total"]
    assert generated == NUM_CLIENTS * MAX_TOKENS
    print(f"{NUM_CLIENTS} streams x {MAX_TOKENS} tokens in {elapsed:.1f} s")
