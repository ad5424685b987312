"""tools/bench_serving.py against the test server: counts add up and the JSON result is complete."""

from __future__ import annotations

import json
import sys

from server_fixtures import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
import bench_serving  # noqa: E402


def test_bench_serving_reports_what_it_sent(server, served_model_dir, tmp_path, capsys):
    num, out_len = 12, 6
    bench_serving.main(["--base-url", server.base_url, "--api-key", server.api_key, "--tokenizer",
                        str(served_model_dir), "--num-prompts", str(num), "--random-input-len", "20",
                        "--random-output-len", str(out_len), "--max-concurrency", "4", "--ignore-eos",
                        "--request-rate", "50", "--burstiness", "0.5", "--goodput", "ttft:60000", "e2el:60000",
                        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"])
    report = capsys.readouterr().out
    assert "Serving Benchmark Result" in report and "P99 ITL (ms):" in report
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == num and result["failed"] == 0
    assert result["total_output_tokens"] == num * out_len
    assert result["request_goodput"] == result["request_throughput"]  # generous SLOs: every request is good
    assert result["max_concurrent_requests"] <= 4
    per_request = result["per_request"]
    assert all(len(r["itl"]) == out_len - 1 for r in per_request)
    assert sum(r["prompt_len"] for r in per_request) == result["total_input_tokens"]
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"]
