"""Launcher for elementwise ops (cukernels/elementwise.cu): add."""

from __future__ import annotations

import numpy as np

from ..compiler import KernelSpec, get_kernel
from ..driver import Stream, current_device
from ..tensor import DeviceTensor
from . import ELEMENT_TYPES, element_name, element_specs, require, require_contiguous, require_dtype, vector_width

SPECS: list[KernelSpec] = element_specs("elementwise.cu", "add_kernel")

_THREADS = 256
_BLOCKS_PER_SM = 8  # a grid-stride loop: enough resident blocks to cover memory latency


def add(out: DeviceTensor, x: DeviceTensor, y: DeviceTensor, stream: Stream | None) -> None:
    """out = x + y; all three contiguous, of one shape and dtype."""
    for name, tensor in (("out", out), ("x", x), ("y", y)):
        require_contiguous(name, tensor)
        require_dtype(name, tensor, *ELEMENT_TYPES)
    require(out.shape == x.shape == y.shape, f"add needs equal shapes, got {out.shape} = {x.shape} + {y.shape}")
    require(out.dtype is x.dtype is y.dtype, "add needs one dtype for out, x and y")
    if out.numel == 0:
        return
    width = vector_width(out.dtype, (out, x, y), (out.numel,))
    chunks = out.numel // width
    grid = max(1, min(-(-chunks // _THREADS), current_device().sm_count * _BLOCKS_PER_SM))
    get_kernel(KernelSpec("elementwise.cu", element_name("add_kernel", out.dtype, width))).launch(
        grid, _THREADS, [out, x, y, np.int64(out.numel)], stream=stream)
