"""`sparkd serve`: the OpenAI-compatible server on uvicorn (uvloop + httptools), run as a daemon.

Under systemd (Type=notify, see systemd/sparkd.service) it reports load progress as
STATUS= lines, READY=1 once the port is bound and the engine runs, and WATCHDOG=1
pings only while the engine loop makes progress: a stuck loop or a hung GPU stops
them and systemd restarts the process. SIGTERM drains (drain.py). It never lingers
half-alive: a dead engine, a crashed loop or a port it cannot bind ends it non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import threading
import time

import uvicorn
import uvloop

from .drain import DrainingServer
from .engine_flags import add_engine_flags, load_engine
from .sd_notify import SystemdNotifier, feed_watchdog
from .server_flags import add_server_limit_flags, server_limits_from

log = logging.getLogger("sparkd.serve")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# After the engine dies, /health answers 503 for DEAD_ENGINE_GRACE_S, then the process
# exits 1 so that systemd restarts it. Should that shutdown hang (a destructor calling
# into the poisoned device), the process ends anyway DEAD_ENGINE_SHUTDOWN_LIMIT_S later:
# within 5 s of the fault in all.
DEAD_ENGINE_GRACE_S = 2.0
DEAD_ENGINE_SHUTDOWN_LIMIT_S = 2.5


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
    server.add_argument("--drain-timeout", type=_seconds, default=DEFAULT_DRAIN_TIMEOUT_S,
                        help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish before they "
                             "are ended with an error; new requests get 503 meanwhile (default: %(default)s)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"))
    add_server_limit_flags(parser)
    add_engine_flags(parser)
    parser.set_defaults(func=run)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text!r}")
    return value


def run(ns: argparse.Namespace) -> int:
    from ..api.app import build_app

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise SystemExit(f"sparkd: error: two models given: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    # The watchdog kills a hung process with SIGABRT: leave every thread's stack in the journal.
    faulthandler.enable()
    notifier = SystemdNotifier()
    names = ns.served_model_name
    limits = server_limits_from(ns)
    notifier.status("loading the model")
    engine = load_engine(ns, names[0] if names else None, progress=notifier.status)
    app = build_app(engine, names, ns.api_key, limits)
    host = ns.host or "0.0.0.0"
    config = uvicorn.Config(app, host=host, port=ns.port, loop="uvloop", http="httptools",
                            log_level=ns.uvicorn_log_level, timeout_graceful_shutdown=5)
    server = DrainingServer(config, app.state.sparkd, ns.drain_timeout, notifier)
    url = f"http://{host}:{ns.port}/v1"
    uvloop.run(_serve(server, engine, notifier, url))
    if engine.is_dead:
        log.critical("exiting because the engine died: %s", engine.dead_reason)
        return 1
    return 0


async def _serve(server: DrainingServer, engine, notifier: SystemdNotifier, url: str) -> None:
    helpers = [asyncio.create_task(_exit_when_dead(server, engine, notifier)),
               asyncio.create_task(_announce_and_keep_alive(server, engine, notifier, url))]
    try:
        await server.serve()
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        notifier.close()


async def _announce_and_keep_alive(server: DrainingServer, engine, notifier: SystemdNotifier, url: str) -> None:
    """READY=1 once uvicorn listens, then watchdog pings tied to the engine loop's heartbeat."""
    await server.serving.wait()
    log.info("serving %s on %s", engine.model_name, url)
    notifier.ready(f"serving {engine.model_name} on {url}")
    max_age_s = _max_heartbeat_age_s(notifier.watchdog_interval_s)
    await feed_watchdog(notifier, lambda: not engine.is_dead and time.monotonic() - engine.heartbeat < max_age_s)


def _max_heartbeat_age_s(watchdog_interval_s: float | None) -> float:
    """How old the engine's heartbeat may be for a ping: half the watchdog interval, but
    never so little that the idle loop's own wake-ups (every HEARTBEAT_INTERVAL_S) miss it."""
    from ..engine.async_engine import HEARTBEAT_INTERVAL_S

    return max((watchdog_interval_s or 0.0) / 2, 2 * HEARTBEAT_INTERVAL_S)


async def _exit_when_dead(server: DrainingServer, engine, notifier: SystemdNotifier) -> None:
    reason = await engine.wait_dead()
    notifier.status(f"the engine died, exiting: {reason}")
    _exit_if_still_alive_after(DEAD_ENGINE_GRACE_S + DEAD_ENGINE_SHUTDOWN_LIMIT_S)
    await asyncio.sleep(DEAD_ENGINE_GRACE_S)
    server.should_exit = True
    server.force_exit = True  # nothing can be served any more: do not wait for idle connections


def _exit_if_still_alive_after(seconds: float) -> None:
    """A daemon thread: it fires even if the event loop is blocked in a hung device call."""
    timer = threading.Timer(seconds, _exit_now)
    timer.daemon = True
    timer.start()


def _exit_now() -> None:
    log.critical("shutting down after the engine died hung; exiting now. Where each thread was:")
    faulthandler.dump_traceback(all_threads=True)
    os._exit(1)
