"""Host <-> device copies: pinned buffers, the per-step staging ring, host encodings.

Copies from pageable memory make the driver synchronise with the stream first, so
everything issued per step goes through pinned memory: the host never waits on
the GPU while it prepares the next step.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Callable, Iterator, Sequence

import numpy as np
from cuda.bindings import driver

from ..dtypes import DType
from .driver import Event, Stream, call, ensure_context, release
from .memory import DeviceAllocator
from .tensor import DeviceTensor, as_dtype

ALIGNMENT = 256  # cuBLASLt and vector loads want 256-byte aligned operands


def pack_layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Byte offsets placing buffers of `sizes` back to back, each ALIGNMENT-aligned; and the total."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGNMENT) * ALIGNMENT
    return offsets, max(total, ALIGNMENT)


def pack_into(host: np.ndarray, arrays: Sequence[np.ndarray], offsets: Sequence[int]) -> None:
    """Copy C-contiguous `arrays` into the uint8 buffer `host` at `offsets` (from `pack_layout`)."""
    for array, offset in zip(arrays, offsets):
        host[offset : offset + array.nbytes] = array.view(np.uint8).reshape(-1)


class PinnedBuffer:
    """Page-locked host memory, mapped into the device's address space: `.array` is a uint8
    numpy view of all of it, `.device_ptr` the address kernels read and write it through
    (over PCIe; the host address itself under unified addressing)."""

    def __init__(self, nbytes: int):
        ensure_context()
        self.nbytes = nbytes
        flags = driver.CU_MEMHOSTALLOC_PORTABLE | driver.CU_MEMHOSTALLOC_DEVICEMAP
        self.ptr = int(call(driver.cuMemHostAlloc, nbytes, flags))
        self.device_ptr = int(call(driver.cuMemHostGetDevicePointer, self.ptr, 0))
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.ptr))

    def __del__(self):
        if getattr(self, "ptr", 0):
            release(driver.cuMemFreeHost, self.ptr)


def copy_to_device(dst: DeviceTensor, host: np.ndarray, stream: Stream) -> None:
    """Asynchronous H2D of a C-contiguous host array holding exactly dst's bytes.

    Keep `host` alive and unchanged until the stream reaches the copy if it is pinned."""
    if not dst.is_contiguous or host.nbytes != dst.nbytes or not host.flags.c_contiguous:
        raise ValueError(f"cannot copy {host.nbytes} host bytes into {dst}")
    if dst.nbytes:
        call(driver.cuMemcpyHtoDAsync, dst.ptr, host.ctypes.data, dst.nbytes, stream.handle)


def copy_to_host(host: np.ndarray, src: DeviceTensor, stream: Stream) -> None:
    """D2H into a C-contiguous host array; returns after the copy has landed."""
    if not src.is_contiguous or host.nbytes != src.nbytes or not host.flags.c_contiguous:
        raise ValueError(f"cannot copy {src} into {host.nbytes} host bytes")
    if src.nbytes:
        call(driver.cuMemcpyDtoHAsync, host.ctypes.data, src.ptr, src.nbytes, stream.handle)
    stream.synchronize()


def copy_device(dst: DeviceTensor, src: DeviceTensor, stream: Stream) -> None:
    """D2D copy of equal shapes. Either side may have spaced rows (a column slice)."""
    if dst.shape != src.shape or dst.dtype is not src.dtype:
        raise ValueError(f"copy needs equal shapes and dtypes, got {dst} <- {src}")
    if not dst.nbytes:
        return
    if dst.is_contiguous and src.is_contiguous:
        call(driver.cuMemcpyDtoDAsync, dst.ptr, src.ptr, dst.nbytes, stream.handle)
        return
    if not (dst.rows_contiguous and src.rows_contiguous):
        raise ValueError(f"copy supports row-strided tensors only, got {dst} <- {src}")
    item = dst.dtype.itemsize
    params = driver.CUDA_MEMCPY2D()
    params.srcMemoryType = params.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
    params.srcDevice, params.srcPitch = src.ptr, src.row_stride * item
    params.dstDevice, params.dstPitch = dst.ptr, dst.row_stride * item
    params.WidthInBytes = dst.nbytes // dst.shape[0]
    params.Height = dst.shape[0]
    call(driver.cuMemcpy2DAsync, params, stream.handle)


class StagingRing:
    """Per-step inputs: several host arrays packed into one pinned slot, one H2D copy
    (`upload`); or a slot the caller fills and copies from itself (`slot`).

    A slot is rewritten only after the event of its previous copies has completed,
    so the host may run steps ahead of the GPU without corrupting inputs in flight.
    A step uses up to about eight slots and two steps may be in flight (async
    scheduling): 24 slots keep the host from waiting on a slot's event."""

    def __init__(self, allocator: DeviceAllocator, stream: Stream, num_slots: int = 24, slot_bytes: int = 1 << 20):
        self.allocator = allocator
        self.stream = stream
        self._slots = [PinnedBuffer(slot_bytes) for _ in range(num_slots)]
        self._events = [Event() for _ in range(num_slots)]  # an event never recorded counts as complete
        self._next = 0

    def upload(self, arrays: Sequence[np.ndarray], dest: DeviceTensor | None = None,
               dtypes: Sequence[DType] | None = None) -> list[DeviceTensor]:
        """Copy `arrays`, already in their device representation, in one H2D copy.

        dest: a uint8 device buffer laid out by `pack_layout` to copy into (graph
        static inputs); by default a fresh one. dtypes: the device dtype of each
        array when its host dtype does not say (bf16 bits). Returns a view per array."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        dtypes = dtypes or [as_dtype(a.dtype) for a in arrays]
        offsets, total = pack_layout([a.nbytes for a in arrays])
        if dest is None:
            dest = self.allocator.empty((total,), DType.uint8)
        elif dest.nbytes < total:
            raise ValueError(f"staging destination of {dest.nbytes} bytes is smaller than the {total} bytes packed")
        with self.slot(total) as pinned:
            pack_into(pinned.array, arrays, offsets)
            call(driver.cuMemcpyHtoDAsync, dest.ptr, pinned.ptr, total, self.stream.handle)
        return [DeviceTensor(dest.ptr + offset, a.shape, dtype, None, dest.owner)
                for a, dtype, offset in zip(arrays, dtypes, offsets)]

    @contextlib.contextmanager
    def slot(self, nbytes: int) -> Iterator[PinnedBuffer]:
        """The next pinned slot, at least `nbytes` long, for the caller to fill and copy from
        on this ring's stream (for layouts `upload` does not pack, e.g. pitched copies).
        Its earlier copies have completed; after the block it is not rewritten until the
        copies issued inside the block have completed too."""
        self._events[self._next].synchronize()
        if self._slots[self._next].nbytes < nbytes:
            self._slots[self._next] = PinnedBuffer(max(nbytes, 2 * self._slots[self._next].nbytes))
        try:
            yield self._slots[self._next]
        finally:
            self._events[self._next].record(self.stream)
            self._next = (self._next + 1) % len(self._slots)


class DownloadRing:
    """Pinned slots for device results the host reads later (a step's sampled ids).

    `take` hands out the next slot for kernels to write through its mapping (no copy:
    each D2H copy costs ~4 us of the stream whatever its size); `copy_async` copies a
    device tensor into one. Either way a function comes back that waits for the writes
    and returns a private copy of the bytes. A slot is reused `num_slots` takes later;
    the engine reads each result before enqueuing the step after next, so four
    slots leave room to spare."""

    def __init__(self, num_slots: int = 4, slot_bytes: int = 64 << 10):
        self._slots = [PinnedBuffer(slot_bytes) for _ in range(num_slots)]
        self._events = [Event() for _ in range(num_slots)]
        self._next = 0

    def take(self, nbytes: int) -> tuple[DeviceTensor, Callable[[Stream], Callable[[], np.ndarray]]]:
        """The next slot as a uint8 [nbytes] tensor at its device address, and `ready`: called
        once the kernels that write it are enqueued on a stream, it returns () -> uint8 host
        array of the slot's bytes, which waits for them."""
        index = self._next
        self._next = (index + 1) % len(self._slots)
        if self._slots[index].nbytes < nbytes:
            self._slots[index] = PinnedBuffer(max(nbytes, 2 * self._slots[index].nbytes))
        slot, event = self._slots[index], self._events[index]

        def ready(stream: Stream) -> Callable[[], np.ndarray]:
            event.record(stream)

            def wait() -> np.ndarray:
                event.synchronize()
                return slot.array[:nbytes].copy()

            return wait

        return DeviceTensor(slot.device_ptr, (nbytes,), DType.uint8, None, slot), ready

    def copy_async(self, src: DeviceTensor, stream: Stream) -> Callable[[], np.ndarray]:
        """src: contiguous device tensor -> () -> uint8 host array of its bytes."""
        if not src.is_contiguous:
            raise ValueError(f"cannot download the non-contiguous {src}")
        slot, ready = self.take(src.nbytes)
        if src.nbytes:
            # Unified addressing tells the driver the slot's address is pinned host memory.
            call(driver.cuMemcpyAsync, slot.ptr, src.ptr, src.nbytes, stream.handle)
        return ready(stream)
