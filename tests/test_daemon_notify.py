"""sd_notify: a real `sparkd serve` reports to a NOTIFY_SOCKET the way systemd expects.

The test plays systemd: it binds the AF_UNIX datagram socket, passes it in
$NOTIFY_SOCKET with $WATCHDOG_USEC, and reads what the server sends: STATUS=
lines while loading, READY=1 once the port is bound, WATCHDOG=1 every half
interval while the engine loop makes progress, STOPPING=1 on SIGTERM. With the
engine loop stalled (the test-only SPARKD_TEST_STALL_ENGINE_LOOP switch, a hung
GPU's stand-in) the pings stop while the event loop still answers /health.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from server_fixtures import MAX_MODEL_LEN, REPO_ROOT, start_server
from sparkd.cli.sd_notify import SystemdNotifier, feed_watchdog

WATCHDOG_USEC = 1_000_000  # pings every 0.5 s


@dataclass
class Datagram:
    received_at: float  # time.monotonic()
    fields: dict[str, str]
    port_open: bool | None = None  # READY=1 only: did the port it names accept a connection then?


@dataclass
class FakeSystemd:
    """The receiving end of $NOTIFY_SOCKET, read by a thread."""

    sock: socket.socket
    datagrams: list[Datagram] = field(default_factory=list)

    def read_forever(self) -> None:
        while True:
            try:
                payload = self.sock.recv(4096)
            except OSError:  # closed by the test
                return
            fields = dict(line.split("=", 1) for line in payload.decode().split("\n"))
            datagram = Datagram(time.monotonic(), fields)
            if fields.get("READY") == "1":
                datagram.port_open = _port_open(fields["STATUS"])
            self.datagrams.append(datagram)

    def with_field(self, key: str, value: str | None = None) -> list[Datagram]:
        return [d for d in self.datagrams if key in d.fields and value in (None, d.fields[key])]

    def pings_between(self, start: float, end: float) -> int:
        return sum(start <= d.received_at < end for d in self.with_field("WATCHDOG", "1"))

    def wait_for(self, key: str, value: str, timeout: float = 10.0) -> Datagram:
        deadline = time.monotonic() + timeout
        while not self.with_field(key, value):
            assert time.monotonic() < deadline, f"no {key}={value} in {self.datagrams}"
            time.sleep(0.05)
        return self.with_field(key, value)[0]


def _port_open(status: str) -> bool:
    host, port = re.search(r"http://([\d.]+):(\d+)", status).groups()
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture
def systemd(tmp_path, monkeypatch):
    """A FakeSystemd whose socket the servers started in this test report to."""
    path = tmp_path / "notify.sock"
    if len(str(path)) >= 100:  # sun_path holds 108 bytes
        path = tmp_path.parent / f"n{os.getpid()}.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    fake = FakeSystemd(sock)
    threading.Thread(target=fake.read_forever, daemon=True).start()
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    yield fake
    sock.close()
    path.unlink(missing_ok=True)


def test_status_ready_watchdog_and_stopping(systemd, served_model_dir, tmp_path):
    server = start_server(served_model_dir, tmp_path / "serve.log")
    try:
        ready = systemd.wait_for("READY", "1")
        assert ready.port_open, "READY=1 came before the port was bound"
        assert f"on {server.base_url}/v1" in ready.fields["STATUS"]
        before_ready = [d.fields["STATUS"] for d in systemd.datagrams if d.received_at < ready.received_at]
        assert any(s.startswith("loading weights: ") and "(100%" in s for s in before_ready), before_ready
        assert not systemd.with_field("WATCHDOG") or systemd.with_field("WATCHDOG")[0].received_at >= ready.received_at

        time.sleep(2.2)
        assert systemd.pings_between(ready.received_at, time.monotonic()) >= 3  # one per 0.5 s
        assert not systemd.with_field("STOPPING")
    finally:
        exit_code = server.stop()
    assert exit_code == 0, server.log_tail()
    stopping = systemd.wait_for("STOPPING", "1")
    assert stopping.fields["STATUS"] == "draining 0 requests"


def test_a_stalled_engine_loop_stops_the_pings_but_not_the_event_loop(systemd, served_model_dir, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("SPARKD_TEST_STALL_ENGINE_LOOP", "1")
    server = start_server(served_model_dir, tmp_path / "serve.log", "--drain-timeout", "0.5")
    try:
        ready = systemd.wait_for("READY", "1")
        time.sleep(1.0)
        assert systemd.pings_between(ready.received_at, time.monotonic()) >= 1, "no pings from an idle engine"

        # The first step this request brings hangs the engine loop for good.
        with server.client(timeout=httpx.Timeout(10, read=0.5)) as client, pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert "the engine loop hangs now" in server.log_tail()
        time.sleep(1.5)  # pings stop once the heartbeat is a second old
        quiet_from = time.monotonic()
        time.sleep(3.0)
        assert systemd.pings_between(quiet_from, time.monotonic()) == 0
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
    finally:
        exit_code = server.stop()
    # The drain gives up on the stuck request after --drain-timeout and still exits 0.
    assert exit_code == 0, server.log_tail()


def test_a_port_in_use_exits_non_zero_and_never_reports_ready(systemd, served_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "sparkd.cli.main", "serve", "--model", str(served_model_dir), "--device", "cpu",
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                             env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode != 0
    assert "address already in use" in out.stderr.lower() and "Traceback" not in out.stderr
    assert systemd.with_field("STATUS") and not systemd.with_field("READY")


@pytest.fixture
def abstract_socket():
    """(a datagram socket bound in the abstract namespace, its NOTIFY_SOCKET name)."""
    name = f"sparkd-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.setblocking(False)
        yield sock, f"@{name}"


def receive_all(sock: socket.socket) -> list[str]:
    messages = []
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except BlockingIOError:
            return messages


def test_abstract_socket_and_status_lines_stay_one_line(abstract_socket):
    sock, address = abstract_socket
    notifier = SystemdNotifier({"NOTIFY_SOCKET": address})
    notifier.ready("serving\nx")
    notifier.stopping("bye")
    notifier.close()
    assert receive_all(sock) == ["READY=1\nSTATUS=serving x", "STOPPING=1\nSTATUS=bye"]


@pytest.mark.parametrize("environ, interval", [
    ({"WATCHDOG_USEC": "30000000"}, 30.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 30.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),  # another process's
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({}, None),
])
def test_watchdog_interval_from_the_environment(environ, interval):
    assert SystemdNotifier({"NOTIFY_SOCKET": "/run/x", **environ}).watchdog_interval_s == interval


async def test_without_notify_socket_nothing_is_sent_and_the_watchdog_returns():
    notifier = SystemdNotifier({"WATCHDOG_USEC": "1000"})
    assert not notifier.enabled
    notifier.ready("serving")  # no socket to send to: a no-op, no error
    await asyncio.wait_for(feed_watchdog(notifier, lambda: True), timeout=1)


async def test_watchdog_pings_only_while_alive(abstract_socket):
    sock, address = abstract_socket
    notifier = SystemdNotifier({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "100000"})
    alive = True
    task = asyncio.create_task(feed_watchdog(notifier, lambda: alive))
    await asyncio.sleep(0.26)  # pings at 0, 50, ..., 250 ms
    alive = False
    pings_while_alive = receive_all(sock)
    await asyncio.sleep(0.2)
    task.cancel()
    notifier.close()
    assert 4 <= len(pings_while_alive) <= 7 and set(pings_while_alive) == {"WATCHDOG=1"}
    assert receive_all(sock) == []
