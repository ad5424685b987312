"""`sparkd serve --device cuda` end to end: a real server process on the GPU, an SSE client.

The demo model is served in float32, so its greedy tokens must equal the numpy
backend's in this process, token for token.
"""

from __future__ import annotations

import json

import pytest

from sparkd import LLM, SamplingParams
from sparkd.engine.llm_engine import DEMO_MODEL_DIR

PROMPT = "The with statement"
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    from tests.server_fixtures import start_server

    from .conftest import _device_present

    if not _device_present():
        pytest.skip("needs a CUDA device")
    server = start_server(DEMO_MODEL_DIR, tmp_path_factory.mktemp("serve") / "serve.log", "--device", "cuda",
                          "--dtype", "float32", "--served-model-name", "sparkd-demo", "--max-num-seqs", "8",
                          "--gpu-memory-utilization", "0.3")
    yield server
    server.stop()


def sse_events(response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.gpu
def test_sse_stream_on_the_gpu_matches_the_cpu_backend(gpu_server):
    body = {"model": "sparkd-demo", "prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with gpu_server.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]["usage"]
    token_chunks = [c for c in chunks if c["choices"]]
    assert usage["completion_tokens"] == NUM_TOKENS == len(token_chunks)  # one event per token
    text = "".join(c["choices"][0]["text"] for c in token_chunks)

    cpu = LLM(device="cpu").generate([PROMPT], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    assert text == cpu[0].outputs[0].text
    assert usage["prompt_tokens"] == len(cpu[0].prompt_token_ids)

    metrics = gpu_server.wait_idle()
    assert metrics["sparkd:kv_cache_usage_perc"] == 0.0
    assert metrics["sparkd:generation_tokens_total"] >= NUM_TOKENS
