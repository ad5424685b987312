"""cuBLASLt GEMM, y = x @ W^T (+ bias), against numpy in float64.

Relative error is max |y - ref| / max |ref|: <= 1e-5 for fp32 (no TF32), <= 1e-2
for bf16/fp16 (inputs are rounded to the dtype first, so the reference sees the
same operands and the bound measures the GEMM, not the input rounding)."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.dtypes import DType

pytestmark = pytest.mark.gpu

SHAPES = [(1, 64, 32), (3, 33, 17), (16, 256, 512), (64, 1000, 128), (257, 96, 4096)]


@pytest.fixture(scope="module")
def gemm(gpu):
    pytest.importorskip("nvmath")
    from sparkd.backend.cuda.gemm import Gemm

    return Gemm(gpu.allocator, gpu.stream)


def _operands(gpu, m, n, k, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    x_dev, w_dev = gpu.upload(x, dtype), gpu.upload(w, dtype)
    # The reference multiplies the operands as the device holds them.
    return x_dev, w_dev, gpu.download(x_dev).astype(np.float64), gpu.download(w_dev).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_matches_numpy(gpu, gemm, rel_error, tolerance, dtype, m, n, k):
    x_dev, w_dev, x, w = _operands(gpu, m, n, k, dtype, seed=m * n + k)
    out = gpu.empty((m, n), dtype)
    gemm(out, x_dev, w_dev)
    assert rel_error(gpu.download(out), x @ w.T) <= tolerance[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemm_with_bias(gpu, gemm, rel_error, tolerance, dtype):
    x_dev, w_dev, x, w = _operands(gpu, 5, 48, 40, dtype, seed=7)
    bias_dev = gpu.upload(np.random.default_rng(8).standard_normal(48).astype(np.float32), dtype)
    out = gpu.empty((5, 48), dtype)
    gemm(out, x_dev, w_dev, bias_dev)
    expected = x @ w.T + gpu.download(bias_dev)
    assert rel_error(gpu.download(out), expected) <= tolerance[dtype]


def test_bf16_inputs_with_fp32_output_for_logits(gpu, gemm, rel_error):
    x_dev, w_dev, x, w = _operands(gpu, 4, 1003, 256, "bfloat16", seed=9)
    out = gpu.empty((4, 1003), DType.float32)
    gemm(out, x_dev, w_dev)
    # fp32 output: only the accumulation order differs from float64.
    assert rel_error(gpu.download(out), x @ w.T) <= 1e-5


def test_gemm_reads_x_with_spaced_rows(gpu, gemm, rel_error):
    """x as a column slice of a wider matrix (ld > K), as after split_heads."""
    rng = np.random.default_rng(10)
    wide = rng.standard_normal((7, 100)).astype(np.float32)
    w = rng.standard_normal((24, 64)).astype(np.float32)
    x_dev = gpu.upload(wide).column_slice(32, 64)
    out = gpu.empty((7, 24), DType.float32)
    gemm(out, x_dev, gpu.upload(w))
    assert rel_error(gpu.download(out), wide[:, 32:96].astype(np.float64) @ w.T) <= 1e-5


def test_plans_are_cached_per_shape(gpu, gemm):
    x_dev, w_dev, _, _ = _operands(gpu, 2, 128, 64, "float32", seed=11)
    out = gpu.empty((2, 128), DType.float32)
    gemm(out, x_dev, w_dev)
    before = gemm.num_plans
    gemm(out, x_dev, w_dev)
    assert gemm.num_plans == before
    gemm(gpu.empty((3, 128), DType.float32), gpu.upload(np.ones((3, 64), np.float32)), w_dev)
    assert gemm.num_plans == before + 1


def test_shape_mismatch_is_a_clear_error(gpu, gemm):
    x_dev, w_dev, _, _ = _operands(gpu, 2, 16, 8, "float32", seed=12)
    with pytest.raises(ValueError, match="shapes do not match"):
        gemm(gpu.empty((2, 15), DType.float32), x_dev, w_dev)
    with pytest.raises(ValueError, match="one float dtype"):
        gemm(gpu.empty((2, 16), DType.float32), x_dev, gpu.upload(np.ones((16, 8)), "bfloat16"))


def test_gemm_replays_inside_a_cuda_graph(gpu, gemm, rel_error):
    from sparkd.backend.cuda.graphs import capture
    from sparkd.backend.cuda.transfer import copy_to_device

    x_dev, w_dev, x, w = _operands(gpu, 3, 256, 128, "bfloat16", seed=13)
    out = gpu.empty((3, 256), DType.float32)
    gemm(out, x_dev, w_dev)  # plan outside the capture, as the decode warm-up does
    graph, _ = capture(gpu.stream, lambda: gemm(out, x_dev, w_dev))
    try:
        from sparkd.backend.dtypes import encode

        new_x = np.random.default_rng(14).standard_normal((3, 128)).astype(np.float32)
        host = encode(new_x, DType.bfloat16)
        copy_to_device(x_dev, host, gpu.stream)
        graph.replay(gpu.stream)
        expected = gpu.download(x_dev).astype(np.float64) @ w.T
        assert rel_error(gpu.download(out), expected) <= 1e-5
    finally:
        graph.destroy()
