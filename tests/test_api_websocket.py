"""/v1/ws against a real server: several requests on one socket, cancel, and errors per frame."""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.asyncio.client import connect

CHAT = {"messages": [{"role": "user", "content": "hello"}]}
REQUESTS = {
    "a": ("completions", {"prompt": "one two", "max_tokens": 6, "seed": 1, "ignore_eos": True}),
    "b": ("chat.completions", {**CHAT, "max_tokens": 4, "seed": 2, "ignore_eos": True}),
    "c": ("completions", {"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 3, "seed": 3, "ignore_eos": True}),
}
HTTP_PATHS = {"completions": "/v1/completions", "chat.completions": "/v1/chat/completions"}


def ws(server):
    return connect(server.ws_url, additional_headers=server.headers, proxy=None)


async def send(sock, client_id, kind, body=None):
    frame = {"id": client_id, "type": kind}
    if body is not None:
        frame["body"] = body
    await sock.send(json.dumps(frame))


async def frames_until_done(sock, ids) -> list[dict]:
    """Every frame until each of `ids` has had its done (or error) frame."""
    frames, open_ids = [], set(ids)
    while open_ids:
        frame = json.loads(await sock.recv())
        frames.append(frame)
        if frame["type"] in ("done", "error"):
            open_ids.discard(frame["id"])
    return frames


def choice_texts(chunks: list[dict]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            piece = choice["text"] if "text" in choice else choice["delta"].get("content", "")
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


async def test_multiplexed_requests_match_their_http_twins(server):
    async with ws(server) as sock:
        for client_id, (kind, body) in REQUESTS.items():
            await send(sock, client_id, kind, {**body, "stream": False})  # WebSocket always streams
        frames = await frames_until_done(sock, REQUESTS)
    first_done = next(i for i, f in enumerate(frames) if f["type"] == "done")
    first_chunk = {f["id"]: i for i, f in reversed(list(enumerate(frames))) if f["type"] == "chunk"}
    assert all(i < first_done for i in first_chunk.values()), "the three requests ran concurrently"
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as http:
        for client_id, (kind, body) in REQUESTS.items():
            mine = [f for f in frames if f["id"] == client_id]
            assert [f["type"] for f in mine] == ["chunk"] * (len(mine) - 1) + ["done"]
            expected = (await http.post(HTTP_PATHS[kind], json=body)).json()
            assert mine[-1] == {"id": client_id, "type": "done", "usage": expected["usage"], "cancelled": False}
            texts = choice_texts([f["data"] for f in mine[:-1]])
            key = "text" if kind == "completions" else "message"
            want = {c["index"]: c[key] if key == "text" else c[key]["content"] for c in expected["choices"]}
            assert texts == want


async def test_cancel_stops_one_request_and_spares_the_others(server):
    async with ws(server) as sock:
        await send(sock, "long", "completions", {"prompt": "x", "max_tokens": 200, "ignore_eos": True})
        await send(sock, "short", "completions", {"prompt": "y", "max_tokens": 20, "ignore_eos": True})
        frames = []
        while not any(f["id"] == "long" and f["type"] == "chunk" for f in frames):
            frames.append(json.loads(await sock.recv()))
        await send(sock, "long", "cancel")
        await send(sock, "no-such-id", "cancel")  # ignored: it may just have finished
        frames += await frames_until_done(sock, ["long", "short"])
    long = [f for f in frames if f["id"] == "long"]
    assert long[-1]["type"] == "done" and long[-1]["cancelled"] is True
    assert 0 < long[-1]["usage"]["completion_tokens"] < 200
    short = [f for f in frames if f["id"] == "short"]
    assert short[-1] == {"id": "short", "type": "done", "cancelled": False,
                         "usage": {**short[-1]["usage"], "completion_tokens": 20}}
    assert not any(f["type"] == "error" for f in frames)
    server.wait_idle()


@pytest.mark.parametrize("frame, frame_id, param", [
    (b"{not json", None, None),
    (json.dumps({"id": "e1", "type": "completions"}), "e1", "body"),
    (json.dumps({"id": "e2", "type": "explode", "body": {}}), "e2", "type"),
    (json.dumps({"id": "e3", "type": "completions", "body": {"prompt": "x", "max_tokens": "many"}}), "e3",
     "body.max_tokens"),
    (json.dumps({"id": "e4", "type": "completions", "body": {"prompt": "x", "temperature": -1}}), "e4", "temperature"),
    (json.dumps({"id": "e5", "type": "chat.completions", "body": {"messages": [], "model": "nope"}}), "e5", "model"),
    (json.dumps({"id": 7, "type": "cancel"}), None, "id"),
])
async def test_bad_frames_get_an_error_frame_and_the_socket_lives_on(server, frame, frame_id, param):
    async with ws(server) as sock:
        await sock.send(frame)
        error = json.loads(await sock.recv())
        assert error["type"] == "error" and error["id"] == frame_id
        assert error["error"]["param"] == param and error["error"]["message"]
        assert set(error["error"]) == {"message", "type", "param", "code"}
        await send(sock, "ok", "completions", {"prompt": "z", "max_tokens": 2})
        frames = await frames_until_done(sock, ["ok"])
        assert frames[-1]["type"] == "done"


async def test_duplicate_id_in_flight_is_refused(server):
    async with ws(server) as sock:
        await send(sock, "dup", "completions", {"prompt": "x", "max_tokens": 30, "ignore_eos": True})
        await send(sock, "dup", "completions", {"prompt": "x", "max_tokens": 30, "ignore_eos": True})
        frames = await frames_until_done(sock, ["dup"])
        if frames[-1]["type"] == "error":  # the refusal came before the first request's end
            frames += await frames_until_done(sock, ["dup"])
    errors = [f for f in frames if f["type"] == "error"]
    assert len(errors) == 1 and errors[0]["error"]["param"] == "id"
    assert frames[-1]["type"] == "done" and frames[-1]["usage"]["completion_tokens"] == 30
