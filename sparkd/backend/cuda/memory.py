"""Device memory: a caching allocator with separate pools, and the KV-cache memory plan.

Work runs in one stream's order, so a block freed by Python (its last DeviceTensor view
collected) can be handed to the next allocation at once: stream order guarantees
the old reader ran before the new writer. Work on a second stream beside it (`side_stream.py`)
holds every block freed between its fork and its join out of the free lists
(`MemoryPool.holding_frees`). cuMemFree is only called when memory runs out, never while a graph
is being captured (it synchronises the device).

CUDA graphs allocate from their own pool (`DeviceAllocator.use_pool`): a captured
graph keeps writing its scratch blocks on every replay, so they must never be
handed to eager allocations that outlive a step.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cuda.bindings import driver

from .driver import CudaError, call, ensure_context
from .tensor import DeviceTensor, as_dtype

log = logging.getLogger("sparkd.cuda.memory")

GiB = 1 << 30
_MIN_BLOCK = 512
_SMALL_LIMIT = 64 << 20  # below this, quarter-power-of-two size classes let activations of varying T share blocks
_LARGE_GRANULE = 2 << 20  # weights and KV caches: little waste, they are never freed


def round_size(nbytes: int) -> int:
    """The size class of an allocation: 512-byte multiples, at most 25% waste below 64 MiB
    (past 2 KiB), 2 MiB granules above."""
    if nbytes <= _MIN_BLOCK:
        return _MIN_BLOCK
    if nbytes >= _SMALL_LIMIT:
        return -(-nbytes // _LARGE_GRANULE) * _LARGE_GRANULE
    step = max(_MIN_BLOCK, 1 << ((nbytes - 1).bit_length() - 3))
    return -(-nbytes // step) * step


class MemoryPool:
    """Free device blocks by size class. `reserved_bytes` counts everything cuMemAlloc gave it."""

    def __init__(self, name: str):
        self.name = name
        self.reserved_bytes = 0
        self.in_use_bytes = 0
        self._free: dict[int, list[int]] = defaultdict(list)
        self._holds = 0
        self._held: list[tuple[int, int]] = []  # (ptr, size) given back while a hold is on
        self._lock = threading.Lock()

    def take(self, size: int) -> int | None:
        with self._lock:
            blocks = self._free.get(size)
            if not blocks:
                return None
            self.in_use_bytes += size
            return blocks.pop()

    def add_new(self, size: int) -> None:
        with self._lock:
            self.reserved_bytes += size
            self.in_use_bytes += size

    def give_back(self, ptr: int, size: int) -> None:
        with self._lock:
            self.in_use_bytes -= size
            if self._holds:
                self._held.append((ptr, size))
            else:
                self._free[size].append(ptr)

    @contextmanager
    def holding_frees(self) -> Iterator[None]:
        """Blocks given back inside the with-block reach the free lists only when it exits (and every
        hold around it has): until then work on another stream may still use them (a side branch,
        whose join ends the hold). Neither taken nor drained meanwhile."""
        with self._lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                if not self._holds:
                    for ptr, size in self._held:
                        self._free[size].append(ptr)
                    self._held.clear()

    def drain(self) -> list[tuple[int, int]]:
        """Remove and return every free (ptr, size); the caller frees them."""
        with self._lock:
            blocks = [(ptr, size) for size, ptrs in self._free.items() for ptr in ptrs]
            self._free.clear()
            self.reserved_bytes -= sum(size for _, size in blocks)
            return blocks


class _Block:
    """The owner of one allocation; returns it to its pool when the last view dies."""

    __slots__ = ("ptr", "size", "pool")

    def __init__(self, ptr: int, size: int, pool: MemoryPool):
        self.ptr, self.size, self.pool = ptr, size, pool

    def __del__(self):
        self.pool.give_back(self.ptr, self.size)


class DeviceAllocator:
    """`empty(shape, dtype) -> DeviceTensor`, cached, from the active pool."""

    def __init__(self):
        self.default_pool = MemoryPool("default")
        self._active = threading.local()

    @property
    def pool(self) -> MemoryPool:
        return getattr(self._active, "pool", self.default_pool)

    @contextmanager
    def use_pool(self, pool: MemoryPool):
        """Allocate from `pool` in this thread until the block exits (graph capture)."""
        previous = self.pool
        self._active.pool = pool
        try:
            yield pool
        finally:
            self._active.pool = previous

    def empty(self, shape, dtype) -> DeviceTensor:
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"shape must not be negative, got {shape}")
        dtype = as_dtype(dtype)
        nbytes = max(math.prod(shape) * dtype.itemsize, 1)
        block = self._allocate(round_size(nbytes))
        return DeviceTensor(block.ptr, shape, dtype, None, block)

    def _allocate(self, size: int) -> _Block:
        pool = self.pool
        ptr = pool.take(size)
        if ptr is None:
            ptr = self._cu_mem_alloc(size, pool)
            pool.add_new(size)
        return _Block(ptr, size, pool)

    def _cu_mem_alloc(self, size: int, pool: MemoryPool) -> int:
        ensure_context()
        try:
            return _mem_alloc_relaxed(size)
        except CudaError as err:
            # Freeing synchronises the device, which a graph capture (a non-default pool) forbids.
            if err.name != "CUDA_ERROR_OUT_OF_MEMORY" or pool is not self.default_pool or self.release_cached() == 0:
                raise
        log.info("device memory ran out; released cached blocks and retrying %.2f GiB", size / GiB)
        return _mem_alloc_relaxed(size)

    def release_cached(self, pool: MemoryPool | None = None) -> int:
        """cuMemFree a pool's free blocks (default pool unless given); returns the bytes released.

        Release a graph pool only once its graphs are destroyed: they replay into its blocks."""
        blocks = (pool or self.default_pool).drain()
        for ptr, _ in blocks:
            call(driver.cuMemFree, ptr)
        return sum(size for _, size in blocks)

    def stats(self) -> dict[str, int]:
        pool = self.default_pool
        return {"reserved_bytes": pool.reserved_bytes, "in_use_bytes": pool.in_use_bytes}


def _mem_alloc_relaxed(size: int) -> int:
    """cuMemAlloc, allowed even while this thread captures a graph.

    A capture in THREAD_LOCAL mode forbids "potentially unsafe" calls such as
    cuMemAlloc; here it is safe, because a graph's blocks stay in its pool for as
    long as the graph lives. So the thread's mode is relaxed around the one call."""
    relaxed = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    previous = call(driver.cuThreadExchangeStreamCaptureMode, relaxed)
    try:
        return int(call(driver.cuMemAlloc, size))
    finally:
        call(driver.cuThreadExchangeStreamCaptureMode, previous)


