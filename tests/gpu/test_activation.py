"""SiLU-and-mul kernel vs NumpyOps.silu_and_mul (relative error max |gpu - ref| / max |ref|)."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cpu.ops import NumpyOps
from sparkd.backend.cuda.kernels import activation

pytestmark = pytest.mark.gpu
DTYPES = ["float32", "bfloat16", "float16"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 14336), (5, 7), (64, 128), (3, 1), (300, 3072), (2, 4100)])
def test_silu_and_mul_matches_numpy(gpu, rel_error, tolerance, dtype, tokens, inter):
    rng = np.random.default_rng(tokens * 17 + inter)
    x = 4 * rng.standard_normal((tokens, 2 * inter), dtype=np.float32)
    x[0, 0] = -200.0  # exp(-gate) overflows: silu -> 0 (fp16 stores it as -200 too)
    x_dev = gpu.upload(x, dtype)
    out = gpu.empty((tokens, inter), dtype)
    activation.silu_and_mul(out, x_dev, gpu.stream)
    expected = NumpyOps().silu_and_mul(gpu.download(x_dev))
    assert rel_error(gpu.download(out), expected) <= tolerance[dtype]
    assert np.all(np.isfinite(gpu.download(out)))


def test_rejects_odd_width(gpu):
    with pytest.raises(ValueError, match=r"x must be \[T, 2I\]"):
        activation.silu_and_mul(gpu.empty((2, 3), "float32"), gpu.empty((2, 7), "float32"), gpu.stream)
