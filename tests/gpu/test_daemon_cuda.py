"""Fail fast, and only when it must: `sparkd serve --device cuda` under injected device faults.

- SPARKD_TEST_DEVICE_FAULT=1 (test-only): the first decode step launches a kernel
  that traps, a real sticky device error. Nothing in the process can use the GPU
  after it, so the server must exit non-zero (for systemd to restart it) within 5 s.
- SPARKD_TEST_FAIL_GRAPH_CAPTURE=1 (test-only): every decode-graph capture fails.
  Only the requests of the step that tried to capture may fail; the batch size
  then runs eagerly, later requests get the right tokens, /health stays 200.

The demo model in float32, so greedy text must equal the numpy backend's.
Plain synchronous tests: the GPU host has no pytest-asyncio.
"""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest

from sparkd import LLM, SamplingParams
from sparkd.engine.llm_engine import DEMO_MODEL_DIR

from .conftest import _device_present

pytestmark = pytest.mark.gpu

PROMPT = "The with statement"
NUM_TOKENS = 16
EXIT_AFTER_FAULT_S = 5.0
GREEDY_BODY = {"model": "sparkd-demo", "prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0,
               "ignore_eos": True}


def start_gpu_server(log_path, monkeypatch, fault_env: str):
    from tests.server_fixtures import start_server

    if not _device_present():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv(fault_env, "1")  # start_server hands the test's environment to the server
    return start_server(DEMO_MODEL_DIR, log_path, "--device", "cuda", "--dtype", "float32",
                        "--served-model-name", "sparkd-demo", "--max-num-seqs", "8",
                        "--gpu-memory-utilization", "0.3")


def assert_openai_error(response: httpx.Response) -> None:
    assert "Traceback" not in response.text
    assert response.json()["error"]["message"]


def test_a_sticky_device_error_ends_the_process_non_zero_within_5_s(tmp_path, monkeypatch):
    server = start_gpu_server(tmp_path / "serve.log", monkeypatch, "SPARKD_TEST_DEVICE_FAULT")
    try:
        with server.client(timeout=120) as client:
            failed = client.post("/v1/completions", json=GREEDY_BODY)
        faulted_at = time.monotonic()  # the answer comes back once the engine has died
        assert failed.status_code >= 500, failed.text
        assert_openai_error(failed)
        try:
            exit_code = server.process.wait(timeout=EXIT_AFTER_FAULT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {EXIT_AFTER_FAULT_S} s after the fault:\n{server.log_tail()}")
        took_s = time.monotonic() - faulted_at
    finally:
        server.stop()
    assert exit_code != 0, server.log_tail()
    assert took_s <= EXIT_AFTER_FAULT_S
    assert "the device is lost" in server.log_tail(20000)


def test_a_failed_graph_capture_leaves_the_server_serving(tmp_path, monkeypatch):
    server = start_gpu_server(tmp_path / "serve.log", monkeypatch, "SPARKD_TEST_FAIL_GRAPH_CAPTURE")
    expected = LLM(device="cpu").generate([PROMPT], SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                                   ignore_eos=True))[0].outputs[0].text
    try:
        with server.client(timeout=120) as client:
            first = client.post("/v1/completions", json=GREEDY_BODY)  # its first decode step tries to capture
            if first.status_code != 200:
                assert first.status_code == 500, first.text
                assert_openai_error(first)
            assert client.get("/health").status_code == 200
            for _ in range(3):
                later = client.post("/v1/completions", json=GREEDY_BODY)
                assert later.status_code == 200, later.text
                assert later.json()["choices"][0]["text"] == expected
            assert client.get("/health").status_code == 200
        assert server.process.poll() is None, server.log_tail()
        assert server.wait_idle()["sparkd:kv_cache_usage_perc"] == 0.0
    finally:
        exit_code = server.stop()
    assert exit_code == 0, server.log_tail()
