"""The skinny-GEMM kernel (out = x @ W^T (+ bias), M <= 16) against numpy in float64,
with and without split-K across blocks, its SiLU-fused variant (the MLP down projection),
its preconditions, the measured table that picks it, and Gemm's dispatch.

Relative error is max |y - ref| / max |ref|: <= 1e-5 for fp32, <= 1e-2 for bf16/fp16
outputs, and <= 1e-5 for fp32 output from bf16 inputs. The reference multiplies the
operands as the device holds them, so the bound measures the GEMM, not the input rounding.
The table and precondition tests need no GPU: they run on tensors that are never launched.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cpu.ops import NumpyOps
from sparkd.backend.cuda import gemm_table
from sparkd.backend.cuda.gemm_table import (
    CUBLASLT,
    GEMV,
    GEMV_SPLIT,
    GemmTable,
    Measurement,
    ShapeKey,
    load_table,
)
from sparkd.backend.cuda.kernels import gemv
from sparkd.backend.cuda.tensor import DeviceTensor
from sparkd.backend.dtypes import DType

DTYPES = ["float32", "bfloat16", "float16"]
# (M, N, K): every M tile and M between tiles, N not a multiple of the 4 rows a block
# owns, K of one 16-byte chunk, K splitting unevenly over the warps, and Llama's long K.
SHAPES = [(1, 1, 8), (1, 33, 296), (2, 2048, 4096), (3, 1003, 136), (4, 64, 4096), (5, 96, 14336),
          (8, 258, 1024), (9, 130, 2048), (16, 7, 8), (16, 512, 4096)]


@pytest.fixture(scope="module")
def split_k(gpu):
    return gemv.SplitKWorkspace(gpu.allocator, gpu.stream)


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
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_split_k_gemv_matches_numpy(gpu, split_k, rel_error, tolerance, dtype, m, n, k):
    x_dev, w_dev, x, w = _operands(gpu, m, n, k, dtype, seed=m * n + k + 1)
    out = gpu.empty((m, n), dtype)
    gemv.gemv(out, x_dev, w_dev, None, gpu.stream, split_k)
    assert rel_error(gpu.download(out), x @ w.T) <= tolerance[dtype]


def test_split_k_slices_long_rows_within_the_workspace():
    """One slice per 256 chunks of K, at most 16, and no more than the partials hold."""
    workspace = object.__new__(gemv.SplitKWorkspace)
    workspace.partials, workspace.counters = _fake((1 << 20,), "float32"), _fake((1 << 15,), "int32")
    assert workspace.splits(1, 4096, 512) == 2  # Llama's o at K = 4096 bf16
    assert workspace.splits(1, 4096, 1792) == 7  # down at K = 14336
    assert workspace.splits(1, 64, 1 << 16) == 16
    assert workspace.splits(16, 32768, 512) == 2  # 2 * 16 * 32768 partials fit
    assert workspace.splits(16, 65536, 512) == 1  # 2 * 16 * 65536 do not: no split
    assert workspace.splits(1, 4 * (1 << 15) + 1, 512) == 1  # more row groups than counters


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [False, True])
def test_gemv_adds_the_bias(gpu, split_k, rel_error, tolerance, dtype, split):
    x_dev, w_dev, x, w = _operands(gpu, 3, 45, 4096, dtype, seed=1)
    bias_dev = gpu.upload(np.random.default_rng(2).standard_normal(45).astype(np.float32), dtype)
    out = gpu.empty((3, 45), dtype)
    gemv.gemv(out, x_dev, w_dev, bias_dev, gpu.stream, split_k if split else None)
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
@pytest.mark.parametrize("split", [False, True])
def test_results_are_deterministic(gpu, split_k, split):
    x_dev, w_dev, _, _ = _operands(gpu, 5, 300, 14336, "bfloat16", seed=6, scale=10.0)
    outs = [gpu.empty((5, 300), DType.float32) for _ in range(3)]
    for out in outs:
        gemv.gemv(out, x_dev, w_dev, None, gpu.stream, split_k if split else None)
    first = gpu.download(outs[0])
    for out in outs[1:]:
        np.testing.assert_array_equal(gpu.download(out), first)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
def test_gemv_replays_inside_a_cuda_graph(gpu, split_k, rel_error, split):
    """Replayed twice with new x: split-K's counters are back at zero after every launch."""
    from sparkd.backend.cuda.graphs import capture
    from sparkd.backend.cuda.transfer import copy_to_device, encode

    x_dev, w_dev, _, w = _operands(gpu, 2, 256, 2048, "bfloat16", seed=7)
    out = gpu.empty((2, 256), DType.float32)
    workspace = split_k if split else None

    def launch():
        gemv.gemv(out, x_dev, w_dev, None, gpu.stream, workspace)

    launch()  # load the kernel outside the capture, as the warm-up does
    graph, _ = capture(gpu.stream, launch)
    try:
        for seed in (8, 9):
            new_x = encode(np.random.default_rng(seed).standard_normal((2, 2048)).astype(np.float32), DType.bfloat16)
            copy_to_device(x_dev, new_x, gpu.stream)
            graph.replay(gpu.stream)
            assert rel_error(gpu.download(out), gpu.download(x_dev).astype(np.float64) @ w.T) <= 1e-5
    finally:
        graph.destroy()


