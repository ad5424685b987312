"""Admission control against real `sparkd serve` processes: per-request limits (400 naming the
field), body size (413, chunked bodies included), a full waiting queue (429 + Retry-After),
the request timeout (504 / a final error event, KV freed), and, in-process, draining (503 +
Retry-After) and `engine.fail_all` reaching every kind of client as an error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

import httpx
import pytest
import uvicorn
from websockets.asyncio.client import connect

from server_fixtures import MAX_MODEL_LEN, free_port, sse_payloads, start_server
from sparkd.api.app import build_app
from sparkd.api.errors import decode_json
from sparkd.api.generation import Submission
from sparkd.api.limits import ServerLimits
from sparkd.api.protocol import CompletionRequest
from sparkd.api.serving_completions import prepare_completion
from sparkd.api.streaming import sse_events
from sparkd.cli.main import build_parser
from sparkd.cli.server_flags import server_limits_from
from sparkd.engine.args import EngineArgs
from sparkd.engine.async_engine import STALL_LOOP_ENV, AsyncEngine

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "hello"}]

# server `limited`
MAX_BODY_BYTES, MAX_N, MAX_TOKENS_LIMIT, MAX_STOP_STRINGS, MAX_STOP_STRING_LENGTH = 4096, 2, 32, 2, 8
# server `timed`: one sequence runs at a time, so a request with n=16 takes 16 times its length
TIMEOUT_S = 1.0
LONG = {"prompt": "x", "n": 16, "max_tokens": 200, "ignore_eos": True}
# server `stalled`: its engine loop hangs (test-only switch), so every request stays queued
MAX_WAITING, STALLED_TIMEOUT_S = 2, 2.0


@pytest.fixture(scope="module")
def limited(served_model_dir, tmp_path_factory):
    proc = start_server(served_model_dir, tmp_path_factory.mktemp("limited") / "serve.log",
                        "--max-request-body-bytes", str(MAX_BODY_BYTES), "--max-n", str(MAX_N),
                        "--max-tokens-limit", str(MAX_TOKENS_LIMIT), "--max-stop-strings", str(MAX_STOP_STRINGS),
                        "--max-stop-string-length", str(MAX_STOP_STRING_LENGTH))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def timed(served_model_dir, tmp_path_factory):
    proc = start_server(served_model_dir, tmp_path_factory.mktemp("timed") / "serve.log", "--max-num-seqs", "1",
                        "--request-timeout", str(TIMEOUT_S))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def stalled(served_model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv(STALL_LOOP_ENV, "1")
        proc = start_server(served_model_dir, tmp_path_factory.mktemp("stalled") / "serve.log",
                            "--max-num-seqs", "1", "--max-waiting-requests", str(MAX_WAITING),
                            "--request-timeout", str(STALLED_TIMEOUT_S))
    yield proc
    proc.stop()


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert "Traceback" not in response.text
    return error


def ws(server):
    return connect(server.ws_url, additional_headers=server.headers, proxy=None)


async def ws_frames(sock, client_id: str) -> list[dict]:
    """Frames of one request on the socket, up to and including its done or error frame."""
    frames = []
    while not frames or frames[-1]["type"] not in ("done", "error"):
        frame = json.loads(await sock.recv())
        if frame["id"] == client_id:
            frames.append(frame)
    return frames


# ---- per-request limits and body size ----
OVER_LIMITS = [
    ("n", COMPLETIONS, {"prompt": "x", "n": MAX_N + 1}, "n"),
    ("completions max_tokens", COMPLETIONS, {"prompt": "x", "max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens"),
    ("chat max_tokens", CHAT, {"messages": MSGS, "max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens"),
    ("chat max_completion_tokens", CHAT, {"messages": MSGS, "max_completion_tokens": MAX_TOKENS_LIMIT + 1},
     "max_completion_tokens"),
    ("min_tokens with no max_tokens", CHAT, {"messages": MSGS, "min_tokens": MAX_TOKENS_LIMIT + 1}, "min_tokens"),
    ("stop strings", COMPLETIONS, {"prompt": "x", "stop": ["a", "b", "c"]}, "stop"),
    ("stop string length", CHAT, {"messages": MSGS, "stop": "x" * (MAX_STOP_STRING_LENGTH + 1)}, "stop"),
]


@pytest.mark.parametrize("path, body, param", [c[1:] for c in OVER_LIMITS], ids=[c[0] for c in OVER_LIMITS])
def test_a_request_over_a_limit_gets_400_naming_the_field(limited, path, body, param):
    with limited.client() as client:
        error = assert_error(client.post(path, json=body), 400, param)
    assert error["type"] == "invalid_request_error" and "on this server" in error["message"]


async def test_a_websocket_request_over_a_limit_gets_an_error_frame(limited):
    async with ws(limited) as sock:
        await sock.send(json.dumps({"id": "a", "type": "completions", "body": {"prompt": "x", "n": MAX_N + 1}}))
        [frame] = await ws_frames(sock, "a")
    assert frame["type"] == "error" and frame["error"]["param"] == "n"  # value errors name the body field


def test_a_request_at_the_limits_is_served(limited):
    body = {"prompt": "x", "n": MAX_N, "max_tokens": MAX_TOKENS_LIMIT, "ignore_eos": True,
            "stop": ["\x00" * MAX_STOP_STRING_LENGTH] * MAX_STOP_STRINGS}
    with limited.client() as client:
        out = client.post(COMPLETIONS, json=body).json()
    assert out["usage"]["completion_tokens"] == MAX_N * MAX_TOKENS_LIMIT


def test_a_request_naming_no_max_tokens_gets_the_limit_or_the_room_left(limited):
    long_prompt = [5] * (MAX_MODEL_LEN - 10)  # leaves 10 tokens of context: fewer than the limit
    with limited.client() as client:
        chat = client.post(CHAT, json={"messages": MSGS, "ignore_eos": True}).json()
        text = client.post(COMPLETIONS, json={"prompt": "x y", "max_tokens": None, "ignore_eos": True}).json()
        near_end = client.post(COMPLETIONS, json={"prompt": long_prompt, "max_tokens": None,
                                                  "ignore_eos": True}).json()
    for out in (chat, text):
        assert out["usage"]["completion_tokens"] == MAX_TOKENS_LIMIT
        assert out["choices"][0]["finish_reason"] == "length"
    assert near_end["usage"]["completion_tokens"] == 10


def padded_body(size: int) -> bytes:
    """A valid completions body of exactly `size` bytes."""
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    return body + b" " * (size - len(body))


def test_a_body_over_the_limit_gets_413_with_or_without_content_length(limited):
    def chunked(body: bytes):
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    with limited.client() as client:
        assert client.post(COMPLETIONS, content=padded_body(MAX_BODY_BYTES)).status_code == 200
        declared = client.post(COMPLETIONS, content=padded_body(MAX_BODY_BYTES + 1))
        assert_error(declared, 413, code="request_too_large")
        streamed = client.post(COMPLETIONS, content=chunked(padded_body(3 * MAX_BODY_BYTES)))
        assert "content-length" not in streamed.request.headers
        assert_error(streamed, 413, code="request_too_large")
        assert client.get("/health").status_code == 200
        assert client.post(COMPLETIONS, content=chunked(padded_body(MAX_BODY_BYTES))).status_code == 200


async def test_a_websocket_frame_over_the_limit_gets_413_and_the_socket_lives_on(limited):
    async with ws(limited) as sock:
        body = {"prompt": "x" * MAX_BODY_BYTES}
        await sock.send(json.dumps({"id": "big", "type": "completions", "body": body}))
        refused = json.loads(await sock.recv())
        await sock.send(json.dumps({"id": "small", "type": "completions", "body": {"prompt": "x", "max_tokens": 2}}))
        frames = await ws_frames(sock, "small")
    assert refused["type"] == "error" and refused["error"]["code"] == "request_too_large"
    assert frames[-1]["type"] == "done" and frames[-1]["usage"]["completion_tokens"] == 2


# ---- request timeout ----
def assert_cut_by_the_timeout(server, before: dict, elapsed_s: float) -> None:
    """The request ended at its deadline, not at its end, and its KV blocks went back."""
    assert TIMEOUT_S <= elapsed_s < TIMEOUT_S + 1.5
    after = server.wait_idle(timeout=5)
    assert after["sparkd:kv_cache_usage_perc"] == 0.0
    generated = after["sparkd:generation_tokens_total"] - before["sparkd:generation_tokens_total"]
    assert 0 < generated < LONG["n"] * LONG["max_tokens"]


def test_a_stream_past_the_timeout_ends_with_an_error_event_and_frees_its_kv(timed):
    before = timed.wait_idle()
    start = time.monotonic()
    with timed.client() as client, client.stream("POST", COMPLETIONS, json={**LONG, "stream": True}) as response:
        pieces = response.iter_bytes()
        body = next(pieces)
        busy = timed.metrics()
        body += b"".join(pieces)
    elapsed = time.monotonic() - start
    assert response.status_code == 200
    assert busy["sparkd:num_requests_running"] == 1 and busy["sparkd:kv_cache_usage_perc"] > 0
    *_, error_event, done = sse_payloads(body)
    assert done == "[DONE]"
    error = json.loads(error_event)["error"]
    assert error["code"] == "request_timeout" and f"{TIMEOUT_S:g} s" in error["message"]
    assert_cut_by_the_timeout(timed, before, elapsed)


def test_a_request_past_the_timeout_gets_504(timed):
    before = timed.wait_idle()
    start = time.monotonic()
    with timed.client() as client:
        response = client.post(CHAT, json={"messages": MSGS, **{k: v for k, v in LONG.items() if k != "prompt"}})
    assert_error(response, 504, code="request_timeout")
    assert_cut_by_the_timeout(timed, before, time.monotonic() - start)


async def test_a_websocket_request_past_the_timeout_gets_an_error_frame(timed):
    before = timed.wait_idle()
    start = time.monotonic()
    async with ws(timed) as sock:
        await sock.send(json.dumps({"id": "long", "type": "completions", "body": LONG}))
        frames = await ws_frames(sock, "long")
        elapsed = time.monotonic() - start
        await sock.send(json.dumps({"id": "short", "type": "completions", "body": {"prompt": "x", "max_tokens": 3}}))
        short = await ws_frames(sock, "short")
    assert frames[-1]["type"] == "error" and frames[-1]["error"]["code"] == "request_timeout"
    assert short[-1]["type"] == "done"
    assert_cut_by_the_timeout(timed, before, elapsed)


# ---- a full queue ----
async def test_a_full_queue_gets_429_with_retry_after_until_requests_leave_it(stalled):
    """While fewer than MAX_WAITING wait, a request is queued; then the next gets 429. The queued
    ones (the engine never runs them) end at the request timeout and the queue empties."""
    async with httpx.AsyncClient(base_url=stalled.base_url, headers=stalled.headers, timeout=30) as client:
        queued = []
        while stalled.metrics()["sparkd:num_requests_waiting"] < MAX_WAITING:
            request = client.build_request("POST", COMPLETIONS, json={"prompt": "x", "stream": True})
            response = await client.send(request, stream=True)
            assert response.status_code == 200
            queued.append(response)
        assert stalled.metrics()["sparkd:num_requests_waiting"] == MAX_WAITING
        for path, body in ((COMPLETIONS, {"prompt": "x"}), (CHAT, {"messages": MSGS, "stream": True})):
            refused = await client.post(path, json=body)
            error = assert_error(refused, 429, code="too_many_requests")
            assert refused.headers["retry-after"] == "1" and f"{MAX_WAITING}" in error["message"]
        async with ws(stalled) as sock:
            await sock.send(json.dumps({"id": "w", "type": "completions", "body": {"prompt": "x"}}))
            [frame] = await ws_frames(sock, "w")
        assert frame["type"] == "error" and frame["error"]["code"] == "too_many_requests"
        assert (await client.get("/health")).status_code == 200
        bodies = [await response.aread() for response in queued]
    for body in bodies:
        *_, error_event, done = sse_payloads(body)
        assert json.loads(error_event)["error"]["code"] == "request_timeout" and done == "[DONE]"
    assert stalled.metrics()["sparkd:num_requests_waiting"] == 0


# ---- draining and fail_all, in-process: the test sets the flag and calls the engine ----
class _InProcessServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # pytest owns the signals
        yield


@contextlib.asynccontextmanager
async def serving(served_model_dir):
    """A real uvicorn server on this event loop -> (base URL, the app's ServerState)."""
    engine = AsyncEngine.from_args(EngineArgs(model=str(served_model_dir), device="cpu", max_model_len=MAX_MODEL_LEN,
                                              max_num_seqs=1))
    app = build_app(engine)
    port = free_port()
    server = _InProcessServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the server did not start"
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app.state.sparkd
    finally:
        server.should_exit = True
        await task


async def engine_idle(engine: AsyncEngine, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (stats := engine.stats()).num_running or stats.num_waiting or stats.kv_cache_usage:
        assert time.monotonic() < deadline, f"the engine is still busy: {stats}"
        await asyncio.sleep(0.01)


async def first_event_then_rest(client: httpx.AsyncClient, path: str, body: dict, started: asyncio.Event) -> list[str]:
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        pieces = response.aiter_bytes()
        raw = await anext(pieces)
        started.set()
        raw += b"".join([piece async for piece in pieces])
    return sse_payloads(raw)


async def test_while_draining_new_requests_get_503_and_running_ones_finish(served_model_dir):
    async with serving(served_model_dir) as (url, state), httpx.AsyncClient(base_url=url, timeout=30) as client:
        started = asyncio.Event()
        running = asyncio.create_task(first_event_then_rest(client, COMPLETIONS, {**LONG, "n": 4}, started))
        await started.wait()
        state.draining = True
        for path, body in ((COMPLETIONS, {"prompt": "x"}), (CHAT, {"messages": MSGS, "stream": True})):
            refused = await client.post(path, json=body)
            assert_error(refused, 503, code="server_shutting_down")
            assert int(refused.headers["retry-after"]) > 0
        health = await client.get("/health")
        assert health.status_code == 503 and int(health.headers["retry-after"]) > 0
        async with connect(url.replace("http", "ws") + "/v1/ws", proxy=None) as sock:
            await sock.send(json.dumps({"id": "w", "type": "completions", "body": {"prompt": "x"}}))
            [frame] = await ws_frames(sock, "w")
        assert frame["type"] == "error" and frame["error"]["code"] == "server_shutting_down"
        assert not running.done(), "the stream ended before the drain could be probed"
        payloads = await running
    assert payloads[-1] == "[DONE]" and not any('"error"' in p for p in payloads)
    finishes = [c["finish_reason"] for p in payloads[:-1] for c in json.loads(p)["choices"]]
    assert finishes.count("length") == 4


async def test_fail_all_ends_every_open_request_with_its_message(served_model_dir):
    message = "drain deadline passed"
    async with serving(served_model_dir) as (url, state), httpx.AsyncClient(base_url=url, timeout=30) as client:
        started = asyncio.Event()
        stream = asyncio.create_task(first_event_then_rest(client, COMPLETIONS, LONG, started))
        await started.wait()
        plain = asyncio.create_task(client.post(CHAT, json={"messages": MSGS, "max_tokens": 100}))
        async with connect(url.replace("http", "ws") + "/v1/ws", proxy=None) as sock:
            await sock.send(json.dumps({"id": "w", "type": "completions", "body": LONG}))
            while state.engine.num_open_requests < 3:
                await asyncio.sleep(0.01)
            state.draining = True
            state.engine.fail_all(message)
            ws_last = (await ws_frames(sock, "w"))[-1]
        payloads, response = await stream, await plain
        assert state.engine.num_open_requests == 0
        await engine_idle(state.engine)  # aborts made during a step apply when it ends
    assert payloads[-1] == "[DONE]"
    sse_error = json.loads(payloads[-2])["error"]
    assert sse_error["message"] == message and sse_error["code"] == "server_shutting_down"
    assert ws_last["type"] == "error" and ws_last["error"]["message"] == message
    assert assert_error(response, 503, code="server_shutting_down")["message"] == message


async def test_fail_all_reaches_a_stream_whose_outputs_are_not_read_yet(served_model_dir):
    """fail_all while a reader is behind (busy writing, or not started): the error output is
    still the stream's last item, so its message reaches the client."""
    engine = AsyncEngine.from_args(EngineArgs(model=str(served_model_dir), device="cpu", max_model_len=MAX_MODEL_LEN))
    state = build_app(engine).state.sparkd
    job = prepare_completion(state, decode_json(json.dumps({"prompt": "x", "stream": True}), CompletionRequest))
    sub = Submission(state, job)
    state.draining = True
    engine.fail_all("drain deadline passed")
    payloads = sse_payloads(b"".join([event async for event in sse_events(sub, job)]))
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["error"]["message"] == "drain deadline passed"
    assert engine.num_open_requests == 0 and engine.stats().kv_cache_usage == 0.0


def test_the_flags_default_to_server_limits_and_name_themselves_in_errors():
    parser = build_parser()
    assert server_limits_from(parser.parse_args(["serve"])) == ServerLimits()
    for flag, value, rule in (("--max-n", "17", "in [1, 16]"), ("--max-waiting-requests", "0", ">= 1"),
                              ("--request-timeout", "0", "positive")):
        with pytest.raises(SystemExit, match=rf"{re.escape(flag)} must be .*{re.escape(rule)}"):
            server_limits_from(parser.parse_args(["serve", flag, value]))
