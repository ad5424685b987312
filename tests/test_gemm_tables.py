"""The GEMM tables checked into the package (sparkd/backend/cuda/gemm_tables): each one reads
back, is found under the name load_table looks up for the device it records, and measured
every shape at every M tile, so that no decode bucket falls back to the heuristic on that card."""

from __future__ import annotations

from collections import defaultdict

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from sparkd.backend.cuda import gemm_table  # noqa: E402
from sparkd.backend.cuda.kernels import gemv  # noqa: E402

TABLES = sorted(gemm_table.PACKAGED_DIR.glob("*.json"))


def test_tables_are_checked_in_for_the_lent_cards():
    assert {path.name for path in TABLES} >= {"nvidia-h200-sm_90.json", "nvidia-h100-80gb-hbm3-sm_90.json"}


@pytest.mark.parametrize("path", TABLES, ids=lambda path: path.stem)
def test_a_packaged_table_is_whole_and_named_for_its_device(path):
    table = gemm_table.GemmTable.from_json(path.read_text())
    assert path.name == gemm_table.table_file_name(table.device, table.arch)
    assert table.copy_rate > 0 and table.cublaslt_version > 0 and table.command.startswith("python tools/bench_gemm.py")
    tiles = defaultdict(set)
    for key, measured in table.entries.items():
        tiles[key.n, key.k, key.dtype].add(key.m_tile)
        # Fractions of the copy rate: a little above 1 is L2 reuse across M rows, far above is a unit error.
        assert 0 < measured.cublaslt < 1.5 and 0 <= measured.gemv < 1.5, (key, measured)
        assert (measured.gemv > 0) == (key.m_tile <= gemv.MAX_M), (key, measured)
    assert tiles and all(measured == set(gemm_table.M_TILES) for measured in tiles.values()), dict(tiles)
