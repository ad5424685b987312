"""Security: the API key compared in constant time and kept out of logs (the WebSocket's query
key too), no stack trace in any response, and no prompt or generated text in the logs unless
--log-requests asks for one line per request."""

from __future__ import annotations

import hmac
import json

import pytest
from starlette.testclient import TestClient
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as sync_connect

from server_fixtures import sse_payloads, start_server
from sparkd.api import auth
from sparkd.api.app import build_app
from sparkd.api.auth import APIKeyMiddleware
from sparkd.api.serving_completions import CompletionFormat
from sparkd.engine.args import EngineArgs
from sparkd.engine.async_engine import AsyncEngine

MARKER = "zebra-quartz-7731"  # a prompt marker the model and the logs never produce on their own
MAX_LOG_LEN = 64
SECRET = "secret-internal-detail"


@pytest.fixture(scope="module")
def quiet(served_model_dir, tmp_path_factory):
    """Info-level logs, no --log-requests."""
    proc = start_server(served_model_dir, tmp_path_factory.mktemp("quiet") / "serve.log",
                        "--uvicorn-log-level", "info")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def logged(served_model_dir, tmp_path_factory):
    proc = start_server(served_model_dir, tmp_path_factory.mktemp("logged") / "serve.log",
                        "--uvicorn-log-level", "info", "--log-requests", "--max-log-len", str(MAX_LOG_LEN))
    yield proc
    proc.stop()


