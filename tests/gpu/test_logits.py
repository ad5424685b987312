"""Logits helpers: fp32 output from half-precision lm_head rows (exact widening),
and the final norm + lm_head on the gathered last positions vs NumpyOps.logits."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cpu.ops import NumpyOps
from sparkd.backend.cuda.kernels import embedding, logits, norm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("rows,vocab", [(1, 151936), (3, 1001), (8, 32000), (2, 5)])
def test_to_float32_is_exact(gpu, dtype, rows, vocab):
    rng = np.random.default_rng(rows + vocab)
    x = gpu.upload(8 * rng.standard_normal((rows, vocab), dtype=np.float32), dtype)
    out = gpu.empty((rows, vocab), "float32")
    logits.to_float32(out, x, gpu.stream)
    np.testing.assert_array_equal(gpu.download(out), gpu.download(x))


def test_final_norm_on_last_positions_matches_numpy(gpu, rel_error, tolerance):
    """gather_rows + rmsnorm + a host matmul: the kernels' share of Ops.logits."""
    rng = np.random.default_rng(7)
    hidden = rng.standard_normal((11, 64), dtype=np.float32)
    indices = np.array([0, 4, 10], np.int32)
    weight = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    lm_head = rng.standard_normal((300, 64), dtype=np.float32)
    rows = gpu.empty((3, 64), "float32")
    embedding.gather_rows(rows, gpu.upload(hidden), gpu.upload(indices), gpu.stream)
    normed = gpu.empty((3, 64), "float32")
    norm.rmsnorm(normed, rows, gpu.upload(weight), 1e-5, gpu.stream)
    result = gpu.download(normed) @ lm_head.T
    expected = NumpyOps().logits(hidden, indices, weight, 1e-5, lm_head)
    assert rel_error(result, expected) <= tolerance["float32"]
