#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, then runs pytest.
# CI (.ci/run) runs exactly this. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# tests/test_systemd_unit.py checks the unit with systemd's own tools, which run without
# systemd running; slim containers lack them.
if ! command -v systemd-analyze >/dev/null; then
    as_root=$([ "$(id -u)" -eq 0 ] || echo sudo)
    $as_root apt-get update -qq
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd
fi
pip install -e '.[test]'
python -m pytest -q "$@"
