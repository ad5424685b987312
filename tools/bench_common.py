"""Helpers shared by the kernel benchmarks in tools/: a device, stream and
allocator with constant-filled and uploaded tensors (`DeviceBench`),
graph-replayed timing of a launch sequence, the device-to-device copy rate
that the bandwidth-bound results are divided by, the options every kernel bench
takes, and the verdict beside a target.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda.bindings import driver  # noqa: E402

import numpy as np  # noqa: E402

from sparkd.backend.cuda.driver import Event, Stream, call, init_device  # noqa: E402
from sparkd.backend.cuda.graphs import capture  # noqa: E402
from sparkd.backend.cuda.memory import DeviceAllocator  # noqa: E402
from sparkd.backend.cuda.tensor import DeviceTensor  # noqa: E402
from sparkd.backend.cuda.transfer import copy_to_device  # noqa: E402
from sparkd.backend.dtypes import DType, encode  # noqa: E402

_ONE_BITS = {DType.bfloat16: 0x3F80, DType.float16: 0x3C00}


class DeviceBench:
    """The device, one stream and an allocator for a benchmark in `dtype`, timed over `iters`."""

    def __init__(self, dtype: DType, iters: int):
        self.device = init_device()
        self.dtype = dtype
        self.iters = iters
        self.stream = Stream()
        self.allocator = DeviceAllocator()

    def header(self, copy_rate: float, detail: str = "") -> str:
        """The markdown comment line naming the device (and `detail`) and the copy rate measured."""
        return (f"# {self.device.name} ({self.device.arch}){detail}; device-to-device copy "
                f"{copy_rate / 1e12:.2f} TB/s (read + written)")

    def ones(self, shape, dtype: DType | None = None) -> DeviceTensor:
        """A tensor of 1.0 in `dtype` (default: the bench's); the values do not change the timing."""
        dtype = dtype or self.dtype
        out = self.allocator.empty(shape, dtype)
        if dtype is DType.float32:
            call(driver.cuMemsetD32Async, out.ptr, 0x3F800000, out.numel, self.stream.handle)
        else:
            call(driver.cuMemsetD16Async, out.ptr, _ONE_BITS[dtype], out.numel, self.stream.handle)
        return out

    def upload(self, array: np.ndarray, dtype: DType) -> DeviceTensor:
        out = self.allocator.empty(array.shape, dtype)
        copy_to_device(out, encode(array, dtype), self.stream)
        self.stream.synchronize()  # the host array is pageable and local
        return out


PATTERN_ELEMS = 1 << 23  # 16 MiB of bf16 noise per fan-in, tiled over the weights


class RandomDeviceWeights:
    """Random weights made on the device: matrices ~ N(0, 1/fan_in), one noise pattern per
    fan-in uploaded once and tiled over each matrix by device copies (gigabytes in well under
    a second, with no host copy of the model), and constant vectors."""

    def __init__(self, allocator: DeviceAllocator, stream: Stream, dtype: DType, seed: int = 0):
        self.allocator, self.stream, self.dtype = allocator, stream, dtype
        self.rng = np.random.default_rng(seed)
        self.patterns: dict[int, DeviceTensor] = {}

    def matrix(self, shape: tuple[int, ...], fan_in: int) -> DeviceTensor:
        if fan_in not in self.patterns:
            noise = self.rng.standard_normal(PATTERN_ELEMS, dtype=np.float32) / math.sqrt(fan_in)
            self.patterns[fan_in] = self.upload(noise)
        out = self.allocator.empty(shape, self.dtype)
        pattern = self.patterns[fan_in]
        for offset in range(0, out.nbytes, pattern.nbytes):
            call(driver.cuMemcpyDtoDAsync, out.ptr + offset, pattern.ptr, min(pattern.nbytes, out.nbytes - offset),
                 self.stream.handle)
        return out

    def filled(self, size: int, value: float, dtype: DType | None = None) -> DeviceTensor:
        return self.upload(np.full(size, value, np.float32), dtype)

    def upload(self, array: np.ndarray, dtype: DType | None = None) -> DeviceTensor:
        out = self.allocator.empty(array.shape, dtype or self.dtype)
        copy_to_device(out, encode(array, dtype or self.dtype), self.stream)
        self.stream.synchronize()  # the host array is pageable and local
        return out


def timed_graph(stream: Stream, work, iters: int) -> float:
    """Seconds per call of `work`, from a graph of `iters` calls replayed after a warm-up replay."""
    work()
    graph, _ = capture(stream, lambda: [work() for _ in range(iters)])
    try:
        graph.replay(stream)
        start, end = Event(timing=True), Event(timing=True)
        start.record(stream)
        graph.replay(stream)
        end.record(stream)
        end.synchronize()
        return start.elapsed_ms(end) / 1e3 / iters
    finally:
        graph.destroy()


def copy_bandwidth(allocator: DeviceAllocator, stream: Stream, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus written.

    The best of `reps` copies of `nbytes`, each timed alone by events, both issued
    eagerly and replayed as a graph's memcpy node: the driver may serve the two from
    different engines (the first H200 run measured only 2.77 TB/s from a graph of
    copies, against 4.29 TB/s in GPU-FACTS.md), and the ceiling is the faster."""
    rates = {mode: 2 * nbytes / seconds for mode, seconds in copy_seconds(allocator, stream, nbytes, reps).items()}
    stream.synchronize()
    allocator.release_cached()  # the copy buffers are free again
    print(f"# device-to-device copy of {nbytes / 2**30:.0f} GiB, best of {reps}: "
          + ", ".join(f"{mode} {rate / 1e12:.2f} TB/s" for mode, rate in rates.items()))
    return max(rates.values())


def copy_seconds(allocator: DeviceAllocator, stream: Stream, nbytes: int, reps: int) -> dict[str, float]:
    """{"eager": s, "graph": s}: the fastest of `reps` timed copies of each kind."""
    src = allocator.empty((nbytes,), DType.uint8)
    dst = allocator.empty((nbytes,), DType.uint8)
    call(driver.cuMemsetD8Async, src.ptr, 1, nbytes, stream.handle)

    def copy() -> None:
        call(driver.cuMemcpyDtoDAsync, dst.ptr, src.ptr, nbytes, stream.handle)

    graph, _ = capture(stream, copy)
    try:
        return {"eager": best_seconds(stream, copy, reps),
                "graph": best_seconds(stream, lambda: graph.replay(stream), reps)}
    finally:
        graph.destroy()


def best_seconds(stream: Stream, work, reps: int, warmup_seconds: float = 0.0) -> float:
    """The fastest of `reps` runs of `work`, each between two events, after warm-up runs: one, or
    as many as `warmup_seconds` of them take."""
    began = time.perf_counter()
    work()
    while time.perf_counter() - began < warmup_seconds:
        stream.synchronize()
        work()
    start, end = Event(timing=True), Event(timing=True)
    best = math.inf
    for _ in range(reps):
        start.record(stream)
        work()
        end.record(stream)
        end.synchronize()
        best = min(best, start.elapsed_ms(end) / 1e3)
    return best


def bench_parser(description: str, iters: int, dtypes: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """A kernel bench's options: --iters (calls a timed graph replays, default `iters`), and
    --dtype among `dtypes` (the first by default) when any are given."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if dtypes:
        parser.add_argument("--dtype", default=dtypes[0], choices=list(dtypes))
    parser.add_argument("--iters", type=int, default=iters, help="calls per timed graph (default %(default)s)")
    return parser


def verdict(value: float, target: float | None) -> str:
    """"meets >= 0.85" or "MISSES >= 0.85"; nothing for a row the issue sets no target for."""
    if target is None:
        return ""
    return f"{'meets' if value >= target else 'MISSES'} >= {target:g}"
