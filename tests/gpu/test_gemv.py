"""The skinny-GEMM kernel (out = x @ W^T (+ bias), M <= 16) against numpy in float64,
its preconditions, the measured table that picks it, and Gemm's dispatch.

Relative error is max |y - ref| / max |ref|: <= 1e-5 for fp32, <= 1e-2 for bf16/fp16
outputs, and <= 1e-5 for fp32 output from bf16 inputs. The reference multiplies the
operands as the device holds them, so the bound measures the GEMM, not the input rounding.
The table and precondition tests need no GPU: they run on tensors that are never launched.
"""

from __future__ import annotations

import numpy as np
import pytest
from device_fakes import fake_tensor

from sparkd.backend.cuda import gemm_table
from sparkd.backend.cuda.gemm_table import (
    CUBLASLT,
    GEMV,
    GemmTable,
    Measurement,
    ShapeKey,
    load_table,
)
from sparkd.backend.cuda.kernels import gemv
from sparkd.backend.dtypes import DType

DTYPES = ["float32", "bfloat16", "float16"]
# (M, N, K): every M tile and M between tiles, N not a multiple of the 4 rows a block
# owns, K of one 16-byte chunk, K splitting unevenly over the warps, and Llama's long K.
SHAPES = [(1, 1, 8), (1, 33, 296), (2, 2048, 4096), (3, 1003, 136), (4, 64, 4096), (5, 96, 14336),
          (8, 258, 1024), (9, 130, 2048), (16, 7, 8), (16, 512, 4096)]


def _operands(gpu, m, n, k, dtype, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    x = (scale * rng.standard_normal((m, k))).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    x_dev, w_dev = gpu.upload(x, dtype), gpu.upload(w, dtype)
    return x_dev, w_dev, gpu.download(x_dev).astype(np.float64), gpu.download(w_dev).astype(np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemv_matches_numpy(gpu, rel_error, tolerance, dtype, m, n, k):
    x_dev, w_dev, x, w = _operands(gpu, m, n, k, dtype, seed=m * n + k)
    out = gpu.empty((m, n), dtype)
    gemv.gemv(out, x_dev, w_dev, None, gpu.stream)
    assert rel_error(gpu.download(out), x @ w.T) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,inter,k", [(1, 1, 8), (1, 7, 296), (2, 1003, 136), (5, 96, 14336), (16, 514, 4096)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_silu_and_mul_matches_numpy(gpu, rel_error, tolerance, dtype, m, inter, k, with_bias):
    """The gate_up GEMM with SiLU-and-mul in its epilogue against numpy: silu(g) * u from the
    float64 product, an odd number of output columns (a block owns two) included."""
    from sparkd.backend.cpu.moe import silu_and_mul

    x_dev, w_dev, x, w = _operands(gpu, m, 2 * inter, k, dtype, seed=m + inter + k)
    bias_dev = gpu.upload(np.random.default_rng(3).standard_normal(2 * inter).astype(np.float32), dtype) \
        if with_bias else None
    out = gpu.empty((m, inter), dtype)
    gemv.gemv_silu_and_mul(out, x_dev, w_dev, bias_dev, gpu.stream)
    product = x @ w.T + (gpu.download(bias_dev) if with_bias else 0.0)
    assert rel_error(gpu.download(out), silu_and_mul(product)) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_adds_the_bias(gpu, rel_error, tolerance, dtype):
    x_dev, w_dev, x, w = _operands(gpu, 3, 45, 64, dtype, seed=1)
    bias_dev = gpu.upload(np.random.default_rng(2).standard_normal(45).astype(np.float32), dtype)
    out = gpu.empty((3, 45), dtype)
    gemv.gemv(out, x_dev, w_dev, bias_dev, gpu.stream)
    assert rel_error(gpu.download(out), x @ w.T + gpu.download(bias_dev)) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16])
def test_bf16_inputs_with_fp32_output_for_logits(gpu, rel_error, m):
    x_dev, w_dev, x, w = _operands(gpu, m, 1003, 4096, "bfloat16", seed=3)
    bias = np.random.default_rng(4).standard_normal(1003).astype(np.float32)
    out = gpu.empty((m, 1003), DType.float32)
    gemv.gemv(out, x_dev, w_dev, gpu.upload(bias), gpu.stream)
    # fp32 output: only the accumulation order differs from float64.
    assert rel_error(gpu.download(out), x @ w.T + bias) <= 1e-5


