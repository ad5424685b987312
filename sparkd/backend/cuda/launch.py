"""Kernel launches: argument packing and cuLaunchKernel / cuLaunchKernelEx.

Each argument is a DeviceTensor (passed as its pointer) or a numpy scalar whose
type fixes the C type. A Python int or float is refused: its C width would be a
guess, and a wrong guess shifts every later argument.

`launch(..., programmatic=True)` asks for programmatic stream serialization
(programmatic dependent launch, sm_90 and newer): the kernel's blocks may start
once every block of the kernel before it has run `allow_next_grid` (common.cuh),
so while that kernel still runs. Such a kernel must run `wait_for_previous_grid`
before it reads anything an earlier kernel wrote and before it writes anything;
before that it may only read memory no kernel of the stream writes (weights). Its
completion then still implies that of every kernel before it, so kernels launched
the ordinary way after it need nothing. Below sm_90 the flag is ignored.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from cuda.bindings import driver

from .driver import Stream, call, check, ensure_context
from .tensor import DeviceTensor

SCALAR_TYPES = (np.int32, np.uint32, np.int64, np.uint64, np.float32)
_DEFAULT_DYNAMIC_SHARED = 48 * 1024  # more than this needs the function attribute raised


def pack_args(args: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """(slots, pointers): one 8-byte slot per argument holding its value, and the
    array of slot addresses cuLaunchKernel reads. Keep both alive until the launch returns."""
    slots = np.zeros(len(args), dtype=np.uint64)
    for i, arg in enumerate(args):
        if isinstance(arg, DeviceTensor):
            slots[i] = arg.ptr
        elif isinstance(arg, SCALAR_TYPES):
            # Little-endian: a narrower value sits at the start of its slot.
            slots[i : i + 1].view(arg.dtype)[0] = arg
        else:
            raise TypeError(f"kernel argument {i} is a {type(arg).__name__}: pass a DeviceTensor or a numpy "
                            f"scalar of one of {[t.__name__ for t in SCALAR_TYPES]} to fix its C type")
    pointers = slots.ctypes.data + 8 * np.arange(len(args), dtype=np.uint64)
    return slots, pointers


def dim3(value) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(int(d) < 1 for d in dims):
        raise ValueError(f"grid/block dims must be 1 to 3 positive ints, got {value!r}")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


def _programmatic_config() -> driver.CUlaunchConfig | None:
    """A launch config with programmatic stream serialization allowed, or None where the
    current device predates it (compute capability below 9.0)."""
    device = call(driver.cuCtxGetDevice)
    major = call(driver.cuDeviceGetAttribute,
                 driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
    if major < 9:
        return None
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.attrs = [attribute]
    config.numAttrs = 1
    return config


class Kernel:
    """A loaded kernel function; `launch` enqueues it on a stream."""

    def __init__(self, name: str, function: driver.CUfunction):
        self.name = name
        self.function = function
        self._programmatic: driver.CUlaunchConfig | None | bool = False  # False: not looked up yet
        # Without the opt-in attribute a block may have 48 KB of shared memory in all,
        # static included: a kernel with static shared memory opts in below 48 KB of dynamic.
        static = call(driver.cuFuncGetAttribute, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                      function)
        self._dynamic_shared_limit = max(0, _DEFAULT_DYNAMIC_SHARED - static)

    def launch(self, grid, block, args: Sequence, shared_mem: int = 0, stream: Stream | None = None,
               programmatic: bool = False) -> None:
        """stream None is the legacy default stream; the engine always passes its own.
        programmatic: a programmatic dependent launch (the module docstring says what the
        kernel must then do)."""
        ensure_context()
        self.allow_dynamic_shared(shared_mem)
        slots, pointers = pack_args(args)  # the driver copies the values during the call
        handle = stream.handle if stream is not None else driver.CUstream(0)
        params = pointers.ctypes.data if len(slots) else 0
        config = self._programmatic_config() if programmatic else None
        if config is None:
            check(driver.cuLaunchKernel(self.function, *dim3(grid), *dim3(block), shared_mem, handle, params, 0),
                  f"launch of {self.name}")
            return
        config.gridDimX, config.gridDimY, config.gridDimZ = dim3(grid)
        config.blockDimX, config.blockDimY, config.blockDimZ = dim3(block)
        config.sharedMemBytes = shared_mem
        config.hStream = handle
        check(driver.cuLaunchKernelEx(config, self.function, params, 0), f"programmatic launch of {self.name}")

    def _programmatic_config(self) -> driver.CUlaunchConfig | None:
        if self._programmatic is False:
            self._programmatic = _programmatic_config()
        return self._programmatic

    def allow_dynamic_shared(self, nbytes: int) -> None:
        """Opt the function in to `nbytes` of dynamic shared memory where that needs it: before
        a launch, and before an occupancy query (which counts 0 blocks for a size not opted in)."""
        if nbytes > self._dynamic_shared_limit:
            call(driver.cuFuncSetAttribute, self.function,
                 driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
            self._dynamic_shared_limit = nbytes

    def __repr__(self) -> str:
        return f"Kernel({self.name})"
