"""elementwise.add vs numpy: relative error max |a - b| / max |b| <= 1e-5 fp32, 1e-2 bf16/fp16."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.dtypes import DType

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 4096), (1000, 33)])
def test_add_matches_numpy(gpu, rel_error, tolerance, dtype, shape):
    from sparkd.backend.cuda.kernels.elementwise import add

    rng = np.random.default_rng(sum(shape))
    x_dev = gpu.upload(rng.standard_normal(shape).astype(np.float32), dtype)
    y_dev = gpu.upload(rng.standard_normal(shape).astype(np.float32), dtype)
    out = gpu.empty(shape, dtype)
    add(out, x_dev, y_dev, gpu.stream)
    expected = gpu.download(x_dev).astype(np.float64) + gpu.download(y_dev)
    assert rel_error(gpu.download(out), expected) <= tolerance[dtype]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_add_into_the_fp32_residual_stream_stays_fp32(gpu, dtype):
    """x in the model dtype plus an fp32 y gives fp32: exactly the fp32 sum of the two as held."""
    from sparkd.backend.cuda.kernels.elementwise import add

    rng = np.random.default_rng(9)
    x_dev = gpu.upload(rng.standard_normal((5, 4096)).astype(np.float32), dtype)
    y_dev = gpu.upload(rng.standard_normal((5, 4096)).astype(np.float32), "float32")
    out = gpu.empty((5, 4096), "float32")
    add(out, x_dev, y_dev, gpu.stream)
    np.testing.assert_array_equal(gpu.download(out), gpu.download(x_dev) + gpu.download(y_dev))


def test_add_unaligned_views_take_the_scalar_path(gpu, rel_error):
    from sparkd.backend.cuda.kernels.elementwise import add

    x = np.arange(40, dtype=np.float32)
    x_dev = gpu.upload(x).narrow(1, 36).view((9, 4))  # 4 bytes past an aligned address
    y_dev = gpu.upload(np.ones((9, 4), np.float32))
    out = gpu.empty((9, 4), DType.float32)
    add(out, x_dev, y_dev, gpu.stream)
    assert rel_error(gpu.download(out), x[1:37].reshape(9, 4) + 1.0) == 0.0


def test_add_rejects_mismatched_operands(gpu):
    from sparkd.backend.cuda.kernels.elementwise import add

    x = gpu.empty((3, 4), DType.float32)
    with pytest.raises(ValueError, match="equal shapes"):
        add(gpu.empty((3, 5), DType.float32), x, x, gpu.stream)
    with pytest.raises(ValueError, match="out in y's"):
        add(gpu.empty((3, 4), DType.bfloat16), x, x, gpu.stream)
