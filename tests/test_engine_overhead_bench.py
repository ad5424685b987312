"""tools/bench_engine_overhead.py runs the real engine around its stub ops and model: a smoke run
keeps the stubs in step with what the engine calls (they had drifted from it once, unnoticed)."""

from __future__ import annotations

import sys

from server_fixtures import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
import bench_engine_overhead  # noqa: E402


def test_the_overhead_bench_times_every_case(capsys):
    assert bench_engine_overhead.main(["--batch", "1", "3", "--steps", "2", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "ms/step" not in line
            and "---" not in line]
    assert [row.split("|")[1:3] for row in rows] == [[" 1 ", " greedy "], [" 1 ", " sampled "], [" 3 ", " greedy "],
                                                      [" 3 ", " sampled "]]
    assert all(float(row.split("|")[3]) > 0 for row in rows)
