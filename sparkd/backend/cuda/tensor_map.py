"""TMA tensor maps (cukernels/tma.cuh): the 128-byte descriptor a kernel's bulk tensor copies read,
encoded on the host by cuTensorMapEncodeTiled and passed by value as a kernel argument.

A map names a tensor's address, extents and strides, the box one copy moves, and the shared-memory
layout it lands in; the copy engine zero-fills what lies past the extents. Encoding touches no
device memory, so a map is valid for as long as the tensor it describes is.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from cuda.bindings import driver

from ..dtypes import DType
from .driver import check
from .tensor import DeviceTensor

TENSOR_MAP_BYTES = 128
_DATA_TYPES = {DType.bfloat16: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
               DType.float16: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16}
SWIZZLE_BYTES = 128  # CU_TENSOR_MAP_SWIZZLE_128B: wgmma.cuh's tile layout; a box row is at most this
L2_PROMOTION = driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B  # L2 fills of 256 bytes a box row


class TensorMap:
    """An encoded map: `words`, its 16 opaque 8-byte words, are what a launch passes."""

    __slots__ = ("words",)

    def __init__(self, words: np.ndarray):
        if words.dtype != np.uint64 or words.shape != (TENSOR_MAP_BYTES // 8,):
            raise ValueError(f"a tensor map is {TENSOR_MAP_BYTES // 8} uint64 words, got {words.dtype} {words.shape}")
        self.words = words


def swizzled_boxes(tensor: DeviceTensor, box_rows: int) -> TensorMap:
    """A map of a contiguous 3-D 16-bit tensor [D2, D1, D0] whose boxes are box_rows x (128 bytes of
    D0) of one D2 index, in the 128-byte swizzle: a box lands as box_rows rows of 128 bytes, the
    layout of wgmma.cuh's K-major tiles. D0 must be whole 16-byte chunks and the address 16-byte
    aligned (TMA's rules); the map is cached per tensor address and shape."""
    if tensor.dtype not in _DATA_TYPES:
        raise ValueError(f"swizzled_boxes maps bf16 or fp16 tensors, got {tensor.dtype.name}")
    if tensor.ndim != 3 or not tensor.is_contiguous:
        raise ValueError(f"swizzled_boxes maps a contiguous 3-D tensor, got {tensor}")
    row_bytes = tensor.shape[2] * tensor.dtype.itemsize
    if row_bytes % 16 or tensor.ptr % 16:
        raise ValueError(f"TMA needs 16-byte aligned rows and address, got {tensor}")
    if not 1 <= box_rows <= 256:
        raise ValueError(f"a box has 1 to 256 rows, got {box_rows}")
    return _encode(tensor.ptr, tensor.shape, tensor.dtype, box_rows)


@lru_cache(maxsize=1024)
def _encode(ptr: int, shape: tuple[int, int, int], dtype: DType, box_rows: int) -> TensorMap:
    d2, d1, d0 = shape
    itemsize = dtype.itemsize
    box_elements = SWIZZLE_BYTES // itemsize
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t  # the bindings take these wrappers, not ints
    encoded = check(driver.cuTensorMapEncodeTiled(
        _DATA_TYPES[dtype], 3, ptr, [u64(d0), u64(d1), u64(d2)], [u64(d0 * itemsize), u64(d1 * d0 * itemsize)],
        [u32(box_elements), u32(box_rows), u32(1)], [u32(1)] * 3, driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        L2_PROMOTION,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        f"cuTensorMapEncodeTiled of [{d2}, {d1}, {d0}] {dtype.name}, boxes of {box_rows} rows")
    return TensorMap(np.array(encoded.opaque, dtype=np.uint64))
