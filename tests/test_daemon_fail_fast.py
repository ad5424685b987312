"""Fail fast: when the engine dies, `sparkd serve` answers 503 and exits 1 within seconds,
so systemd's Restart=on-failure starts a fresh process. It never lingers half-alive.

The fault goes into a real server process through a `sitecustomize` module on its
PYTHONPATH (Python's site hook imports it at start-up): the engine's first
scheduling call raises. A DeviceLostError is how the CUDA backend reports a sticky
device error; any other exception there is a crashed engine loop. Both must end the
process the same way, and so must a shutdown that then hangs (as a call into a
poisoned device can). tests/gpu/test_daemon_cuda.py does it with a real device fault.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from server_fixtures import start_server

EXIT_AFTER_DEATH_S = 5.0
FAIL_THE_FIRST_STEP = """
from sparkd.backend.base import DeviceLostError
from sparkd.engine.llm_engine import LLMEngine


def fail(self, *args, **kwargs):
    raise {error}("injected by tests/test_daemon_fail_fast.py")


LLMEngine.schedule = fail
"""
HANG_IN_SHUTDOWN = """
import time

from sparkd.engine.async_engine import AsyncEngine


async def hang(self):
    time.sleep(600)  # blocks the event loop, as a call into a poisoned device might


AsyncEngine.shutdown = hang
"""


def start_with_fault(tmp_path, monkeypatch, model_dir, fault_source: str):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(fault_source)
    monkeypatch.setenv("PYTHONPATH", str(inject))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # sitecustomize loads numpy before sparkd's CLI can set it
    return start_server(model_dir, tmp_path / "serve.log")


def kill_the_engine_and_wait_for_exit(server, reason: str) -> int:
    """Send a request that kills the engine; the exit code, which must come within 5 s."""
    with server.client() as client:
        failed = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        died_at = time.monotonic()
        assert failed.status_code == 503, failed.text
        assert reason in failed.json()["error"]["message"] and "Traceback" not in failed.text
        assert client.get("/health").status_code == 503
    try:
        exit_code = server.process.wait(timeout=EXIT_AFTER_DEATH_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {EXIT_AFTER_DEATH_S} s after the engine died:\n{server.log_tail()}")
    assert time.monotonic() - died_at <= EXIT_AFTER_DEATH_S
    return exit_code


@pytest.mark.parametrize("error, reason", [
    ("DeviceLostError", "the device is lost"),
    ("RuntimeError", "engine loop crashed"),
])
def test_a_dead_engine_ends_the_process_with_exit_code_1(error, reason, served_model_dir, tmp_path, monkeypatch):
    server = start_with_fault(tmp_path, monkeypatch, served_model_dir, FAIL_THE_FIRST_STEP.format(error=error))
    try:
        exit_code = kill_the_engine_and_wait_for_exit(server, reason)
    finally:
        server.stop()
    assert exit_code == 1, server.log_tail()
    assert "exiting because the engine died" in server.log_tail()


def test_a_shutdown_that_hangs_after_the_engine_died_is_cut_short(served_model_dir, tmp_path, monkeypatch):
    fault = FAIL_THE_FIRST_STEP.format(error="DeviceLostError") + HANG_IN_SHUTDOWN
    server = start_with_fault(tmp_path, monkeypatch, served_model_dir, fault)
    try:
        exit_code = kill_the_engine_and_wait_for_exit(server, "the device is lost")
    finally:
        server.stop()
    assert exit_code == 1, server.log_tail()
    log = server.log_tail(20000)
    assert "exiting now" in log and "in hang" in log  # where it hung is in the log
