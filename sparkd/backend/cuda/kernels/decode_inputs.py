"""A decode graph's per-step inputs, from the step's mapped staging slot into the bucket's static
region, with the ids an earlier step drew put in (cukernels/decode_inputs.cu)."""

from __future__ import annotations

import numpy as np

from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream
from ..tensor import DeviceTensor
from . import i32, require, require_contiguous, require_dtype

_SPEC = KernelSpec("decode_inputs.cu", "stage_decode_inputs_kernel")
SPECS = [_SPEC]
_THREADS = 256
MAX_DRAWN = 12 * 1024  # the kernel keeps `drawn` in shared memory: 48 KB


def upload_decode_step(region: DeviceTensor, staged_ptr: int, block_tables_word: int, size: int, max_blocks: int,
                        batch: int, width: int, drawn: DeviceTensor | None, stream: Stream) -> None:
    """Enqueue the move of one decode step's inputs into its bucket's region.

    region: int32 [>= block_tables_word + size * max_blocks], the per-step arrays (token_ids
    first, [size]) then block_tables [size, max_blocks]. staged_ptr: the device address of the
    staging slot (pinned host memory: under unified addressing its host address), holding int32
    the same per-step words, then the step's block rows [batch, width], then sources [size]
    (-1: keep the staged id; j: drawn[j]). drawn: [B'] int32, an earlier step's ids, or None
    when no source names one. Keep the slot unchanged until the stream passes the launch."""
    require_dtype("region", region, DType.int32)
    require_contiguous("region", region)
    require(0 < size <= block_tables_word and 0 <= batch <= size and 0 <= width <= max_blocks,
            f"a step of {batch} x {width} blocks does not fit a bucket of {size} x {max_blocks} "
            f"with {block_tables_word} per-step words")
    require(region.numel >= block_tables_word + size * max_blocks,
            f"region of {region.numel} words is smaller than the layout's {block_tables_word + size * max_blocks}")
    num_drawn = 0 if drawn is None else drawn.numel
    if drawn is not None:
        require_dtype("drawn", drawn, DType.int32)
        require_contiguous("drawn", drawn)
        require(num_drawn <= MAX_DRAWN, f"at most {MAX_DRAWN} drawn ids, got {num_drawn}")
    total = block_tables_word + batch * width
    get_kernel(_SPEC).launch(-(-total // _THREADS), _THREADS,
                             [region, np.uint64(staged_ptr), i32(block_tables_word), i32(size), i32(max_blocks),
                              i32(batch), i32(width), drawn if drawn is not None else np.uint64(0), i32(num_drawn)],
                             shared_mem=4 * num_drawn, stream=stream)
