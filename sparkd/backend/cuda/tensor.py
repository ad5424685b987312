"""DeviceTensor: a typed, shaped view of device memory, passed to kernels as its pointer."""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from ..dtypes import DType


def as_dtype(dtype: Any) -> DType:
    """DType from a DType, a numpy dtype/type, or a name ("bf16", "float32", ...)."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, str):
        return DType.parse(dtype)
    host = np.dtype(dtype)
    if host == np.float64:
        return DType.float32  # device math is at most fp32; float64 host data is narrowed
    for candidate in DType:
        if candidate.host == host and candidate is not DType.bfloat16:
            return candidate
    raise ValueError(f"dtype {host} has no device equivalent; expected one of {[d.name for d in DType]}")


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class DeviceTensor:
    """ptr: device address of element [0, ..., 0]; strides in elements (None = contiguous).

    `owner` keeps the underlying allocation alive for as long as any view of it lives."""

    __slots__ = ("ptr", "shape", "dtype", "strides", "owner")

    def __init__(self, ptr: int, shape: tuple, dtype: DType, strides: tuple | None = None, owner: Any = None):
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = as_dtype(dtype)
        self.strides = contiguous_strides(self.shape) if strides is None else tuple(int(s) for s in strides)
        if len(self.strides) != len(self.shape):
            raise ValueError(f"strides {self.strides} do not match shape {self.shape}")
        self.owner = owner

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_contiguous(self) -> bool:
        return self.numel <= 1 or _same_strides(self.shape, self.strides, contiguous_strides(self.shape))

    @property
    def rows_contiguous(self) -> bool:
        """Each leading-dim slice is contiguous, rows may be spaced apart (e.g. a column slice)."""
        return _same_strides(self.shape[1:], self.strides[1:], contiguous_strides(self.shape[1:]))

    @property
    def row_stride(self) -> int:
        """Elements between consecutive rows (first dim)."""
        return self.strides[0] if self.shape else 1

    def view(self, shape) -> "DeviceTensor":
        """The same memory with a new shape (contiguous tensors only); one dim may be -1."""
        shape = _resolve_shape(tuple(shape), self.numel)
        if not self.is_contiguous:
            raise ValueError(f"view{shape} needs a contiguous tensor, got strides {self.strides} for {self.shape}")
        return DeviceTensor(self.ptr, shape, self.dtype, None, self.owner)

    def narrow(self, start: int, length: int) -> "DeviceTensor":
        """Rows start .. start+length of the first dim, sharing memory."""
        if not 0 <= start <= start + length <= self.shape[0]:
            raise ValueError(f"rows {start}..{start + length} out of range for shape {self.shape}")
        ptr = self.ptr + start * self.row_stride * self.dtype.itemsize
        return DeviceTensor(ptr, (length, *self.shape[1:]), self.dtype, self.strides, self.owner)

    def __getitem__(self, index: int | slice) -> "DeviceTensor":
        """Along the first dim, as numpy indexes it, sharing memory: an int drops the dim (expert e
        of a stacked [E, N, K]), a slice of unit step keeps it (`narrow`)."""
        if isinstance(index, slice):
            start, stop, step = index.indices(self.shape[0])
            if step != 1:
                raise ValueError(f"only unit-step slices view a DeviceTensor, got step {step}")
            return self.narrow(start, max(stop - start, 0))
        index = operator.index(index)
        if not -self.shape[0] <= index < self.shape[0]:
            raise IndexError(f"index {index} out of range for shape {self.shape}")
        row = self.narrow(index % self.shape[0], 1)
        return DeviceTensor(row.ptr, self.shape[1:], self.dtype, self.strides[1:], self.owner)

    def column_slice(self, start: int, length: int) -> "DeviceTensor":
        """Columns start .. start+length of the last dim of a 2-D tensor, sharing memory."""
        if self.ndim != 2 or not 0 <= start <= start + length <= self.shape[1]:
            raise ValueError(f"columns {start}..{start + length} out of range for shape {self.shape}")
        ptr = self.ptr + start * self.strides[1] * self.dtype.itemsize
        return DeviceTensor(ptr, (self.shape[0], length), self.dtype, self.strides, self.owner)

    def split_last(self, parts: int, size: int) -> "DeviceTensor":
        """A 2-D tensor [R, parts * size] (rows may be spaced) seen as [R, parts, size]."""
        if self.ndim != 2 or self.shape[1] != parts * size or self.strides[1] != 1:
            raise ValueError(f"cannot split shape {self.shape} (strides {self.strides}) into [{parts}, {size}]")
        return DeviceTensor(self.ptr, (self.shape[0], parts, size), self.dtype, (self.strides[0], size, 1), self.owner)

    def __repr__(self) -> str:
        strides = "" if self.is_contiguous else f", strides={self.strides}"
        return f"DeviceTensor(0x{self.ptr:x}, shape={self.shape}, dtype={self.dtype.name}{strides})"


def _same_strides(shape, strides, expected) -> bool:
    # Strides of size-1 dims never matter for addressing.
    return all(size == 1 or s == e for size, s, e in zip(shape, strides, expected))


def _resolve_shape(shape: tuple, numel: int) -> tuple[int, ...]:
    if shape.count(-1) > 1:
        raise ValueError(f"shape {shape} has more than one -1")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or numel % known:
            raise ValueError(f"cannot view {numel} elements as {shape}")
        shape = tuple(numel // known if s == -1 else s for s in shape)
    if math.prod(shape) != numel:
        raise ValueError(f"cannot view {numel} elements as {shape}")
    return tuple(int(s) for s in shape)
