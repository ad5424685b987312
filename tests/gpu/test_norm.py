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
@pytest.mark.parametrize("rows,dim", [(1, 4096), (3, 7), (33, 128), (5, 5120), (2, 16384), (17, 1), (4, 3000)])
def test_rmsnorm_matches_numpy(gpu, rel_error, tolerance, dtype, rows, dim):
    rng = np.random.default_rng(rows * 7919 + dim)
    x = gpu.upload(3 * rng.standard_normal((rows, dim), dtype=np.float32), dtype)
    weight = gpu.upload(_weight(rng, dim), dtype)
    out = gpu.empty((rows, dim), dtype)
    norm.rmsnorm(out, x, weight, EPS, gpu.stream)
    expected = NumpyOps().rmsnorm(gpu.download(x), gpu.download(weight), EPS)
    assert rel_error(gpu.download(out), expected) <= tolerance[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [(1, 8, 2, 128), (7, 4, 4, 64), (19, 6, 2, 36)])
def test_per_head_norm_on_qkv_views(gpu, rel_error, tolerance, dtype, tokens, q_heads, kv_heads, head_dim):
    """q/k norm (Qwen3) runs on the q and k views of the fused qkv output: rows are spaced."""
    rng = np.random.default_rng(tokens + head_dim)
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = gpu.upload(rng.standard_normal((tokens, width), dtype=np.float32), dtype)
    weight = gpu.upload(_weight(rng, head_dim), dtype)
    qkv_host = gpu.download(qkv)
    for start, heads in ((0, q_heads), (q_heads * head_dim, kv_heads)):
        view = qkv.column_slice(start, heads * head_dim).split_last(heads, head_dim)
        out = gpu.empty((tokens, heads, head_dim), dtype)
        norm.rmsnorm(out, view, weight, EPS, gpu.stream)
        host_view = qkv_host[:, start : start + heads * head_dim].reshape(tokens, heads, head_dim)
        expected = NumpyOps().rmsnorm(host_view, gpu.download(weight), EPS)
        assert rel_error(gpu.download(out), expected) <= tolerance[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 4096), (3, 7), (64, 896), (2, 16384), (9, 33)])
def test_add_rmsnorm_matches_numpy(gpu, rel_error, tolerance, dtype, rows, dim):
    rng = np.random.default_rng(rows * 31 + dim)
    x = gpu.upload(rng.standard_normal((rows, dim), dtype=np.float32), dtype)
    residual = gpu.upload(2 * rng.standard_normal((rows, dim), dtype=np.float32), dtype)
    weight = gpu.upload(_weight(rng, dim), dtype)
    x_host, residual_host, weight_host = gpu.download(x), gpu.download(residual), gpu.download(weight)
    out = gpu.empty((rows, dim), dtype)
    norm.add_rmsnorm(out, residual, x, weight, EPS, gpu.stream)

    # The sum is stored in the residual's dtype, so round the reference the same way
    # (an upload rounds to nearest even, as the kernel does) and normalise that.
    summed = gpu.download(gpu.upload(x_host + residual_host, dtype))
    np.testing.assert_array_equal(gpu.download(residual), summed)
    expected = NumpyOps().rmsnorm(summed, weight_host, EPS)
    assert rel_error(gpu.download(out), expected) <= tolerance[dtype]


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
