"""cuBLASLt algorithms from the measured table: the table's lookups and JSON (no GPU), and Gemm
running a stored algorithm, refusing one cuBLASLt rejects and one measured with another library
(GPU). Results are checked against numpy in float64 at the tolerances of test_gemv.py."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cuda.gemm_table import CUBLASLT, GemmTable, Measurement, ShapeKey, table_m_tile
from sparkd.backend.dtypes import DType

ALGO = bytes(range(64))


def _table(version: int = 130100) -> GemmTable:
    return GemmTable("NVIDIA H200", "sm_90", entries={
        ShapeKey(4096, 4096, "bfloat16", 64): Measurement(0.81, algo=ALGO.hex()),
        ShapeKey(4096, 4096, "bfloat16", 128): Measurement(0.70),
        ShapeKey(4096, 4096, "bfloat16", 1): Measurement(0.6, 0.8),
    }, cublaslt_version=version)


@pytest.mark.parametrize("m,tile", [(1, 1), (16, 16), (17, 32), (32, 32), (40, 64), (64, 64), (65, 128),
                                    (256, 256), (257, None), (8192, None)])
def test_every_m_up_to_256_has_a_measured_tile(m, tile):
    assert table_m_tile(m) == tile


def test_the_table_gives_the_algorithm_measured_at_m_s_tile():
    table = _table()
    assert table.cublaslt_algo(4096, 4096, DType.bfloat16, 64) == ALGO
    assert table.cublaslt_algo(4096, 4096, DType.bfloat16, 33) == ALGO  # tile 64
    assert table.cublaslt_algo(4096, 4096, DType.bfloat16, 100) is None  # tile 128: the heuristic's first won
    assert table.cublaslt_algo(4096, 4096, DType.bfloat16, 4096) is None  # beyond every tile
    assert table.cublaslt_algo(4096, 4096, DType.float16, 64) is None  # another dtype
    assert table.cublaslt_algo(6144, 4096, DType.bfloat16, 64) is None  # another shape
    assert table.pick(4096, 4096, DType.bfloat16, 64) == CUBLASLT  # past gemv's tiles
    assert Measurement(0.5).winner == CUBLASLT  # gemv not measured


def test_algorithms_and_the_library_version_survive_json():
    table = _table()
    assert GemmTable.from_json(table.to_json()) == table


def test_a_table_written_before_algorithms_were_measured_still_reads():
    old = ('{"device": "NVIDIA H200", "arch": "sm_90", "command": "", "measured_at": "", "copy_rate": 4.27e12, '
           '"entries": [{"n": 8, "k": 8, "dtype": "bfloat16", "m_tile": 1, "cublaslt": 0.1, "gemv": 0.2}]}')
    table = GemmTable.from_json(old)
    assert table.cublaslt_version == 0
    assert table.entries == {ShapeKey(8, 8, "bfloat16", 1): Measurement(0.1, 0.2)}


# ---- Gemm with stored algorithms (GPU) ----

def _operands(gpu, m, n, k, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    x_dev, w_dev = gpu.upload(x, DType.bfloat16), gpu.upload(w, DType.bfloat16)
    reference = gpu.download(x_dev).astype(np.float64) @ gpu.download(w_dev).astype(np.float64).T
    return x_dev, w_dev, reference


@pytest.mark.gpu
@pytest.mark.parametrize("m", [24, 64])
def test_gemm_runs_every_candidate_it_would_store(gpu, gemm_with_table, rel_error, tolerance, m):
    """Each of the heuristic's candidates, stored in the table at m's tile, is the one Gemm runs,
    and its product is right: whichever one bench_gemm.py measures fastest may be stored."""
    n, k = 384, 1024
    x_dev, w_dev, reference = _operands(gpu, m, n, k, seed=m)
    poison = np.full((m, n), np.nan, np.float32)
    out = gpu.upload(poison, DType.bfloat16)
    candidates = gemm_with_table({}).candidates(out, x_dev, w_dev, 8)
    assert len(candidates) >= 2 and len(set(candidates)) == len(candidates)
    for algo in candidates:
        gemm = gemm_with_table({ShapeKey(n, k, "bfloat16", table_m_tile(m)): Measurement(0.5, algo=algo.hex())})
        out = gpu.upload(poison, DType.bfloat16)
        gemm(out, x_dev, w_dev)
        assert gemm.algorithm(out, x_dev, w_dev) == algo
        assert rel_error(gpu.download(out), reference) <= tolerance["bfloat16"]


@pytest.mark.gpu
def test_gemm_keeps_the_heuristic_s_choice_where_the_stored_one_cannot_run(gpu, gemm_with_table, rel_error, tolerance):
    """An algorithm cuBLASLt rejects for these operands, and one measured with another cuBLASLt
    version, are not used: the heuristic's first runs, and the product stays right."""
    m, n, k = 64, 256, 512
    x_dev, w_dev, reference = _operands(gpu, m, n, k, seed=3)
    out = gpu.empty((m, n), DType.bfloat16)
    heuristic = gemm_with_table({}).algorithm(out, x_dev, w_dev)
    other = gemm_with_table({}).candidates(out, x_dev, w_dev, 4)[-1]
    assert other != heuristic
    key = ShapeKey(n, k, "bfloat16", 64)
    for gemm in (gemm_with_table({key: Measurement(0.5, algo=(b"\xff" * 64).hex())}),  # not an algorithm
                 gemm_with_table({key: Measurement(0.5, algo="abcd")}),  # not even a struct's size
                 gemm_with_table({key: Measurement(0.5, algo=other.hex())}, cublaslt_version=1)):  # another library's
        gemm(out, x_dev, w_dev)
        assert gemm.algorithm(out, x_dev, w_dev) == heuristic
        assert rel_error(gpu.download(out), reference) <= tolerance["bfloat16"]