@dataclass(frozen=True)
class KVCachePlan:
    """How the KV block pool was sized from `--gpu-memory-utilization`."""

    num_blocks: int
    block_bytes: int
    budget_bytes: int  # utilization * total
    used_bytes: int  # by weights, the context and anything else, when planned
    reserve_bytes: int  # kept back for activations

    def describe(self) -> str:
        kv = self.num_blocks * self.block_bytes
        return (f"KV cache: {self.num_blocks} blocks of {self.block_bytes / 2**20:.2f} MiB = {kv / GiB:.2f} GiB "
                f"(budget {self.budget_bytes / GiB:.2f} GiB, in use {self.used_bytes / GiB:.2f} GiB, "
                f"activation reserve {self.reserve_bytes / GiB:.2f} GiB)")


def check_weights_fit(weight_bytes: int, free_bytes: int, total_bytes: int, gpu_memory_utilization: float) -> None:
    """ValueError, before anything is uploaded, when the weights alone exceed what the process
    may use (`gpu_memory_utilization * total` less what is in use already)."""
    room = int(gpu_memory_utilization * total_bytes) - (total_bytes - free_bytes)
    if weight_bytes > room:
        raise ValueError(
            f"the model's weights need {weight_bytes / GiB:.2f} GiB but only {max(room, 0) / GiB:.2f} GiB of this "
            f"GPU's {total_bytes / GiB:.2f} GiB are available at gpu_memory_utilization={gpu_memory_utilization} "
            f"({(total_bytes - free_bytes) / GiB:.2f} GiB already in use): use a GPU with more memory, a smaller "
            f"--dtype, or raise --gpu-memory-utilization")


def plan_kv_cache(free_bytes: int, total_bytes: int, gpu_memory_utilization: float,
                  block_bytes: int, reserve_bytes: int) -> KVCachePlan:
    """Size the KV block pool from what the weights (already loaded) left.

    The process may use `gpu_memory_utilization * total`; what is used now (weights,
    context, other processes) and `reserve_bytes` of activations come off first."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    budget = int(gpu_memory_utilization * total_bytes)
    used = total_bytes - free_bytes
    num_blocks = (budget - used - reserve_bytes) // block_bytes
    plan = KVCachePlan(int(num_blocks), block_bytes, budget, used, reserve_bytes)
    if num_blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} leaves no room for the KV cache: "
            f"{plan.describe()}; raise --gpu-memory-utilization or lower --max-num-batched-tokens")
    return plan
