"""The CUDA driver runtime: status checking, the primary context, streams and events.

Every driver call goes through `call` (or `check` on a result tuple), so a failure
raises `CudaError` naming the error. Sticky errors, after which the context is
unusable (illegal address, launch failure), raise `DeviceLostError`: the engine
must stop, not retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from functools import cache
from typing import Callable, Iterator

from cuda.bindings import driver

from .. import base

# Errors that poison the context: every later call fails too, so the process must restart.
_STICKY_ERRORS = frozenset({
    driver.CUresult.CUDA_ERROR_ECC_UNCORRECTABLE,
    driver.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,
    driver.CUresult.CUDA_ERROR_ASSERT,
    driver.CUresult.CUDA_ERROR_HARDWARE_STACK_ERROR,
    driver.CUresult.CUDA_ERROR_ILLEGAL_INSTRUCTION,
    driver.CUresult.CUDA_ERROR_MISALIGNED_ADDRESS,
    driver.CUresult.CUDA_ERROR_INVALID_ADDRESS_SPACE,
    driver.CUresult.CUDA_ERROR_INVALID_PC,
    driver.CUresult.CUDA_ERROR_LAUNCH_FAILED,
})


class CudaError(Exception):
    """A CUDA driver call failed. `.name` is the CUresult name, `.code` its number."""

    def __init__(self, code: int, name: str, what: str = ""):
        self.code = code
        self.name = name
        where = f"{what}: " if what else ""
        super().__init__(f"{where}{name} ({code})")


class DeviceLostError(CudaError, base.DeviceLostError):
    """A sticky device error: the context is unusable until the process restarts."""


def error_from_status(status: driver.CUresult, what: str = "") -> CudaError:
    status = driver.CUresult(status)
    kind = DeviceLostError if status in _STICKY_ERRORS else CudaError
    return kind(int(status), status.name, what)


def check(result, what: str = ""):
    """Unpack a cuda-bindings result tuple `(status, *values)`.

    Returns None, the single value, or a tuple of values; raises CudaError on failure."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if status != driver.CUresult.CUDA_SUCCESS:
        raise error_from_status(status, what)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def call(fn, *args):
    """`fn(*args)` for a driver function, checked; errors name the function."""
    return check(fn(*args), fn.__name__)


@dataclass(frozen=True)
class Device:
    """The device this process drives, with its retained primary context."""

    index: int
    handle: driver.CUdevice
    context: driver.CUcontext
    name: str
    arch: str  # "sm_90"
    total_memory: int
    sm_count: int
    max_shared_per_block_optin: int


_thread_state = threading.local()
_init_lock = threading.Lock()
_device: Device | None = None


def init_device(index: int = 0) -> Device:
    """Retain the primary context of device `index` and make it current in this thread.

    Safe to call from any thread; the first call fixes the device for the process."""
    global _device
    with _init_lock:
        if _device is None:
            _device = _open_device(index)
    if _device.index != index:
        raise ValueError(f"device index {index} asked for, but this process already drives device {_device.index}")
    ensure_context()
    return _device


def _open_device(index: int) -> Device:
    call(driver.cuInit, 0)
    count = call(driver.cuDeviceGetCount)
    if not 0 <= index < count:
        raise ValueError(f"device index {index} is out of range: {count} CUDA device(s) found")
    handle = call(driver.cuDeviceGet, index)
    context = call(driver.cuDevicePrimaryCtxRetain, handle)
    name = call(driver.cuDeviceGetName, 256, handle).split(b"\0", 1)[0].decode()
    attr = driver.CUdevice_attribute
    major = _attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle)
    minor = _attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle)
    return Device(
        index=index,
        handle=handle,
        context=context,
        name=name,
        arch=f"sm_{major}{minor}",
        total_memory=call(driver.cuDeviceTotalMem, handle),
        sm_count=_attribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, handle),
        max_shared_per_block_optin=_attribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, handle),
    )


def ensure_context() -> None:
    """Make the primary context current in the calling thread (once per thread).

    The engine calls ops from a worker thread, and a context is current per thread."""
    if getattr(_thread_state, "has_context", False):
        return
    if _device is None:
        init_device()
        return
    call(driver.cuCtxSetCurrent, _device.context)
    _thread_state.has_context = True


