"""Element types shared by the backends, and bfloat16 <-> float32 without torch.

numpy has no bfloat16, so bf16 data lives on the host as its raw uint16 bits.
"""

from __future__ import annotations

import enum

import numpy as np


class DType(enum.Enum):
    """name -> (bytes per element, host numpy dtype, CUDA C type)."""

    float32 = (4, np.float32, "float")
    float16 = (2, np.float16, "__half")
    bfloat16 = (2, np.uint16, "__nv_bfloat16")
    int32 = (4, np.int32, "int")
    int64 = (8, np.int64, "long long")
    uint8 = (1, np.uint8, "unsigned char")

    @property
    def itemsize(self) -> int:
        return self.value[0]

    @property
    def host(self) -> np.dtype:
        return np.dtype(self.value[1])

    @property
    def c_type(self) -> str:
        return self.value[2]

    @classmethod
    def parse(cls, name: str) -> "DType":
        aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
        key = aliases.get(name.lower(), name.lower())
        try:
            return cls[key]
        except KeyError:
            raise ValueError(f"unknown dtype {name!r}; expected one of {[d.name for d in cls]}") from None


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact: bf16 is the top half of fp32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 bits, rounding to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def encode(array: np.ndarray, dtype: DType) -> np.ndarray:
    """Host data in the device representation of `dtype` (bf16 as uint16 bits), C-contiguous."""
    if dtype is DType.bfloat16:
        if array.dtype == np.uint16:
            raise ValueError("a uint16 array is ambiguous as bfloat16 input: pass float values")
        return float32_to_bf16_bits(np.asarray(array, dtype=np.float32))
    return np.ascontiguousarray(array, dtype=dtype.host)


def decode(raw: np.ndarray, dtype: DType) -> np.ndarray:
    """The inverse of `encode`; bf16 comes back as float32."""
    return bf16_bits_to_float32(raw) if dtype is DType.bfloat16 else raw
