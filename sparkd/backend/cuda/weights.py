"""Large host -> device uploads (weights): chunked through pinned memory, with progress.

Two pinned chunks alternate, so converting the next chunk (fp32 -> bf16 on the host)
overlaps the DMA of the previous one, and pageable memory never makes the driver
synchronise the stream.
"""

from __future__ import annotations

import logging
import sys
import time

import numpy as np
from cuda.bindings import driver

from .driver import Event, Stream, call
from .tensor import DeviceTensor
from .transfer import PinnedBuffer, encode

log = logging.getLogger("sparkd.cuda.weights")

CHUNK_BYTES = 32 << 20
_GiB = float(1 << 30)


class UploadProgress:
    """Counts uploaded bytes; redraws one progress line on a terminal at most 4 times a second."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self._reset()

    def _reset(self) -> None:
        self.num_bytes = 0
        self.num_tensors = 0
        self._start: float | None = None
        self._last_draw = 0.0

    def add(self, nbytes: int) -> None:
        now = time.monotonic()
        if self._start is None:
            self._start = now
        self.num_bytes += nbytes
        self.num_tensors += 1
        if now - self._last_draw > 0.25 and self.stream.isatty():
            self._last_draw = now
            self.stream.write(f"\rloading weights: {self.line()}")
            self.stream.flush()

    def line(self) -> str:
        seconds = max(time.monotonic() - (self._start or time.monotonic()), 1e-9)
        return (f"{self.num_bytes / _GiB:.2f} GiB in {self.num_tensors} tensors, "
                f"{seconds:.1f} s ({self.num_bytes / _GiB / seconds:.2f} GiB/s)")

    def finish(self) -> None:
        """End the progress line and log the total (once per batch of uploads)."""
        if not self.num_tensors:
            return
        if self.stream.isatty():
            self.stream.write("\n")
        log.info("uploaded weights: %s", self.line())
        self._reset()


class ChunkedUploader:
    """Host array -> device tensor in `CHUNK_BYTES` pieces through two pinned buffers."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self._buffers = [PinnedBuffer(CHUNK_BYTES) for _ in range(2)]
        self._events = [Event() for _ in range(2)]
        self.progress = UploadProgress()

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
        self.progress.add(dst.nbytes)