def current_device() -> Device:
    return _device if _device is not None else init_device()


def device_arch() -> str:
    """The current device's architecture, e.g. "sm_90"."""
    return current_device().arch


def _attribute(attr: driver.CUdevice_attribute, handle: driver.CUdevice) -> int:
    return call(driver.cuDeviceGetAttribute, attr, handle)


def memory_info() -> tuple[int, int]:
    """(free, total) bytes on the current device."""
    ensure_context()
    return call(driver.cuMemGetInfo)


# Freeing pinned host memory (cuMemFreeHost) synchronises the device, which invalidates a
# stream capture in progress (seen on the H200; cuStreamDestroy did not), and the garbage
# collector may drop an object's last reference at any allocation, a capture's included. So
# while a capture runs (`releases_held`), releases wait for it to end: pinned buffers', and
# streams' and events' too, which costs nothing.
_captures_in_progress = 0
_held_releases: list[Callable[[], object]] = []


def release(fn: Callable, *args) -> None:
    """Call fn(*args), a resource's release, now or once no capture is in progress."""
    if _captures_in_progress:
        _held_releases.append(lambda: fn(*args))
    else:
        fn(*args)


@contextlib.contextmanager
def releases_held() -> Iterator[None]:
    """Hold every `release` until the block (a capture) has ended."""
    global _captures_in_progress
    _captures_in_progress += 1
    try:
        yield
    finally:
        _captures_in_progress -= 1
        if not _captures_in_progress:
            held, _held_releases[:] = _held_releases[:], []
            for fn in held:
                fn()


class Stream:
    """A non-blocking stream: it never synchronises with the legacy default stream."""

    def __init__(self):
        ensure_context()
        self.handle = call(driver.cuStreamCreate, driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value)

    def synchronize(self) -> None:
        call(driver.cuStreamSynchronize, self.handle)

    def wait_event(self, event: "Event") -> None:
        """Later work on this stream waits for `event` (no host blocking)."""
        call(driver.cuStreamWaitEvent, self.handle, event.handle, 0)

    def is_capturing(self) -> bool:
        status = call(driver.cuStreamIsCapturing, self.handle)
        return status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def __int__(self) -> int:
        return int(self.handle)

    def __del__(self):
        handle = getattr(self, "handle", None)
        if handle is not None:
            release(driver.cuStreamDestroy, handle)


class Event:
    """A CUDA event. Timing is off unless asked for, which makes record/wait cheaper."""

    def __init__(self, timing: bool = False):
        ensure_context()
        flags = 0 if timing else driver.CUevent_flags.CU_EVENT_DISABLE_TIMING.value
        self.handle = call(driver.cuEventCreate, flags)

    def record(self, stream: Stream) -> None:
        call(driver.cuEventRecord, self.handle, stream.handle)

    def synchronize(self) -> None:
        call(driver.cuEventSynchronize, self.handle)

    def query(self) -> bool:
        """True when the work recorded before this event has finished."""
        status, = driver.cuEventQuery(self.handle)
        if status == driver.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((status,), "cuEventQuery")
        return True

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to `end` (both need timing=True)."""
        return call(driver.cuEventElapsedTime, self.handle, end.handle)

    async def wait(self) -> None:
        """Await completion without blocking the event loop.

        cuEventSynchronize releases the GIL, so a worker thread can block on it."""
        await asyncio.get_running_loop().run_in_executor(None, self._synchronize_in_thread)

    def _synchronize_in_thread(self) -> None:
        ensure_context()
        self.synchronize()

    def __del__(self):
        handle = getattr(self, "handle", None)
        if handle is not None:
            release(driver.cuEventDestroy, handle)


@cache
def cuda_driver_available() -> bool:
    """True when the driver library loads and reports at least one device."""
    try:
        if driver.cuInit(0)[0] != driver.CUresult.CUDA_SUCCESS:
            return False
        status, count = driver.cuDeviceGetCount()
    except RuntimeError:  # cuda-pathfinder raises when libcuda.so is absent
        return False
    return status == driver.CUresult.CUDA_SUCCESS and count > 0
