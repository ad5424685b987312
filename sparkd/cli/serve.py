"""`sparkd serve`: the OpenAI-compatible server on uvicorn (uvloop + httptools)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import uvicorn
import uvloop

from .engine_flags import add_engine_flags, load_engine

log = logging.getLogger("sparkd.serve")

# After the engine dies, /health answers 503 for this long before the process
# exits non-zero (so systemd restarts it).
DEAD_ENGINE_GRACE_S = 2.0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over the OpenAI HTTP API and WebSocket",
                                   description="Serve a model over the OpenAI HTTP API and a WebSocket "
                                               "(with no model: the embedded demo model).")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint directory (same as --model)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=None, help="address to bind (default: all interfaces)")
    server.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="names the model answers to; the first is reported (default: --model)")
    server.add_argument("--api-key", default=os.environ.get("SPARKD_API_KEY"),
                        help="require `Authorization: Bearer KEY` on /v1 (default: $SPARKD_API_KEY)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"))
    add_engine_flags(parser)
    parser.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from ..api.app import build_app

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise SystemExit(f"sparkd: error: two models given: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    names = ns.served_model_name
    engine = load_engine(ns, names[0] if names else None)
    app = build_app(engine, names, ns.api_key)
    config = uvicorn.Config(app, host=ns.host or "0.0.0.0", port=ns.port, loop="uvloop", http="httptools",
                            log_level=ns.uvicorn_log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    log.info("serving %s on http://%s:%d/v1", engine.model_name, ns.host or "0.0.0.0", ns.port)
    uvloop.run(_serve(server, engine))
    if engine.is_dead:
        log.critical("exiting because the engine died: %s", engine.dead_reason)
        return 1
    return 0


async def _serve(server: uvicorn.Server, engine) -> None:
    watchdog = asyncio.create_task(_exit_when_dead(server, engine))
    try:
        await server.serve()
    finally:
        watchdog.cancel()


async def _exit_when_dead(server: uvicorn.Server, engine) -> None:
    while not engine.is_dead:
        await asyncio.sleep(0.5)
    await asyncio.sleep(DEAD_ENGINE_GRACE_S)
    server.should_exit = True