# ---- the API key ----
async def test_the_key_is_compared_as_equal_length_digests(monkeypatch):
    compared, compare_digest = [], hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return compare_digest(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    passed = []

    async def app(scope, receive, send):
        passed.append(scope)

    async def send(message):
        pass

    middleware = APIKeyMiddleware(app, "sk-right")
    for offered in (b"", b"s", b"sk-righ", b"sk-rightX", b"x" * 1000, b"sk-right"):
        scope = {"type": "http", "path": "/v1/models", "headers": [(b"authorization", b"Bearer " + offered)]}
        await middleware(scope, None, send)
    assert len(passed) == 1 and passed[0]["headers"][0][1] == b"Bearer sk-right"
    assert compared == [(32, 32)] * 6  # SHA-256 digests whatever the offered length


async def test_a_query_key_is_cut_from_the_scope_and_counts_only_for_the_websocket():
    seen = []

    async def app(scope, receive, send):
        seen.append(("app", scope["type"]))

    async def send(message):
        seen.append(("sent", message.get("status", message["type"])))

    middleware = APIKeyMiddleware(app, "sk-right")
    for scope_type, query in (("websocket", b"trace=1&api_key=sk-right"), ("websocket", b"api_key=sk-wrong&trace=1"),
                              ("http", b"trace=1&api_key=sk-right")):
        scope = {"type": scope_type, "path": "/v1/models", "headers": [], "query_string": query}
        await middleware(scope, None, send)
        assert scope["query_string"] == b"trace=1"  # uvicorn logs the scope's query string
    assert seen[:2] == [("app", "websocket"), ("sent", "websocket.close")]
    assert seen[2] == ("sent", 401)  # HTTP takes the key from the Authorization header only


async def test_the_websocket_key_never_reaches_the_log(quiet):
    async with connect(f"{quiet.ws_url}?api_key={quiet.api_key}&trace=abc", proxy=None) as sock:
        await sock.send(json.dumps({"id": "a", "type": "completions", "body": {"prompt": "x", "max_tokens": 1}}))
        assert json.loads(await sock.recv())["type"] == "chunk"
    wrong_key = "sk-wrong-0123456789"
    with pytest.raises(InvalidStatus):
        async with connect(f"{quiet.ws_url}?api_key={wrong_key}", proxy=None):
            pass
    log = quiet.log_path.read_text()
    assert '"WebSocket /v1/ws?trace=abc" [accepted]' in log  # uvicorn did log the path and query
    assert quiet.api_key not in log and wrong_key not in log


# ---- no stack traces ----
@pytest.fixture
def app_client(served_model_dir):
    engine = AsyncEngine.from_args(EngineArgs(model=str(served_model_dir), device="cpu", max_model_len=128))
    with TestClient(build_app(engine), raise_server_exceptions=False) as client:
        yield client, engine


def assert_bare_server_error(error: dict) -> None:
    assert error == {"message": "internal server error", "type": "server_error", "param": None,
                     "code": "internal_error"}


def boom(*args, **kwargs):
    raise RuntimeError(f"{SECRET} at line 42")


def test_a_bug_mid_request_shows_no_trace_to_the_client(app_client, monkeypatch, caplog):
    client, _ = app_client
    monkeypatch.setattr(CompletionFormat, "response", boom)
    monkeypatch.setattr(CompletionFormat, "chunk", boom)
    body = {"prompt": "x", "max_tokens": 2}

    plain = client.post("/v1/completions", json=body)
    assert plain.status_code == 500
    assert_bare_server_error(plain.json()["error"])

    stream = client.post("/v1/completions", json={**body, "stream": True})
    assert stream.status_code == 200
    *_, error_event, done = sse_payloads(stream.content)
    assert_bare_server_error(json.loads(error_event)["error"])
    assert done == "[DONE]"

    with client.websocket_connect("/v1/ws") as sock:
        sock.send_text(json.dumps({"id": "a", "type": "completions", "body": body}))
        frame = sock.receive_json()
    assert frame["type"] == "error" and frame["id"] == "a"
    assert_bare_server_error(frame["error"])

    for text in (plain.text, stream.text, json.dumps(frame)):
        assert SECRET not in text and "Traceback" not in text
    logged = [r for r in caplog.records if r.exc_info and SECRET in str(r.exc_info[1])]
    assert len(logged) == 3  # the operator gets each traceback


def test_a_bug_before_the_request_is_queued_shows_no_trace(app_client, monkeypatch):
    client, engine = app_client
    monkeypatch.setattr(engine, "add_request", boom)
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 500 and SECRET not in response.text
    assert_bare_server_error(response.json()["error"])
    with client.websocket_connect("/v1/ws") as sock:
        sock.send_text(json.dumps({"id": "a", "type": "completions", "body": {"prompt": "x"}}))
        frame = sock.receive_json()
        assert_bare_server_error(frame["error"])
        sock.send_text(json.dumps({"id": "b", "type": "cancel"}))  # the socket still answers frames
        sock.send_text("{not json")
        assert sock.receive_json()["error"]["type"] == "invalid_request_error"


# ---- prompts in the logs ----
GENERATE = {"max_tokens": 24, "ignore_eos": True}


def ws_completion(server, prompt: str) -> tuple[str, str]:
    """One completion over the WebSocket -> (its id, the text generated)."""
    with sync_connect(server.ws_url, additional_headers=server.headers, proxy=None) as sock:
        sock.send(json.dumps({"id": "w", "type": "completions", "body": {"prompt": prompt, **GENERATE}}))
        chunks = []
        while (frame := json.loads(sock.recv()))["type"] == "chunk":
            chunks.append(frame["data"])
    return chunks[0]["id"], "".join(c["choices"][0]["text"] for c in chunks)


def send_marked_requests(server, marker: str) -> tuple[list[str], list[str]]:
    """A completion, a chat stream and a WebSocket completion whose prompts start with
    `marker`, plus one the server refuses -> (the response ids, the texts generated)."""
    ids, texts = [], []
    with server.client() as client:
        out = client.post("/v1/completions", json={"prompt": f"{marker} one", **GENERATE}).json()
        ids.append(out["id"])
        texts.append(out["choices"][0]["text"])
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": f"{marker} two"}],
                                                          "stream": True, **GENERATE})
        chunks = [json.loads(p) for p in sse_payloads(chat.content)[:-1]]
        ids.append(chunks[0]["id"])
        texts.append("".join(c["choices"][0]["delta"].get("content", "") for c in chunks))
        refused = client.post("/v1/completions", json={"prompt": f"{marker} three", "temperature": -1})
        assert refused.status_code == 400
    request_id, text = ws_completion(server, f"{marker} four")
    return ids + [request_id], texts + [text]


def test_logs_hold_no_prompt_or_generated_text_by_default(quiet):
    _, texts = send_marked_requests(quiet, MARKER)
    log = quiet.log_path.read_text()
    assert '"POST /v1/completions HTTP/1.1" 200' in log  # info-level lines are captured
    assert MARKER not in log
    long_texts = [text for text in texts if len(text) >= 16]  # short ones could occur by chance
    assert long_texts and not any(text in log for text in long_texts)


def test_log_requests_logs_one_line_per_request_with_its_prompt(logged):
    ids, texts = send_marked_requests(logged, MARKER)
    tail_marker = "tail-marker-5518"
    with logged.client() as client:
        long_prompt = f"{MARKER} {'pad ' * MAX_LOG_LEN}{tail_marker}"
        ids.append(client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1}).json()["id"])
    lines = logged.log_path.read_text().splitlines()
    for request_id, prompt_word in zip(ids, ("one", "two", "four", "pad"), strict=True):
        [line] = [line for line in lines if request_id in line]
        assert f"{MARKER} {prompt_word}" in line and "params SamplingParams(" in line
    assert not any(tail_marker in line for line in lines)  # cut at --max-log-len
    assert sum(MARKER in line for line in lines) == 4  # the refused request was never queued
    assert not any(text in line for text in texts if len(text) >= 16 for line in lines)
