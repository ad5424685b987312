"""--api-key: /v1 needs the key (HTTP and WebSocket); /health, /version and /metrics stay open."""

from __future__ import annotations

import httpx
import openai
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus


def assert_401(response: httpx.Response) -> None:
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": "sk-test-sparkd"},  # no Bearer scheme
    {"Authorization": "Basic c2stdGVzdC1zcGFya2Q="},
    {"Authorization": "Bearer sk-test-sparkdX"},
])
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                          ("POST", "/v1/chat/completions"), ("GET", "/v1/nope")])
def test_v1_needs_the_key(server, headers, method, path):
    assert_401(httpx.request(method, server.base_url + path, headers=headers, json={"prompt": "x"}))


def test_the_right_key_works_and_open_routes_need_none(server):
    lowercase_scheme = {"authorization": f"bearer {server.api_key}"}
    assert httpx.get(server.base_url + "/v1/models", headers=lowercase_scheme).status_code == 200
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(server.base_url + path).status_code == 200


def test_openai_client_sees_an_authentication_error(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.completions.create(model="m", prompt="x", max_tokens=1)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


async def test_websocket_needs_the_key(server):
    with pytest.raises(InvalidStatus) as info:
        async with connect(server.ws_url, proxy=None):
            pass
    assert info.value.response.status_code == 401
    with pytest.raises(InvalidStatus):
        async with connect(server.ws_url + "?api_key=wrong", proxy=None):
            pass
    async with connect(f"{server.ws_url}?api_key={server.api_key}", proxy=None) as sock:
        await sock.send('{"id": "a", "type": "completions", "body": {"prompt": "x", "max_tokens": 1}}')
        assert '"type":"chunk"' in await sock.recv()