@pytest.mark.gpu
def test_spaced_rows_of_x_and_out(gpu, rel_error):
    """x as a column slice of a wider matrix (as after split_heads), out written into one too."""
    rng = np.random.default_rng(5)
    wide = rng.standard_normal((6, 200)).astype(np.float32)
    w = rng.standard_normal((24, 64)).astype(np.float32)
    x_dev = gpu.upload(wide).column_slice(32, 64)
    out_wide = gpu.upload(np.full((6, 40), 7.0, np.float32))
    gemv.gemv(out_wide.column_slice(8, 24), x_dev, gpu.upload(w), None, gpu.stream)
    result = gpu.download(out_wide)
    assert rel_error(result[:, 8:32], wide[:, 32:96].astype(np.float64) @ w.T) <= 1e-5
    assert np.all(result[:, :8] == 7.0) and np.all(result[:, 32:] == 7.0)


@pytest.mark.gpu
def test_results_are_deterministic(gpu):
    x_dev, w_dev, _, _ = _operands(gpu, 5, 300, 14336, "bfloat16", seed=6, scale=10.0)
    first, second = gpu.empty((5, 300), DType.float32), gpu.empty((5, 300), DType.float32)
    gemv.gemv(first, x_dev, w_dev, None, gpu.stream)
    gemv.gemv(second, x_dev, w_dev, None, gpu.stream)
    np.testing.assert_array_equal(gpu.download(first), gpu.download(second))


@pytest.mark.gpu
def test_gemv_replays_inside_a_cuda_graph(gpu, rel_error):
    from sparkd.backend.cuda.graphs import capture
    from sparkd.backend.cuda.transfer import copy_to_device
    from sparkd.backend.dtypes import encode

    x_dev, w_dev, _, w = _operands(gpu, 2, 256, 512, "bfloat16", seed=7)
    out = gpu.empty((2, 256), DType.float32)
    gemv.gemv(out, x_dev, w_dev, None, gpu.stream)  # load the kernel outside the capture, as the warm-up does
    graph, _ = capture(gpu.stream, lambda: gemv.gemv(out, x_dev, w_dev, None, gpu.stream))
    try:
        new_x = encode(np.random.default_rng(8).standard_normal((2, 512)).astype(np.float32), DType.bfloat16)
        copy_to_device(x_dev, new_x, gpu.stream)
        graph.replay(gpu.stream)
        assert rel_error(gpu.download(out), gpu.download(x_dev).astype(np.float64) @ w.T) <= 1e-5
    finally:
        graph.destroy()


# ---- Gemm's dispatch ----

@pytest.mark.gpu
def test_gemm_runs_gemv_where_the_table_says_it_wins(gpu, gemm_with_table, rel_error, tolerance):
    gemm = gemm_with_table({ShapeKey(384, 256, "bfloat16", 4): Measurement(cublaslt=0.6, gemv=0.9)})
    x_dev, w_dev, x, w = _operands(gpu, 3, 384, 256, "bfloat16", seed=9)
    out = gpu.empty((3, 384), DType.bfloat16)
    gemm(out, x_dev, w_dev)
    assert gemm.picks_gemv(x_dev, w_dev) and gemm.num_plans == 0  # cuBLASLt never ran
    assert rel_error(gpu.download(out), x @ w.T) <= tolerance["bfloat16"]
    # M = 5 is another tile, which the table lacks: cuBLASLt.
    x5_dev, _, x5, _ = _operands(gpu, 5, 384, 256, "bfloat16", seed=10)
    out5 = gpu.empty((5, 384), DType.bfloat16)
    gemm(out5, x5_dev, w_dev)
    assert not gemm.picks_gemv(x5_dev, w_dev) and gemm.num_plans == 1
    assert rel_error(gpu.download(out5), x5 @ w.T) <= tolerance["bfloat16"]


@pytest.mark.gpu
def test_gemm_falls_back_to_cublaslt_where_gemv_cannot_run(gpu, gemm_with_table, rel_error):
    """K = 12 is not a whole number of 16-byte bf16 chunks: cuBLASLt runs it whatever the table says."""
    gemm = gemm_with_table({ShapeKey(40, 12, "bfloat16", 2): Measurement(cublaslt=0.1, gemv=0.9)})
    x_dev, w_dev, x, w = _operands(gpu, 2, 40, 12, "bfloat16", seed=11)
    out = gpu.empty((2, 40), DType.float32)
    gemm(out, x_dev, w_dev)
    assert not gemm.picks_gemv(x_dev, w_dev) and gemm.num_plans == 1
    assert rel_error(gpu.download(out), x @ w.T) <= 1e-5


# ---- preconditions (no launch, no GPU) ----


@pytest.mark.parametrize("m,tile", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (16, 16)])
def test_m_runs_on_the_smallest_tile_that_holds_it(m, tile):
    assert gemv.m_tile(m) == tile


