"""systemd/sparkd.service: systemd's own checker accepts it, its hardening scores as OK, and it
agrees with the server (stop timeout above the drain, flags the example env file passes).

`systemd-analyze` works without systemd running (in a container, in CI); `.ci/run`
installs it where it is missing, so these tests never skip.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server_fixtures import REPO_ROOT
from sparkd.cli.main import build_parser
from sparkd.cli.serve import DEFAULT_DRAIN_TIMEOUT_S

UNIT = REPO_ROOT / "systemd" / "sparkd.service"
ENV_EXAMPLE = REPO_ROOT / "systemd" / "sparkd.env.example"
INSTALLED_BINARY = "/usr/local/bin/sparkd"
# systemd-analyze security's exposure, 0 (locked down) to 10 (wide open), times 10; up to 4.9 is "OK".
MAX_EXPOSURE_TENTHS = 40
# After the drain: uvicorn waits up to 5 s for connections to close, then the engine stops.
SHUTDOWN_AFTER_DRAIN_S = 10


def systemd_analyze(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("systemd-analyze")
    assert binary, "systemd-analyze is missing: apt-get install systemd (.ci/run does)"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def unit_here(tmp_path) -> Path:
    """The unit with ExecStart on this environment's `sparkd`: verify insists the binary exists."""
    text = UNIT.read_text()
    assert text.count(f"ExecStart={INSTALLED_BINARY} serve ") == 1
    binary = shutil.which("sparkd", path=str(Path(sys.executable).parent)) or shutil.which("sparkd")
    assert binary, "no `sparkd` script: pip install -e ."
    path = tmp_path / "sparkd.service"
    path.write_text(text.replace(f"ExecStart={INSTALLED_BINARY} ", f"ExecStart={binary} "))
    return path


def unit_settings() -> dict[str, list[str]]:
    """Key -> every value it is given in the unit."""
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def test_systemd_analyze_verify_passes(unit_here):
    out = systemd_analyze("verify", "--man=no", str(unit_here))
    # verify exits 0 on warnings (an unknown key, a bad time span): those count as failures here.
    complaints = [line for line in (out.stdout + out.stderr).splitlines() if "sparkd" in line]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


def test_hardening_exposure_is_ok(unit_here):
    out = systemd_analyze("security", "--offline=true", "--no-pager", f"--threshold={MAX_EXPOSURE_TENTHS}",
                          str(unit_here))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr


def test_notify_watchdog_restart_and_devices():
    settings = unit_settings()
    assert settings["Type"] == ["notify"] and settings["NotifyAccess"] == ["main"]
    assert settings["Restart"] == ["on-failure"]
    assert settings["KillSignal"] == ["SIGTERM"]
    assert settings["EnvironmentFile"] == ["-/etc/sparkd/sparkd.env"]
    assert settings["ExecStart"] == [f"{INSTALLED_BINARY} serve $SPARKD_ARGS"]
    assert settings["DevicePolicy"] == ["closed"]
    assert all(re.fullmatch(r"(char-nvidia\*|/dev/nvidia[\w-]*) rw", value) for value in settings["DeviceAllow"])
    assert seconds(settings["WatchdogSec"][0]) > 0


def example_serve_flags() -> argparse.Namespace:
    assignments = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
                       if line and not line.startswith("#"))
    # systemd splits an unbraced $SPARKD_ARGS at whitespace, without shell quoting.
    return build_parser().parse_args(["serve", *assignments["SPARKD_ARGS"].split()])


def test_the_example_env_file_gives_flags_sparkd_accepts():
    assert example_serve_flags().device == "cuda"


def test_stop_timeout_leaves_room_for_the_drain():
    stop_timeout_s = seconds(unit_settings()["TimeoutStopSec"][0])
    for drain_timeout_s in (DEFAULT_DRAIN_TIMEOUT_S, example_serve_flags().drain_timeout):
        assert stop_timeout_s >= drain_timeout_s + SHUTDOWN_AFTER_DRAIN_S


def seconds(timespan: str) -> float:
    """A systemd time span ("45s", "2min 30s") in seconds, as systemd reads it."""
    out = systemd_analyze("timespan", timespan)
    assert out.returncode == 0, out.stderr
    return int(re.search(r"μs: (\d+)", out.stdout).group(1)) / 1e6
