"""Shared fixtures: the tiny served checkpoint and a running `sparkd serve` on it."""

from __future__ import annotations

import pytest

from server_fixtures import make_served_checkpoint, start_server


@pytest.fixture(scope="session")
def served_model_dir(tmp_path_factory):
    return make_served_checkpoint(tmp_path_factory.mktemp("served_model"))


@pytest.fixture(scope="session")
def server(served_model_dir, tmp_path_factory):
    """One `sparkd serve` for the whole session, with API key `server.api_key`."""
    proc = start_server(served_model_dir, tmp_path_factory.mktemp("server") / "serve.log")
    yield proc
    proc.stop()
