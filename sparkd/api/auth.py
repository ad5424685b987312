"""--api-key: every /v1 route (HTTP and WebSocket) needs `Authorization: Bearer <key>`.

/health, /version and /metrics stay open, as in vLLM, so probes and scrapers
need no secret. Browsers cannot set headers on a WebSocket, so /v1/ws also
takes the key as the `api_key` query parameter.

The offered key and the real one are compared as SHA-256 digests: both sides
then have the same length, so the comparison's time says nothing about the
key, not even its length. The `api_key` query parameter is cut from the
request's query string as soon as it is read: uvicorn logs paths with their
query strings, and no log line may hold the key.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import parse_qsl, urlencode

from .errors import APIError


class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.key_digest = _digest(api_key.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or not scope["path"].startswith("/v1") or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "Incorrect or missing API key; send it as `Authorization: Bearer <key>`.",
                         code="invalid_api_key")
        if scope["type"] == "http" or "websocket.http.response" in scope.get("extensions", {}):
            await error.response()(scope, receive, send)
        else:
            await send({"type": "websocket.close", "code": 1008})

    def _authorized(self, scope) -> bool:
        offered = b""
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                offered = value[7:].strip()
        from_query = _pop_query_key(scope)  # cut from an HTTP request's query too, though only a WebSocket may use it
        if scope["type"] == "websocket":
            offered = offered or from_query
        return hmac.compare_digest(_digest(offered), self.key_digest)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _pop_query_key(scope) -> bytes:
    """The `api_key` query parameter (b"" if none), removed from the scope, which the
    server shares with its own logging."""
    pairs = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    keys = [value for name, value in pairs if name == "api_key"]
    if not keys:
        return b""
    scope["query_string"] = urlencode([(n, v) for n, v in pairs if n != "api_key"]).encode()
    return keys[0].encode()
