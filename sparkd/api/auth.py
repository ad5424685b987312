"""--api-key: every /v1 route (HTTP and WebSocket) needs `Authorization: Bearer <key>`.

/health, /version and /metrics stay open, as in vLLM, so probes and scrapers
need no secret. Browsers cannot set headers on a WebSocket, so /v1/ws also
takes the key as the `api_key` query parameter.
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from .errors import APIError


class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

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
        if not offered and scope["type"] == "websocket":
            keys = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key", [])
            offered = keys[0].encode() if keys else b""
        return hmac.compare_digest(offered, self.api_key)
