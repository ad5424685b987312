"""DeviceTensor's views index the first dim as numpy does: the same elements at the same offsets."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cuda.tensor import DeviceTensor
from sparkd.backend.dtypes import DType

BASE = 0x7F00_0000_0000


def element_offsets(tensor: DeviceTensor) -> np.ndarray:
    """The byte offset of every element of tensor from BASE, in its index order."""
    grids = np.meshgrid(*(np.arange(n) for n in tensor.shape), indexing="ij")
    return tensor.ptr - BASE + sum(g * s for g, s in zip(grids, tensor.strides)) * tensor.dtype.itemsize


@pytest.mark.parametrize("index", [0, 3, -1, -5, slice(None, 4), slice(1, 5), slice(2, None), slice(3, 3)])
def test_an_index_of_the_first_dim_views_what_numpy_indexes(index):
    stacked = DeviceTensor(BASE, (5, 6, 4), DType.bfloat16)
    reference = np.arange(5 * 6 * 4).reshape(5, 6, 4) * DType.bfloat16.itemsize  # each element's byte offset
    view = stacked[index]
    assert view.shape == reference[index].shape and view.dtype is DType.bfloat16
    np.testing.assert_array_equal(element_offsets(view), reference[index])


def test_a_spaced_tensor_keeps_its_row_stride():
    rows = DeviceTensor(BASE, (4, 3), DType.float32, strides=(8, 1))
    assert rows[2].ptr == BASE + 2 * 8 * 4 and rows[2].shape == (3,) and rows[1:3].strides == (8, 1)


@pytest.mark.parametrize("index", [5, -6])
def test_an_index_past_the_first_dim_is_an_error(index):
    with pytest.raises(IndexError, match="out of range"):
        DeviceTensor(BASE, (5, 2), DType.float32)[index]


def test_a_stepped_slice_is_an_error():
    with pytest.raises(ValueError, match="unit-step"):
        DeviceTensor(BASE, (5, 2), DType.float32)[::2]
