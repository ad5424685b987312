"""fp32 logits from a half-precision lm_head output (cukernels/logits.cu).

The last-position rows themselves are gathered by `embedding.gather_rows`
before the final norm, so the norm and lm_head run on B rows only."""

from __future__ import annotations

import numpy as np

from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream
from ..tensor import DeviceTensor
from . import (
    element_name,
    element_specs,
    require,
    require_contiguous,
    require_dtype,
    vector_width,
)

_SOURCE = "logits.cu"
SPECS = element_specs(_SOURCE, "to_float32_kernel")
_THREADS = 256
_MAX_BLOCKS = 8192  # the kernel strides over the rest


def to_float32(out: DeviceTensor, x: DeviceTensor, stream: Stream) -> None:
    """out = float32(x) elementwise: x [B, V] bf16/fp16/fp32 -> out [B, V] float32, both contiguous."""
    require_dtype("x", x, DType.bfloat16, DType.float16, DType.float32)
    require_dtype("out", out, DType.float32)
    require(out.shape == x.shape, f"out must be {x.shape}, got {out.shape}")
    require_contiguous("x", x)
    require_contiguous("out", out)
    if x.numel == 0:
        return
    width = vector_width(x.dtype, (out, x), (x.numel,))
    blocks = min(_MAX_BLOCKS, -(-x.numel // (width * _THREADS)))
    kernel = get_kernel(KernelSpec(_SOURCE, element_name("to_float32_kernel", x.dtype, width)))
    kernel.launch(blocks, _THREADS, [out, x, np.int64(x.numel)], stream=stream)
