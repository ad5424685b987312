"""Row gather kernel (embedding lookup, last-position rows) vs numpy indexing."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cpu.ops import NumpyOps
from sparkd.backend.cuda.kernels import embedding

pytestmark = pytest.mark.gpu
DTYPES = ["float32", "bfloat16", "float16"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,hidden,tokens", [(50, 64, 1), (37, 33, 7), (1000, 4096, 17), (3, 1, 5)])
def test_embedding_matches_numpy(gpu, dtype, vocab, hidden, tokens):
    rng = np.random.default_rng(vocab * hidden + tokens)
    table = gpu.upload(rng.standard_normal((vocab, hidden), dtype=np.float32), dtype)
    ids = rng.integers(0, vocab, size=tokens).astype(np.int32)
    out = gpu.empty((tokens, hidden), dtype)
    embedding.embedding(out, gpu.upload(ids), table, gpu.stream)
    # A gather is a copy: bit-exact against the table the device holds.
    np.testing.assert_array_equal(gpu.download(out), NumpyOps().embedding(ids, gpu.download(table)))


def test_out_of_range_ids_give_zero_rows(gpu):
    table = gpu.upload(np.arange(12, dtype=np.float32).reshape(4, 3) + 1)
    out = gpu.empty((4, 3), "float32")
    embedding.embedding(out, gpu.upload(np.array([-1, 2, 4, 0], np.int32)), table, gpu.stream)
    expected = np.array([[0, 0, 0], [7, 8, 9], [0, 0, 0], [1, 2, 3]], np.float32)
    np.testing.assert_array_equal(gpu.download(out), expected)


def test_gather_rows_picks_last_positions(gpu):
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((9, 40), dtype=np.float32)
    last = np.array([2, 5, 8], np.int32)  # query_start_loc[1:] - 1 of three sequences
    out = gpu.empty((3, 40), "bfloat16")
    x = gpu.upload(hidden, "bfloat16")
    embedding.gather_rows(out, x, gpu.upload(last), gpu.stream)
    np.testing.assert_array_equal(gpu.download(out), gpu.download(x)[last])


def test_rejects_mismatched_shapes(gpu):
    table = gpu.empty((10, 8), "float32")
    with pytest.raises(ValueError, match="out must be"):
        embedding.embedding(gpu.empty((3, 9), "float32"), gpu.upload(np.zeros(3, np.int32)), table, gpu.stream)
    with pytest.raises(ValueError, match="indices must be int32"):
        embedding.embedding(gpu.empty((3, 8), "float32"), gpu.upload(np.zeros(3, np.int64)), table, gpu.stream)
