"""SSE framing, and the response's reaction to a client that leaves mid-stream."""

import asyncio
import json

from sparkd.api.errors import bad_request
from sparkd.api.responses import CompletionChoice, CompletionResponse
from sparkd.api.sse import DONE, EventStreamResponse, sse_error, sse_event


def test_event_framing_is_one_data_line_and_a_blank_line():
    chunk = CompletionResponse("cmpl-1", "text_completion", 5, "m", [CompletionChoice(0, "hi\n", None, None)])
    assert sse_event(chunk) == (b'data: {"id":"cmpl-1","object":"text_completion","created":5,"model":"m",'
                                b'"choices":[{"index":0,"text":"hi\\n","logprobs":null,"finish_reason":null,'
                                b'"stop_reason":null}]}\n\n')
    assert DONE == b"data: [DONE]\n\n"
    assert sse_error(bad_request("bad", "n").info()) == (
        b'data: {"error":{"message":"bad","type":"invalid_request_error","param":"n","code":null}}\n\n')


def test_unicode_line_separators_are_escaped():
    text = "a\u2028b\u2029c\x85d\x1ce\u00e9"
    event = sse_event(CompletionResponse("c", "text_completion", 0, "m", [CompletionChoice(0, text, None, None)]))
    line = event.decode()
    assert line.endswith("\n\n") and len(line[:-2].splitlines()) == 1
    assert json.loads(line[len("data: "):])["choices"][0]["text"] == text


class FakeClient:
    """ASGI receive/send pair; the client disconnects when `leave` is set."""

    def __init__(self):
        self.sent = []
        self.leave = asyncio.Event()

    async def receive(self):
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        self.sent.append(message)


async def test_events_are_sent_one_message_each_and_the_stream_ends():
    async def events():
        for i in range(3):
            yield f"data: {i}\n\n".encode()

    client, closed = FakeClient(), []
    await EventStreamResponse(events(), on_close=lambda: closed.append(True))({}, client.receive, client.send)
    start, *bodies = client.sent
    assert start["status"] == 200
    assert dict(start["headers"]) == {b"content-type": b"text/event-stream", b"cache-control": b"no-cache",
                                      b"x-accel-buffering": b"no"}
    assert [m["body"] for m in bodies] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert [m["more_body"] for m in bodies] == [True, True, True, False]
    assert closed == [True]


async def test_disconnect_cancels_a_waiting_stream_at_once():
    stopped = []

    async def events():
        try:
            yield b"data: first\n\n"
            await asyncio.sleep(3600)  # e.g. a request queued behind others
            yield b"data: never\n\n"
        finally:
            stopped.append("generator")

    client = FakeClient()
    response = EventStreamResponse(events(), on_close=lambda: stopped.append("on_close"))
    task = asyncio.ensure_future(response({}, client.receive, client.send))
    await asyncio.sleep(0.05)
    client.leave.set()
    await asyncio.wait_for(task, timeout=1)
    assert [m.get("body") for m in client.sent[1:]] == [b"data: first\n\n"]
    assert stopped == ["generator", "on_close"]


async def test_on_close_runs_even_if_the_stream_never_started():
    async def events():
        yield b"x"

    client, closed = FakeClient(), []
    client.leave.set()
    client.send = lambda message: asyncio.sleep(3600)  # the transport is stuck
    await asyncio.wait_for(EventStreamResponse(events(), on_close=lambda: closed.append(1))({}, client.receive,
                                                                                            client.send), 1)
    assert closed == [1]


# ---- against a real server ----
STREAM_BODY = {"prompt": "import asyncio", "max_tokens": 5, "seed": 4, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}


def split_events(raw: bytes) -> list[bytes]:
    """Events of an SSE body, each checked to be exactly one `data: ...` line ended by a blank line."""
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    for event in events:
        assert event.startswith(b"data: ") and b"\n" not in event and b"\r" not in event, event
    return [event[len(b"data: "):] for event in events]


def test_raw_sse_stream_byte_by_byte(server):
    with server.client() as client:
        full = client.post("/v1/completions", json={**STREAM_BODY, "stream": False}).json()
        with client.stream("POST", "/v1/completions", json=STREAM_BODY) as response:
            assert response.status_code == 200
            headers = response.headers
            raw = b"".join(response.iter_raw())
    assert headers["content-type"] == "text/event-stream"
    assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
    assert "content-length" not in headers  # streamed, not buffered into one body

    *payloads, done = split_events(raw)
    assert done == b"[DONE]"
    chunks = [json.loads(p) for p in payloads]
    for payload, chunk in zip(payloads, chunks, strict=True):  # compact JSON, UTF-8, nothing else on the line
        assert payload == json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()
    *token_chunks, usage_chunk = chunks
    assert len(token_chunks) == STREAM_BODY["max_tokens"]
    for chunk in chunks:
        usage_key = ["usage"] if chunk is usage_chunk else []
        assert list(chunk) == ["id", "object", "created", "model", "choices", *usage_key]
        assert chunk["id"].startswith("cmpl-") and chunk["object"] == "text_completion"
        assert chunk["model"] == full["model"]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None] * 4 + ["length"]
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == full["choices"][0]["text"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]


def test_chat_stream_without_usage_ends_with_done(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True, "stream": True}
    with server.client() as client:
        raw = client.post("/v1/chat/completions", json=body).content
    *payloads, done = split_events(raw)
    assert done == b"[DONE]"
    chunks = [json.loads(p) for p in payloads]
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None, "stop_reason": None}]
    assert len(chunks) == 1 + 3 and all("usage" not in c for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_each_event_is_flushed_as_soon_as_it_exists(server):
    """The first event reaches the client while the request is still generating:
    nothing waits for the end of the response (or for a buffer to fill)."""
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with server.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
        pieces = response.iter_raw()
        first = next(pieces)
        assert first.startswith(b"data: {")
        still_running = server.metrics()["sparkd:num_requests_running"]
        rest = b"".join(pieces)
    assert still_running == 1
    assert (first + rest).count(b"data: ") == 200 + 1
