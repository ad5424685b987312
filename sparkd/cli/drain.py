"""Graceful drain on SIGTERM / SIGINT: a uvicorn Server that lets in-flight streams finish.

uvicorn's own handlers stop accepting and close every connection after
`timeout_graceful_shutdown`, whatever is still streaming, and re-raise the signal
once `serve()` returns, so the process would die by the signal instead of exiting 0.
`DrainingServer` takes the two signals over. On the first one:
1. `state.draining` is set: new generation requests and /health answer 503 with
   Retry-After (the API layer does that), so a proxy takes this instance out;
2. open requests run on until they finish, for up to `drain_timeout_s`;
3. those still open then end with an error event (`engine.fail_all`);
4. uvicorn shuts down as usual and the process exits 0.
A second signal skips the rest of the wait (step 3 happens at once); a third, during
uvicorn's own shutdown, stops waiting for connections to close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Generator
from typing import TYPE_CHECKING

import uvicorn

from .sd_notify import SystemdNotifier

if TYPE_CHECKING:
    from ..api.state import ServerState

log = logging.getLogger("sparkd.drain")

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SHUTDOWN_MESSAGE = "the server is shutting down"
_POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float,
                 notifier: SystemdNotifier):
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.notifier = notifier
        self.serving = asyncio.Event()  # set once the port is bound and the app has started
        self._drain: asyncio.Task | None = None
        self._cut_short = False

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        loop = asyncio.get_running_loop()
        for sig in DRAIN_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in DRAIN_SIGNALS:
                loop.remove_signal_handler(sig)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self._drain is None:  # a signal during start-up: never announce it
            self.serving.set()

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._drain is None:
            log.warning("%s: draining (at most %g s), then stopping", name, self.drain_timeout_s)
            self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit(), name="sparkd-drain")
        elif not self.should_exit:
            log.warning("%s again: ending the drain now", name)
            self._cut_short = True
        else:
            log.warning("%s again: not waiting for connections to close", name)
            self.force_exit = True

    async def _drain_then_exit(self) -> None:
        engine = self.state.engine
        self.state.draining = True
        self.notifier.stopping(f"draining {engine.num_open_requests} requests")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        reported = engine.num_open_requests
        while engine.num_open_requests and not self._cut_short and loop.time() < deadline:
            if engine.num_open_requests != reported:
                reported = engine.num_open_requests
                self.notifier.status(f"draining {reported} requests")
            await asyncio.sleep(_POLL_S)
        if engine.num_open_requests:
            log.warning("failing the %d requests still open", engine.num_open_requests)
            engine.fail_all(SHUTDOWN_MESSAGE)
        self.notifier.status("stopping")
        self.should_exit = True
