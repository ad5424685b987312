"""Kernel launches: argument packing and cuLaunchKernel.

Each argument is a DeviceTensor (passed as its pointer), a numpy scalar whose
type fixes the C type, or a TensorMap (its 128 bytes, for a __grid_constant__
parameter). A Python int or float is refused: its C width would be a guess, and a
wrong guess shifts every later argument.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from cuda.bindings import driver

from .driver import Stream, call, check, ensure_context
from .tensor import DeviceTensor
from .tensor_map import TensorMap

SCALAR_TYPES = (np.int32, np.uint32, np.int64, np.uint64, np.float32)
_DEFAULT_DYNAMIC_SHARED = 48 * 1024  # more than this needs the function attribute raised


def pack_args(args: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """(slots, pointers): one 8-byte slot per argument holding its value, and the
    array of the addresses cuLaunchKernel reads each argument from (a slot's, or a
    TensorMap's own words). Keep both, and the args, alive until the launch returns."""
    slots = np.zeros(len(args), dtype=np.uint64)
    pointers = slots.ctypes.data + 8 * np.arange(len(args), dtype=np.uint64)
    for i, arg in enumerate(args):
        if isinstance(arg, TensorMap):
            pointers[i] = arg.words.ctypes.data
        elif isinstance(arg, DeviceTensor):
            slots[i] = arg.ptr
        elif isinstance(arg, SCALAR_TYPES):
            # Little-endian: a narrower value sits at the start of its slot.
            slots[i : i + 1].view(arg.dtype)[0] = arg
        else:
            raise TypeError(f"kernel argument {i} is a {type(arg).__name__}: pass a DeviceTensor, a TensorMap or "
                            f"a numpy scalar of one of {[t.__name__ for t in SCALAR_TYPES]} to fix its C type")
    return slots, pointers


def dim3(value) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(int(d) < 1 for d in dims):
        raise ValueError(f"grid/block dims must be 1 to 3 positive ints, got {value!r}")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


def cluster_launch_config(grid, block, cluster, shared_mem: int, stream: driver.CUstream) -> driver.CUlaunchConfig:
    """cuLaunchKernelEx's configuration of a launch in thread-block clusters of dims `cluster`
    (a launch attribute); a ValueError where a cluster dim does not divide the grid's."""
    grid, block, cluster = dim3(grid), dim3(block), dim3(cluster)
    if any(g % c for g, c in zip(grid, cluster)):
        raise ValueError(f"cluster dims {cluster} must divide the grid's {grid}")
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z = cluster
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared_mem
    config.hStream = stream
    config.attrs = [attribute]
    config.numAttrs = 1
    return config


class Kernel:
    """A loaded kernel function; `launch` enqueues it on a stream."""

    def __init__(self, name: str, function: driver.CUfunction):
        self.name = name
        self.function = function
        # Without the opt-in attribute a block may have 48 KB of shared memory in all,
        # static included: a kernel with static shared memory opts in below 48 KB of dynamic.
        static = call(driver.cuFuncGetAttribute, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                      function)
        self._dynamic_shared_limit = max(0, _DEFAULT_DYNAMIC_SHARED - static)

    def launch(self, grid, block, args: Sequence, shared_mem: int = 0, stream: Stream | None = None,
               cluster=None) -> None:
        """stream None is the legacy default stream; the engine always passes its own. cluster:
        the dims of the thread-block clusters the grid is launched in (each dim dividing the
        grid's), for a kernel whose cluster size is set at launch rather than by __cluster_dims__;
        None launches plain blocks (or the kernel's own clusters)."""
        ensure_context()
        self.allow_dynamic_shared(shared_mem)
        slots, pointers = pack_args(args)  # the driver copies the values during the call
        handle = stream.handle if stream is not None else driver.CUstream(0)
        params = pointers.ctypes.data if len(slots) else 0
        if cluster is None:
            status = driver.cuLaunchKernel(self.function, *dim3(grid), *dim3(block), shared_mem, handle, params, 0)
        else:
            config = cluster_launch_config(grid, block, cluster, shared_mem, handle)
            status = driver.cuLaunchKernelEx(config, self.function, params, 0)
        check(status, f"launch of {self.name}")

    def allow_dynamic_shared(self, nbytes: int) -> None:
        """Opt the function in to `nbytes` of dynamic shared memory where that needs it: before
        a launch, and before an occupancy query (which counts 0 blocks for a size not opted in)."""
        if nbytes > self._dynamic_shared_limit:
            call(driver.cuFuncSetAttribute, self.function,
                 driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
            self._dynamic_shared_limit = nbytes

    def __repr__(self) -> str:
        return f"Kernel({self.name})"