def test_launcher_rejects_what_gemv_cannot_run():
    weight = fake_tensor((32, 64), ptr=0x20000)
    with pytest.raises(ValueError, match="1 to 16 rows of x, got M = 17"):
        gemv.gemv(fake_tensor((17, 32), "float32"), fake_tensor((17, 64)), weight, None, None)
    with pytest.raises(ValueError, match=r"K \(12\) .* multiples of 8 for bfloat16"):
        gemv.gemv(fake_tensor((2, 32), "float32"), fake_tensor((2, 12)), fake_tensor((32, 12)), None, None)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemv.gemv(fake_tensor((2, 32)), fake_tensor((2, 64), ptr=0x10008), weight, None, None)
    with pytest.raises(ValueError, match=r"row stride \(68\)"):
        gemv.gemv(fake_tensor((2, 32)), fake_tensor((2, 64), strides=(68, 1)), weight, None, None)
    with pytest.raises(ValueError, match="shapes do not match"):
        gemv.gemv(fake_tensor((2, 31)), fake_tensor((2, 64)), weight, None, None)
    with pytest.raises(ValueError, match="bias must be"):
        gemv.gemv(fake_tensor((2, 32)), fake_tensor((2, 64)), weight, fake_tensor((32,), "float32"), None)
    with pytest.raises(ValueError, match="output must be bfloat16 or float32"):
        gemv.gemv(fake_tensor((2, 32), "float16"), fake_tensor((2, 64)), weight, None, None)


def test_one_row_of_x_needs_no_row_stride():
    """A single row is read whatever its tensor's row stride says."""
    assert gemv.unsupported_reason(fake_tensor((1, 64), strides=(68, 1)), fake_tensor((32, 64))) is None


# ---- the measured table ----

def _table() -> GemmTable:
    return GemmTable("NVIDIA H200", "sm_90", "python tools/bench_gemm.py --write-table", "2026-11-29T21:00:00+00:00",
                     4.27e12, {ShapeKey(6144, 4096, "bfloat16", 1): Measurement(0.75, 0.92),
                               ShapeKey(6144, 4096, "bfloat16", 4): Measurement(0.76, 0.81),
                               ShapeKey(6144, 4096, "bfloat16", 16): Measurement(0.77, 0.61)})


def test_table_picks_the_measured_winner_of_the_m_tile():
    table = _table()
    assert table.pick(6144, 4096, DType.bfloat16, 1) == GEMV
    assert table.pick(6144, 4096, DType.bfloat16, 3) == GEMV  # tile 4
    assert table.pick(6144, 4096, DType.bfloat16, 2) == CUBLASLT  # tile 2 was not measured
    assert table.pick(6144, 4096, DType.bfloat16, 12) == CUBLASLT  # tile 16: cuBLASLt won
    assert table.pick(6144, 4096, DType.bfloat16, 64) == CUBLASLT  # beyond gemv
    assert table.pick(6144, 4096, DType.float16, 1) == CUBLASLT  # another dtype
    assert table.pick(4096, 4096, DType.bfloat16, 1) == CUBLASLT  # another shape
    assert Measurement(0.8, 0.8).winner == CUBLASLT  # a tie keeps the library


def test_table_survives_json():
    table = _table()
    assert GemmTable.from_json(table.to_json()) == table
    assert GemmTable.from_json(GemmTable().to_json()) == GemmTable()


def test_device_table_comes_from_the_cache_before_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gemm_table, "PACKAGED_DIR", tmp_path / "packaged")
    name = gemm_table.table_file_name("NVIDIA H200", "sm_90")
    assert name == "nvidia-h200-sm_90.json"
    assert load_table("NVIDIA H200", "sm_90").entries == {}  # none anywhere: cuBLASLt everywhere

    packaged = _table()
    packaged.save(tmp_path / "packaged" / name)
    assert load_table("NVIDIA H200", "sm_90") == packaged

    cached = GemmTable("NVIDIA H200", "sm_90", entries={ShapeKey(8, 8, "float32", 1): Measurement(0.1, 0.2)})
    cache_path = gemm_table.cache_table_path("NVIDIA H200", "sm_90")
    assert cache_path == tmp_path / "cache" / "gemm" / name  # next to the kernel cache
    cached.save(cache_path)
    assert load_table("NVIDIA H200", "sm_90") == cached
    assert load_table("NVIDIA H100 80GB HBM3", "sm_90").entries == {}  # another device's tables are not read


def test_an_unreadable_cache_table_falls_back_to_the_package(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPARKD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gemm_table, "PACKAGED_DIR", tmp_path / "packaged")
    cache_path = gemm_table.cache_table_path("NVIDIA H200", "sm_90")
    cache_path.parent.mkdir(parents=True)
    cache_path.write_text("{not json")
    _table().save(tmp_path / "packaged" / cache_path.name)
    assert load_table("NVIDIA H200", "sm_90") == _table()
    assert "unreadable GEMM table" in caplog.text
