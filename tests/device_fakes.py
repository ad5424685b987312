"""Device tensors for host-side launcher tests: a pointer that is never dereferenced, so
the checks a launcher makes before it loads a kernel run with no GPU."""

from __future__ import annotations

from sparkd.backend.cuda.tensor import DeviceTensor
from sparkd.backend.dtypes import DType


def fake_tensor(shape, dtype="bfloat16", ptr=0x10000, strides=None) -> DeviceTensor:
    return DeviceTensor(ptr, shape, DType.parse(dtype), strides)
