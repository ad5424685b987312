"""Malformed and hostile requests: each gets the right 4xx with OpenAI-shaped JSON, and the
server stays healthy and keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from server_fixtures import MAX_MODEL_LEN, VOCAB_SIZE

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


# (name, method, path, raw body, expected status, expected `param` or None, text the message must hold)
CASES = [
    ("bad JSON", "POST", COMPLETIONS, b'{"prompt": "x",', 400, None, "not valid JSON"),
    ("invalid UTF-8", "POST", COMPLETIONS, b'{"prompt": "\xc3\x28\xff"}', 400, None, "UTF-8"),
    ("empty body", "POST", CHAT, b"", 400, None, "not valid JSON"),
    ("JSON null", "POST", CHAT, b"null", 400, None, "Expected `object`"),
    ("JSON array", "POST", COMPLETIONS, b"[1, 2]", 400, None, "Expected `object`"),
    ("NaN literal", "POST", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, None, "not valid JSON"),
    ("deep nesting", "POST", COMPLETIONS, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, ""),
    ("form body", "POST", COMPLETIONS, b"prompt=x&max_tokens=3", 400, None, "not valid JSON"),
    ("string for a number", "POST", COMPLETIONS, body(prompt="x", temperature="hot"), 400, "temperature", "float"),
    ("bool for an int", "POST", CHAT, body(messages=MSGS, max_tokens=True), 400, "max_tokens", "int"),
    ("float for an int", "POST", COMPLETIONS, body(prompt="x", n=1.5), 400, "n", "int"),
    ("object for messages", "POST", CHAT, body(messages={"role": "user"}), 400, "messages", "array"),
    ("missing messages", "POST", CHAT, body(model="x"), 400, None, "messages"),
    ("unknown field", "POST", COMPLETIONS, body(prompt="x", frobnicate=1), 400, "frobnicate", "Unrecognized"),
    ("unknown nested field", "POST", CHAT, body(messages=[{"role": "user", "content": "x", "x": 1}]), 400,
     "messages[0].x", "Unrecognized"),
    ("n = 0", "POST", COMPLETIONS, body(prompt="x", n=0), 400, "n", "n must be"),
    ("negative max_tokens", "POST", COMPLETIONS, body(prompt="x", max_tokens=-1), 400, "max_tokens", "max_tokens"),
    ("top_p over 1", "POST", CHAT, body(messages=MSGS, top_p=5), 400, "top_p", "top_p"),
    ("too many logprobs", "POST", COMPLETIONS, body(prompt="x", logprobs=100), 400, "logprobs", "logprobs"),
    ("stop id outside the vocabulary", "POST", COMPLETIONS,
     body(prompt="x", min_tokens=1, max_tokens=2, stop_token_ids=[100000]), 400, "stop_token_ids", "vocabulary"),
    ("top_logprobs without logprobs", "POST", CHAT, body(messages=MSGS, top_logprobs=3), 400, "top_logprobs", ""),
    ("seed over 64 bits", "POST", COMPLETIONS, body(prompt="x", seed=2**80), 400, "seed", ""),
    ("huge temperature", "POST", COMPLETIONS, b'{"prompt": "x", "temperature": 1e400}', 400, "temperature", ""),
    ("too many stop strings", "POST", COMPLETIONS, body(prompt="x", stop=[str(i) for i in range(50)]), 400, "stop", ""),
    ("empty stop string", "POST", CHAT, body(messages=MSGS, stop=[""]), 400, "stop", ""),
    ("unknown model", "POST", COMPLETIONS, body(prompt="x", model="gpt-5"), 404, "model", "gpt-5"),
    ("prompt over max_model_len", "POST", COMPLETIONS, body(prompt=[5] * (MAX_MODEL_LEN + 44)), 400, "prompt",
     f"{MAX_MODEL_LEN + 44}"),
    ("prompt + max_tokens over max_model_len", "POST", COMPLETIONS, body(prompt=[5] * 100, max_tokens=200), 400,
     "max_tokens", f"{MAX_MODEL_LEN}"),
    ("token id past the vocabulary", "POST", COMPLETIONS, body(prompt=[1, VOCAB_SIZE + 7]), 400, "prompt",
     f"{VOCAB_SIZE + 7}"),
    ("negative token id", "POST", COMPLETIONS, body(prompt=[-1]), 400, "prompt", "-1"),
    ("64-bit token id", "POST", COMPLETIONS, body(prompt=[2**63]), 400, "prompt", ""),
    ("second prompt bad", "POST", COMPLETIONS, body(prompt=[[1, 2], [VOCAB_SIZE]]), 400, "prompt[1]", ""),
    ("mixed prompt list", "POST", COMPLETIONS, body(prompt=[1, "a"]), 400, "prompt", ""),
    ("empty prompt list", "POST", COMPLETIONS, body(prompt=[]), 400, "prompt", "empty"),
    ("empty token prompt", "POST", COMPLETIONS, body(prompt=[[]]), 400, "prompt", "empty"),
    ("empty messages", "POST", CHAT, body(messages=[]), 400, "messages", "empty"),
    ("unknown role", "POST", CHAT, body(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", ""),
    ("template raise_exception", "POST", CHAT, body(messages=[{"role": "tool", "content": "x"}]), 400, "messages",
     "unsupported role: tool"),
    ("image content", "POST", CHAT,
     body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content[0].type", ""),
    ("reserved template kwarg", "POST", CHAT, body(messages=MSGS, chat_template_kwargs={"tokenize": True}), 400,
     "chat_template_kwargs", ""),
    ("continue without assistant", "POST", CHAT, body(messages=MSGS, continue_final_message=True,
                                                     add_generation_prompt=False), 400, "continue_final_message", ""),
    ("unknown route", "GET", "/v1/engines", b"", 404, None, "Not Found"),
    ("wrong method", "GET", COMPLETIONS, b"", 405, None, "Method Not Allowed"),
]


@pytest.mark.parametrize("name, method, path, raw, status, param, text", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_an_openai_error(server, name, method, path, raw, status, param, text):
    response = httpx.request(method, server.base_url + path, content=raw, timeout=30,
                             headers={**server.headers, "content-type": "application/json"})
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    payload = response.json()
    assert list(payload) == ["error"]
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert text in error["message"] and "Traceback" not in response.text


def test_server_is_healthy_and_serving_after_the_abuse(server):
    with server.client() as client:
        for _, method, path, raw, *_ in CASES:  # once more, back to back on one connection
            client.request(method, path, content=raw)
        assert client.get("/health").status_code == 200
        out = client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 3, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 3
    server.wait_idle()
    assert server.process.poll() is None
