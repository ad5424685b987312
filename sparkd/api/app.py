"""The Starlette app: routes, error handling, auth and the engine's lifetime."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from . import openapi, routes
from .auth import APIKeyMiddleware
from .errors import APIError, server_error
from .limits import ServerLimits
from .metrics import ServerMetrics
from .state import ServerState
from .websocket import websocket_endpoint

log = logging.getLogger("sparkd.api")


def build_app(engine, served_model_names: list[str] | None = None, api_key: str | None = None,
              limits: ServerLimits | None = None) -> Starlette:
    """engine: an AsyncEngine, started and shut down with the app.
    served_model_names: the names requests may use; the first is echoed when a request names none.
    limits: admission limits (None: the defaults). `app.state.sparkd` is the ServerState;
    set its `draining` to refuse new work while a shutdown lets running requests finish."""
    names = list(served_model_names or [engine.model_name])
    state = ServerState(engine, names, ServerMetrics(engine, names[0]), limits or ServerLimits())

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = Starlette(
        routes=[
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            WebSocketRoute("/v1/ws", websocket_endpoint),
            Route("/health", routes.health, methods=["GET"]),
            Route("/version", routes.version, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            Route("/openapi.json", openapi.openapi_endpoint, methods=["GET"]),
        ],
        middleware=[Middleware(APIKeyMiddleware, api_key=api_key)] if api_key else [],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, ClientDisconnect: _client_gone,
                            Exception: _unexpected_error},
        lifespan=lifespan,
    )
    app.state.sparkd = state
    return app


async def _api_error(request: Request, exc: APIError):
    return exc.response()


async def _client_gone(request: Request, exc: ClientDisconnect):
    """The client left while sending its body: nobody reads the answer, and it is no error of ours."""
    return Response(status_code=499)


async def _http_error(request: Request, exc: HTTPException):
    """Starlette's own 404 (no such route) and 405 (wrong method), in OpenAI's shape."""
    return APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}").response()


async def _unexpected_error(request: Request, exc: Exception):
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return server_error().response()
