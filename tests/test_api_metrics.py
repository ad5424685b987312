"""/metrics (vLLM's names with the sparkd: prefix), /health and /version."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

import sparkd

GAUGES = ("sparkd:num_requests_running", "sparkd:num_requests_waiting", "sparkd:kv_cache_usage_perc")
COUNTERS = ("sparkd:prefix_cache_queries", "sparkd:prefix_cache_hits", "sparkd:prompt_tokens",
            "sparkd:generation_tokens")
HISTOGRAMS = ("sparkd:time_to_first_token_seconds", "sparkd:inter_token_latency_seconds",
              "sparkd:e2e_request_latency_seconds")


def test_metric_names_and_types(server, served_model_dir):
    text = httpx.get(f"{server.base_url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in GAUGES:
        assert families[name].type == "gauge"
    for name in COUNTERS:
        assert families[name].type == "counter"
        assert f"{name}_total{{" in text  # the exposed sample name, as vLLM's
    for name in HISTOGRAMS:
        assert families[name].type == "histogram"
    assert all(s.labels.get("model_name") == str(served_model_dir)
               for f in families.values() if f.name.startswith("sparkd:") for s in f.samples)


def test_one_request_moves_every_counter(server):
    before = server.wait_idle()
    prompt, max_tokens = [7, 8, 9, 10, 11], 5
    with server.client() as client:
        out = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                   "ignore_eos": True, "stream": True}).text
    assert out.endswith("data: [DONE]\n\n")
    after = server.wait_idle()

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("sparkd:prompt_tokens_total") == len(prompt)
    assert delta("sparkd:generation_tokens_total") == max_tokens
    assert delta("sparkd:prefix_cache_queries_total") >= len(prompt)
    assert delta("sparkd:time_to_first_token_seconds_count") == 1
    # one token per step: an ITL sample for every token after the first
    assert delta("sparkd:inter_token_latency_seconds_count") == max_tokens - 1
    assert delta("sparkd:e2e_request_latency_seconds_count") == 1
    assert 0 < delta("sparkd:time_to_first_token_seconds_sum") <= delta("sparkd:e2e_request_latency_seconds_sum")


def test_prefix_cache_hits_on_a_repeated_prompt(server):
    prompt = list(range(10, 10 + 3 * 16 + 5))  # three full 16-token blocks and a tail
    with server.client() as client:
        client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        before = server.wait_idle()
        client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    after = server.wait_idle()
    assert after["sparkd:prefix_cache_hits_total"] - before["sparkd:prefix_cache_hits_total"] >= 3 * 16


def test_health_and_version(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json() == {"version": sparkd.__version__}
