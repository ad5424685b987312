"""RMSNorm kernels (plain, per-head on strided views, fused residual add) vs NumpyOps.

Relative error is max |gpu - ref| / max |ref| (the `rel_error` fixture); the
reference runs in float32 on exactly the values the device holds."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cpu.ops import NumpyOps
from sparkd.backend.cuda.kernels import norm

pytestmark = pytest.mark.gpu
DTYPES = ["float32", "bfloat16", "float16"]
EPS = 1e-6


def _weight(rng, dim):
    return 1.0 + 0.1 * rng.standard_normal(dim, dtype=np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 4096), (3, 7), (64, 896), (2, 16384), (9, 33)])
@pytest.mark.parametrize("residual_dtype", ["like x", "float32"])
def test_add_rmsnorm_matches_numpy(gpu, rel_error, tolerance, dtype, rows, dim, residual_dtype):
    """The fp32 residual stream: residual' = x + residual exactly in fp32 (the sum of a
    bf16 and an fp32 value, each exact in fp32, rounded once as numpy's fp32 add does),
    out = rmsnorm(residual') rounded to x's dtype. An fp32 residual is updated in place;
    one in x's dtype (the first layer's) goes to a new fp32 buffer."""
    rng = np.random.default_rng(rows * 31 + dim)
    residual_dtype = dtype if residual_dtype == "like x" else residual_dtype
    x = gpu.upload(rng.standard_normal((rows, dim), dtype=np.float32), dtype)
    residual = gpu.upload(2 * rng.standard_normal((rows, dim), dtype=np.float32), residual_dtype)
    weight = gpu.upload(_weight(rng, dim), dtype)
    x_host, residual_host, weight_host = gpu.download(x), gpu.download(residual), gpu.download(weight)
    out = gpu.empty((rows, dim), dtype)
    residual_out = residual if residual_dtype == "float32" else gpu.empty((rows, dim), "float32")
    norm.add_rmsnorm(out, residual_out, residual, x, weight, EPS, gpu.stream)

    summed = x_host.astype(np.float32) + residual_host.astype(np.float32)
    np.testing.assert_array_equal(gpu.download(residual_out), summed)
    expected = NumpyOps().rmsnorm(summed, weight_host, EPS)
    assert rel_error(gpu.download(out), expected) <= tolerance[dtype]


# Significant bits of each 16-bit type: y_lo is at most half an ulp of y, 2^-bits of its binade.
SIGNIFICANT_BITS = {"bfloat16": 8, "float16": 11}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("rows,dim", [(1, 2048), (7, 2048), (5, 33)])
def test_add_rmsnorm_also_writes_the_rounding_error_for_a_router(gpu, rel_error, dtype, rows, dim):
    """out and out_lo are the two halves of one [R, 2D] buffer (a MoE router's input): out is the
    normed rows rounded to dtype, out_lo what that rounding lost (at most half an ulp of out),
    rounded too, so that out + out_lo is the unrounded row to 2^-2*bits of each element."""
    rng = np.random.default_rng(5 + dim)
    x = gpu.upload(rng.standard_normal((rows, dim), dtype=np.float32), dtype)
    residual = gpu.upload(rng.standard_normal((rows, dim), dtype=np.float32), "float32")
    weight = gpu.upload(_weight(rng, dim), dtype)
    summed = gpu.download(x) + gpu.download(residual)
    expected = NumpyOps().rmsnorm(summed, gpu.download(weight), EPS).astype(np.float64)
    split = gpu.empty((rows, 2 * dim), dtype)
    norm.add_rmsnorm(split.column_slice(0, dim), residual, residual, x, weight, EPS, gpu.stream,
                     split.column_slice(dim, dim))
    halves = gpu.download(split)
    out, out_lo = halves[:, :dim].astype(np.float64), halves[:, dim:].astype(np.float64)
    bits = SIGNIFICANT_BITS[dtype]
    assert np.all(out != 0)
    half_ulp = np.exp2(np.floor(np.log2(np.abs(out))) - bits)
    assert np.all(np.abs(out_lo) <= half_ulp)
    # The GPU's and numpy's fp32 norms differ by a few fp32 ulps; the split adds 2^-2*bits.
    bound = 2.0 ** (-2 * bits) * np.abs(expected) + 1e-6 * np.abs(expected).max()
    assert np.all(np.abs(out + out_lo - expected) <= bound)
    assert rel_error(out, expected) <= 2.0 ** -bits


def test_add_rmsnorm_rejects_out_lo_over_out(gpu):
    """out_lo shifted by one row of a [R, 2D] buffer would overwrite out's next row."""
    x = gpu.empty((2, 8), "bfloat16")
    residual = gpu.empty((2, 8), "float32")
    split = gpu.empty((3, 16), "bfloat16")
    out = split.column_slice(0, 8)
    shifted = type(out)(out.ptr + 16 * 2, out.shape, out.dtype, out.strides, out.owner)
    with pytest.raises(ValueError, match="out_lo must be"):
        norm.add_rmsnorm(out, residual, residual, x, gpu.empty((8,), "bfloat16"), EPS, gpu.stream, shifted)


def test_add_rmsnorm_rejects_a_narrow_residual_out(gpu):
    x = gpu.empty((2, 8), "bfloat16")
    weight = gpu.empty((8,), "bfloat16")
    residual = gpu.empty((2, 8), "bfloat16")
    with pytest.raises(ValueError, match="residual_out must be"):
        norm.add_rmsnorm(gpu.empty((2, 8), "bfloat16"), residual, residual, x, weight, EPS, gpu.stream)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rmsnorm_of_fp32_rows_writes_the_weight_dtype(gpu, rel_error, tolerance, dtype):
    """The final norm reads the fp32 residual stream and writes the model dtype."""
    rng = np.random.default_rng(8)
    x = gpu.upload(3 * rng.standard_normal((6, 4096)).astype(np.float32), "float32")
    weight = gpu.upload(_weight(rng, 4096), dtype)
    out = gpu.empty((6, 4096), dtype)
    norm.rmsnorm(out, x, weight, EPS, gpu.stream)
    assert rel_error(gpu.download(out), NumpyOps().rmsnorm(gpu.download(x), gpu.download(weight), EPS)) \
        <= tolerance[dtype]


def test_zero_row_stays_finite(gpu):
    x = gpu.upload(np.zeros((2, 64), np.float32))
    out = gpu.empty((2, 64), "float32")
    norm.rmsnorm(out, x, gpu.upload(np.ones(64, np.float32)), EPS, gpu.stream)
    np.testing.assert_array_equal(gpu.download(out), np.zeros((2, 64), np.float32))


def test_rejects_bad_operands(gpu):
    x = gpu.empty((2, norm.MAX_DIM + 8), "float32")
    with pytest.raises(ValueError, match="normalised dim"):
        norm.rmsnorm(gpu.empty(x.shape, "float32"), x, gpu.empty((x.shape[1],), "float32"), EPS, gpu.stream)
    x = gpu.empty((2, 8), "float32")
    with pytest.raises(ValueError, match="weight must be"):
        norm.rmsnorm(gpu.empty((2, 8), "float32"), x, gpu.empty((8,), "bfloat16"), EPS, gpu.stream)
    with pytest.raises(ValueError, match="out must not be x"):
        norm.rmsnorm(x, x, gpu.empty((8,), "float32"), EPS, gpu.stream)
