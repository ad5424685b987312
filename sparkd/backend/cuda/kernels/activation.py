"""SiLU-and-mul launcher (cukernels/activation.cu)."""

from __future__ import annotations

from ..compiler import KernelSpec, get_kernel
from ..driver import Stream
from ..tensor import DeviceTensor
from . import (
    ELEMENT_TYPES,
    element_name,
    element_specs,
    i32,
    require,
    require_contiguous,
    require_dtype,
    vector_width,
)

_SOURCE = "activation.cu"
SPECS = element_specs(_SOURCE, "silu_and_mul_kernel")
_THREADS = 256
_MAX_BLOCKS = 8192  # the kernel strides over the rest


def silu_and_mul(out: DeviceTensor, x: DeviceTensor, stream: Stream) -> None:
    """out = silu(gate) * up for x [T, 2I] = [gate | up] -> out [T, I]; both contiguous."""
    require(x.ndim == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2I], got shape {x.shape}")
    require_dtype("x", x, *ELEMENT_TYPES)
    rows, inter = x.shape[0], x.shape[1] // 2
    require(out.shape == (rows, inter) and out.dtype is x.dtype,
            f"out must be {(rows, inter)} {x.dtype.name}, got {out.shape} {out.dtype.name}")
    require_contiguous("x", x)
    require_contiguous("out", out)
    if out.numel == 0:
        return
    width = vector_width(x.dtype, (out, x), (inter,))
    blocks = min(_MAX_BLOCKS, -(-out.numel // (width * _THREADS)))
    kernel = get_kernel(KernelSpec(_SOURCE, element_name("silu_and_mul_kernel", x.dtype, width)))
    kernel.launch(blocks, _THREADS, [out, x, i32(rows), i32(inter)], stream=stream)
