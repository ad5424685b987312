"""Kernel launchers, one module per `cukernels/` family.

Each module exposes `SPECS` (every template instantiation it may launch, which
`sparkd kernels build` compiles ahead of time) and launch functions that check
their preconditions, pick the instantiation and grid, and enqueue on a stream.
Outputs are passed in preallocated, so launches can be captured in CUDA graphs.

Modules: activation, attention, decode_inputs, delta_net, delta_net_decode, embedding, gemv, gemv_norm, moe_gemm,
moe_grouped_gemm, moe_grouped_wgmma, moe_router, moe_routing, norm, rope_kv, sampling (plus
elementwise, owned by the runtime; fault, a test-only trap; and attention_plan, attention's decode split plan,
which launches nothing and has no SPECS).

This file holds what the launchers share: the element types the kernels are
templated on and the choice of vector width.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ...dtypes import DType
from ..compiler import KernelSpec
from ..tensor import DeviceTensor

ELEMENT_TYPES = (DType.float32, DType.float16, DType.bfloat16)
ACCESS_BYTES = 16  # the widest load/store a thread issues


def vector_widths(dtype: DType) -> tuple[int, int]:
    """The instantiated widths for `dtype`: scalar, and one 16-byte access."""
    return 1, ACCESS_BYTES // dtype.itemsize


def element_specs(source: str, kernel: str) -> list[KernelSpec]:
    """`kernel<T, W>` for every element type T and both of its widths W."""
    return [KernelSpec(source, element_name(kernel, dtype, width))
            for dtype in ELEMENT_TYPES for width in vector_widths(dtype)]


def element_name(kernel: str, dtype: DType, width: int) -> str:
    return f"{kernel}<{dtype.c_type}, {width}>"


def vector_width(dtype: DType, tensors: Iterable[DeviceTensor], extents: Iterable[int], elements: int | None = None
                 ) -> int:
    """Elements per access: `elements` (default 16 bytes' worth) when every tensor's address is
    aligned to that many elements and every extent (a size or stride in elements) divides by it,
    else 1."""
    width = elements or vector_widths(dtype)[1]
    aligned = all(t.ptr % (width * dtype.itemsize) == 0 for t in tensors)
    return width if aligned and all(int(e) % width == 0 for e in extents) else 1


def require(condition: bool, message: str) -> None:
    """A launcher precondition: a clear ValueError instead of a wild device access."""
    if not condition:
        raise ValueError(message)


def require_dtype(name: str, tensor: DeviceTensor, *dtypes: DType) -> None:
    require(tensor.dtype in dtypes,
            f"{name} must be {' or '.join(d.name for d in dtypes)}, got {tensor.dtype.name}")


def require_contiguous(name: str, tensor: DeviceTensor) -> None:
    require(tensor.is_contiguous, f"{name} must be contiguous, got strides {tensor.strides} for {tensor.shape}")


def row_stride(t: DeviceTensor) -> int:
    """Elements between the rows of a 2-D operand a kernel walks; a single row has none to honour."""
    return t.row_stride if t.shape[0] > 1 else t.shape[1]


def overlaps(a: DeviceTensor, b: DeviceTensor) -> bool:
    """Whether the bytes a and b span share an address (their extents, strides aside)."""
    return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def i32(value) -> np.int32:
    """A kernel's int argument, refusing values that would wrap."""
    value = int(value)
    require(-2**31 <= value < 2**31, f"{value} does not fit a kernel's int argument")
    return np.int32(value)
