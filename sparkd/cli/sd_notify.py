"""systemd's readiness and watchdog protocol (sd_notify(3)), without libsystemd.

A service of Type=notify reports to systemd by sending datagrams of newline-separated
`KEY=VALUE` lines to the AF_UNIX socket named in $NOTIFY_SOCKET (a path, or an
abstract name written with a leading `@`): `READY=1` once it serves, `STATUS=...`
for `systemctl status`, `WATCHDOG=1` keep-alive pings, `STOPPING=1` when it begins to
shut down. With WatchdogSec= set, systemd passes the ping deadline in $WATCHDOG_USEC
(and the pid it is meant for in $WATCHDOG_PID) and kills the service when a deadline
passes without a ping. Outside systemd the variables are unset and every call here
does nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger("sparkd.sd_notify")


class SystemdNotifier:
    def __init__(self, environ: Mapping[str, str] = os.environ):
        self.address = _socket_address(environ.get("NOTIFY_SOCKET", ""))
        self.watchdog_interval_s = _watchdog_interval_s(environ)
        self._socket: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *assignments: str) -> None:
        """One datagram of `KEY=VALUE` lines, e.g. send("READY=1", "STATUS=serving")."""
        if self.address is None:
            return
        if self._socket is None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self._socket.sendto("\n".join(assignments).encode(), self.address)
        except OSError as exc:
            # systemd going away (a daemon-reexec, a test's listener closing) must not take the server down.
            log.warning("sd_notify to %r failed: %s", self.address, exc)

    def status(self, text: str) -> None:
        self.send(status_line(text))

    def ready(self, status: str) -> None:
        self.send("READY=1", status_line(status))

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", status_line(status))

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def status_line(text: str) -> str:
    """STATUS=text; a newline would start a new assignment, so it becomes a space."""
    return "STATUS=" + " ".join(text.splitlines())


async def feed_watchdog(notifier: SystemdNotifier, is_alive: Callable[[], bool]) -> None:
    """Send WATCHDOG=1 every half watchdog interval while `is_alive()`; runs until cancelled.
    Returns at once when systemd armed no watchdog for this process."""
    interval_s = notifier.watchdog_interval_s
    if interval_s is None or not notifier.enabled:
        return
    while True:
        if is_alive():
            notifier.send("WATCHDOG=1")
        await asyncio.sleep(interval_s / 2)


def _socket_address(value: str) -> str | bytes | None:
    if value.startswith("/"):
        return value
    if value.startswith("@"):  # Linux abstract namespace: a leading NUL byte, no file
        return b"\0" + value[1:].encode()
    if value:
        log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract socket: not notifying systemd", value)
    return None


def _watchdog_interval_s(environ: Mapping[str, str]) -> float | None:
    """$WATCHDOG_USEC in seconds, or None when unset, invalid, or meant for another process."""
    usec, pid = environ.get("WATCHDOG_USEC", ""), environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 1e6
