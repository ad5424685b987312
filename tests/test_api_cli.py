"""The `sparkd` command: --version, help, subcommand plug-ins, flag errors, and `generate`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import sparkd
from server_fixtures import REPO_ROOT
from sparkd.cli import main as cli_main


def sparkd_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "sparkd.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT, env=env)


def test_version():
    out = sparkd_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"sparkd {sparkd.__version__}"


def test_help_lists_the_commands_and_vllm_flags():
    assert {"serve", "generate"} <= set(cli_main.build_parser()._subparsers._group_actions[0].choices)
    out = sparkd_cli("serve", "--help")
    for flag in ("--model", "--served-model-name", "--host", "--port", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--block-size", "--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--api-key", "--device", "--dtype", "--gpu-memory-utilization", "--mamba-cache-dtype"):
        assert flag in out.stdout


def test_kernels_build_is_a_subcommand():
    out = sparkd_cli("kernels", "build", "--help")
    assert out.returncode == 0 and "--arch" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["serve", "--block-size", "0"], "block_size must be positive"),
    (["serve", "--model", "/nonexistent/dir"], "no config.json"),
    (["generate", "--max-tokens", "0", "x"], "max_tokens must be"),
    (["serve", "--mamba-cache-dtype", "int8"], "invalid choice: 'int8'"),
])
def test_bad_flags_exit_with_a_message(args, message):
    out = sparkd_cli(*args)
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr


def test_generate_streams_what_the_server_generates(server, served_model_dir):
    """Greedy `sparkd generate` prints exactly the greedy completion the server returns."""
    prompt, n = "The asyncio module", 8
    out = sparkd_cli("generate", "--model", str(served_model_dir), "--device", "cpu", "--temperature", "0",
                     "--max-tokens", str(n), prompt)
    assert out.returncode == 0, out.stderr
    with server.client() as client:
        expected = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0}).json()
    assert out.stdout == expected["choices"][0]["text"] + "\n"
    assert f"{expected['usage']['completion_tokens']} tokens in" in out.stderr
