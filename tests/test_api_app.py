"""build_app in-process: the names a model answers to, and a dead engine."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from sparkd.api.app import build_app
from sparkd.engine.args import EngineArgs
from sparkd.engine.async_engine import AsyncEngine


@pytest.fixture
def engine(served_model_dir):
    """A fresh engine per test: one is bound to the event loop that started it."""
    return AsyncEngine.from_args(EngineArgs(model=str(served_model_dir), served_model_name="first", device="cpu",
                                            max_model_len=128))


def test_every_served_name_is_accepted_and_the_first_is_reported(engine):
    with TestClient(build_app(engine, ["first", "second"])) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["first", "second"]
        for name, reported in (("second", "second"), (None, "first")):
            body = {"prompt": "x", "max_tokens": 2, **({"model": name} if name else {})}
            assert client.post("/v1/completions", json=body).json()["model"] == reported
        assert client.post("/v1/completions", json={"model": "third", "prompt": "x"}).status_code == 404


def test_a_dead_engine_fails_health_and_requests(engine, monkeypatch):
    with TestClient(build_app(engine)) as client:
        monkeypatch.setattr(engine, "dead_reason", "CUDA_ERROR_ILLEGAL_ADDRESS")
        health = client.get("/health")
        assert health.status_code == 503 and "CUDA_ERROR_ILLEGAL_ADDRESS" in health.json()["error"]["message"]
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