# ---- SiLU-and-mul fused into the down projection ----

def _silu_mul_held(gate_up: np.ndarray, dtype: str) -> np.ndarray:
    """silu(gate) * up in fp32, rounded to `dtype` as silu_and_mul stores it; float64."""
    from sparkd.backend.cuda.transfer import decode, encode

    gate, up = np.split(gate_up.astype(np.float32), 2, axis=1)
    with np.errstate(over="ignore"):
        act = gate / (np.float32(1) + np.exp(-gate)) * up
    target = DType.parse(dtype)
    return decode(encode(act, target), target).astype(np.float64)


# (M, N, I): one row, M between tiles, N not a multiple of 4, I of one chunk, Llama's down.
SILU_SHAPES = [(1, 4096, 14336), (1, 33, 8), (2, 130, 296), (3, 1003, 1024), (4, 64, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,inter", SILU_SHAPES)
@pytest.mark.parametrize("split", [False, True])
def test_silu_mul_gemv_matches_numpy_and_the_unfused_path(gpu, split_k, rel_error, tolerance, dtype, m, n, inter,
                                                          split):
    from sparkd.backend.cuda.kernels import activation

    gate_up_dev, w_dev, gate_up, w = _operands(gpu, m, n, 2 * inter, dtype, seed=m + n + inter, scale=3.0)
    w_dev = gpu.upload(np.random.default_rng(inter).standard_normal((n, inter)).astype(np.float32) / np.sqrt(inter),
                       dtype)
    w = gpu.download(w_dev).astype(np.float64)
    workspace = split_k if split else None
    fused = gpu.empty((m, n), dtype)
    gemv.silu_mul_gemv(fused, gate_up_dev, w_dev, None, gpu.stream, workspace)
    assert rel_error(gpu.download(fused), _silu_mul_held(gate_up, dtype) @ w.T) <= tolerance[dtype]
    # Same activation values, same accumulation order: the unfused path bit for bit.
    act, unfused = gpu.empty((m, inter), dtype), gpu.empty((m, n), dtype)
    activation.silu_and_mul(act, gate_up_dev, gpu.stream)
    gemv.gemv(unfused, act, w_dev, None, gpu.stream, workspace)
    np.testing.assert_array_equal(gpu.download(fused), gpu.download(unfused))


@pytest.mark.gpu
def test_silu_mul_gemv_with_bias_and_spaced_rows(gpu, rel_error):
    rng = np.random.default_rng(12)
    wide = rng.standard_normal((3, 2 * 64 + 16)).astype(np.float32)
    w = rng.standard_normal((20, 64)).astype(np.float32)
    bias = rng.standard_normal(20).astype(np.float32)
    out = gpu.empty((3, 20), DType.float32)
    gemv.silu_mul_gemv(out, gpu.upload(wide).column_slice(8, 128), gpu.upload(w), gpu.upload(bias), gpu.stream)
    expected = _silu_mul_held(wide[:, 8:136], "float32") @ w.T.astype(np.float64) + bias
    assert rel_error(gpu.download(out), expected) <= 1e-5


def test_silu_mul_gemv_rejects_what_it_cannot_run():
    weight = _fake((32, 64), ptr=0x20000)
    with pytest.raises(ValueError, match=r"gate_up must be \[M, 2I\]"):
        gemv.silu_mul_gemv(_fake((2, 32)), _fake((2, 64)), weight, None, None)
    with pytest.raises(ValueError, match="out must be bfloat16"):
        gemv.silu_mul_gemv(_fake((2, 32), "float32"), _fake((2, 128)), weight, None, None)
    with pytest.raises(ValueError, match="1 to 4 rows, got M = 5"):
        gemv.silu_mul_gemv(_fake((5, 32)), _fake((5, 128)), weight, None, None)


def test_numpy_mlp_down_is_the_down_projection_of_the_activation():
    rng = np.random.default_rng(13)
    gate_up = rng.standard_normal((5, 2 * 24)).astype(np.float32)
    weight, bias = rng.standard_normal((7, 24)).astype(np.float32), rng.standard_normal(7).astype(np.float32)
    gate, up = gate_up[:, :24].astype(np.float64), gate_up[:, 24:].astype(np.float64)
    expected = (gate / (1 + np.exp(-gate)) * up) @ weight.T.astype(np.float64) + bias
    result = NumpyOps().mlp_down(gate_up, weight, bias)
    assert result.shape == (5, 7) and result.dtype == np.float32
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(NumpyOps().mlp_down(gate_up, weight), expected - bias, rtol=1e-5, atol=1e-5)


# ---- Gemm's dispatch ----

@pytest.fixture
def gemm_with_table(gpu):
    pytest.importorskip("nvmath")
    from sparkd.backend.cuda.gemm import Gemm

    made = []

    def make(entries: dict[ShapeKey, Measurement]):
        made.append(Gemm(gpu.allocator, gpu.stream, table=GemmTable("test", "sm_00", entries=entries)))
        return made[-1]

    yield make
    gpu.stream.synchronize()
    for gemm in made:
        gemm.close()


@pytest.mark.gpu
def test_gemm_runs_gemv_where_the_table_says_it_wins(gpu, gemm_with_table, rel_error, tolerance):
    gemm = gemm_with_table({ShapeKey(384, 256, "bfloat16", 4): Measurement(cublaslt=0.6, gemv=0.9)})
    x_dev, w_dev, x, w = _operands(gpu, 3, 384, 256, "bfloat16", seed=9)
    out = gpu.empty((3, 384), DType.bfloat16)
    gemm(out, x_dev, w_dev)
    assert gemm.implementation(x_dev, w_dev) == GEMV and gemm.num_plans == 0  # cuBLASLt never ran
    assert rel_error(gpu.download(out), x @ w.T) <= tolerance["bfloat16"]
    # M = 5 is another tile, which the table lacks: cuBLASLt.
    x5_dev, _, x5, _ = _operands(gpu, 5, 384, 256, "bfloat16", seed=10)
    out5 = gpu.empty((5, 384), DType.bfloat16)
    gemm(out5, x5_dev, w_dev)
    assert gemm.implementation(x5_dev, w_dev) == CUBLASLT and gemm.num_plans == 1
    assert rel_error(gpu.download(out5), x5 @ w.T) <= tolerance["bfloat16"]


@pytest.mark.gpu
def test_gemm_runs_split_k_where_the_table_says_it_wins(gpu, gemm_with_table, rel_error, tolerance):
    gemm = gemm_with_table({ShapeKey(96, 4096, "bfloat16", 1): Measurement(cublaslt=0.6, gemv=0.7, gemv_split=0.8)})
    x_dev, w_dev, x, w = _operands(gpu, 1, 96, 4096, "bfloat16", seed=14)
    out = gpu.empty((1, 96), DType.bfloat16)
    gemm(out, x_dev, w_dev)
    assert gemm.implementation(x_dev, w_dev) == GEMV_SPLIT and gemm.num_plans == 0
    assert rel_error(gpu.download(out), x @ w.T) <= tolerance["bfloat16"]


@pytest.mark.gpu
def test_gemm_fuses_silu_mul_only_where_gemv_runs_the_down_projection(gpu, gemm_with_table, rel_error, tolerance):
    gemm = gemm_with_table({ShapeKey(40, 512, "bfloat16", 2): Measurement(cublaslt=0.5, gemv=0.9)})
    gate_up_dev, _, gate_up, _ = _operands(gpu, 2, 1, 1024, "bfloat16", seed=15, scale=3.0)
    w_dev = gpu.upload(np.random.default_rng(16).standard_normal((40, 512)).astype(np.float32) / 20, "bfloat16")
    out = gpu.empty((2, 40), DType.bfloat16)
    assert gemm.silu_mul_linear(out, gate_up_dev, w_dev)
    expected = _silu_mul_held(gate_up, "bfloat16") @ gpu.download(w_dev).astype(np.float64).T
    assert rel_error(gpu.download(out), expected) <= tolerance["bfloat16"]
    # M = 3 runs on tile 4, which the table lacks (cuBLASLt): not fused, nothing run.
    gate_up3_dev, _, _, _ = _operands(gpu, 3, 1, 1024, "bfloat16", seed=17)
    assert not gemm.silu_mul_linear(gpu.empty((3, 40), DType.bfloat16), gate_up3_dev, w_dev)
    assert gemm.num_plans == 0


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

def _fake(shape, dtype="bfloat16", ptr=0x10000, strides=None):
    return DeviceTensor(ptr, shape, DType.parse(dtype), strides)


@pytest.mark.parametrize("m,tile", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (16, 16)])
def test_m_runs_on_the_smallest_tile_that_holds_it(m, tile):
    assert gemv.m_tile(m) == tile


def test_launcher_rejects_what_gemv_cannot_run():
    weight = _fake((32, 64), ptr=0x20000)
    with pytest.raises(ValueError, match="1 to 16 rows of x, got M = 17"):
        gemv.gemv(_fake((17, 32), "float32"), _fake((17, 64)), weight, None, None)
    with pytest.raises(ValueError, match=r"K \(12\) .* multiples of 8 for bfloat16"):
        gemv.gemv(_fake((2, 32), "float32"), _fake((2, 12)), _fake((32, 12)), None, None)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemv.gemv(_fake((2, 32)), _fake((2, 64), ptr=0x10008), weight, None, None)
    with pytest.raises(ValueError, match=r"row stride \(68\)"):
        gemv.gemv(_fake((2, 32)), _fake((2, 64), strides=(68, 1)), weight, None, None)
    with pytest.raises(ValueError, match="shapes do not match"):
        gemv.gemv(_fake((2, 31)), _fake((2, 64)), weight, None, None)
    with pytest.raises(ValueError, match="bias must be"):
        gemv.gemv(_fake((2, 32)), _fake((2, 64)), weight, _fake((32,), "float32"), None)
    with pytest.raises(ValueError, match="output must be bfloat16 or float32"):
        gemv.gemv(_fake((2, 32), "float16"), _fake((2, 64)), weight, None, None)


def test_one_row_of_x_needs_no_row_stride():
    """A single row is read whatever its tensor's row stride says."""
    assert gemv.unsupported_reason(_fake((1, 64), strides=(68, 1)), _fake((32, 64))) is None


# ---- the measured table ----

def _table() -> GemmTable:
    return GemmTable("NVIDIA H200", "sm_90", "python tools/bench_gemm.py --write-table", "2026-11-29T21:00:00+00:00",
                     4.27e12, {ShapeKey(6144, 4096, "bfloat16", 1): Measurement(0.75, 0.92, 0.95),
                               ShapeKey(6144, 4096, "bfloat16", 4): Measurement(0.76, 0.81),
                               ShapeKey(6144, 4096, "bfloat16", 16): Measurement(0.77, 0.61)})


def test_table_picks_the_measured_winner_of_the_m_tile():
    table = _table()
    assert table.pick(6144, 4096, DType.bfloat16, 1) == GEMV_SPLIT
    assert table.pick(6144, 4096, DType.bfloat16, 3) == GEMV  # tile 4
    assert table.pick(6144, 4096, DType.bfloat16, 2) == CUBLASLT  # tile 2 was not measured
    assert table.pick(6144, 4096, DType.bfloat16, 12) == CUBLASLT  # tile 16: cuBLASLt won
    assert table.pick(6144, 4096, DType.bfloat16, 64) == CUBLASLT  # beyond gemv
    assert table.pick(6144, 4096, DType.float16, 1) == CUBLASLT  # another dtype
    assert table.pick(4096, 4096, DType.bfloat16, 1) == CUBLASLT  # another shape
    assert Measurement(0.8, 0.8).winner == CUBLASLT  # a tie keeps the library
    assert Measurement(0.8, 0.9, 0.9).winner == GEMV  # and then gemv without split
    assert Measurement(0.8, 0.9, 0.95).winner == GEMV_SPLIT


def test_tables_measured_before_split_k_never_pick_it():
    old = '{"device": "d", "arch": "sm_90", "command": "", "measured_at": "", "copy_rate": 1.0, "entries": [' \
          '{"n": 8, "k": 8, "dtype": "bfloat16", "m_tile": 1, "cublaslt": 0.5, "gemv": 0.6}]}'
    assert GemmTable.from_json(old).entries == {ShapeKey(8, 8, "bfloat16", 1): Measurement(0.5, 0.6, 0.0)}


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
