"""Large host -> device uploads (weights): chunked through pinned memory.

Two pinned chunks alternate, so converting the next chunk (fp32 -> bf16 on the host)
overlaps the DMA of the previous one, and pageable memory never makes the driver
synchronise the stream.
"""

from __future__ import annotations

import numpy as np
from cuda.bindings import driver

from .driver import Event, Stream, call
from .tensor import DeviceTensor
from .transfer import PinnedBuffer
from ..dtypes import encode

CHUNK_BYTES = 32 << 20


class ChunkedUploader:
    """Host array -> device tensor in `CHUNK_BYTES` pieces through two pinned buffers."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self._buffers = [PinnedBuffer(CHUNK_BYTES) for _ in range(2)]
        self._events = [Event() for _ in range(2)]

    def upload(self, dst: DeviceTensor, array: np.ndarray) -> None:
        """Copy `array` (any float or int dtype) into the contiguous `dst`, converting to dst.dtype."""
        if not dst.is_contiguous or array.size != dst.numel:
            raise ValueError(f"cannot upload an array of shape {array.shape} into {dst}")
        flat = array.reshape(-1)
        per_chunk = CHUNK_BYTES // dst.dtype.itemsize
        for index, start in enumerate(range(0, flat.size, per_chunk)):
            slot = index % 2
            self._events[slot].synchronize()  # its previous DMA has drained the buffer
            part = encode(flat[start : start + per_chunk], dst.dtype).view(np.uint8)
            buffer = self._buffers[slot]
            buffer.array[: part.size] = part
            call(driver.cuMemcpyHtoDAsync, dst.ptr + start * dst.dtype.itemsize, buffer.ptr, part.size,
                 self.stream.handle)
            self._events[slot].record(self.stream)
