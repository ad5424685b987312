"""cuBLASLt at Llama-3.1-8B decode shapes, as fractions of the copy bandwidth measured in the same run.

  python tools/bench_gemm.py [--dtype bfloat16] [--m 1 16 64 256] [--iters 50]

A GEMM at small M is bound by reading the weight, so bytes moved / time, divided
by the device-to-device copy rate (bytes read plus written), says how much of the
memory system it uses: 1.0 is the ceiling a skinny-GEMM kernel could reach.
Each shape cycles through enough weight copies to exceed twice the L2, and the
timed launches are replayed from one CUDA graph, so neither the cache nor Python
launch overhead inflates the figures.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda.bindings import driver  # noqa: E402

from sparkd.backend.cuda.driver import Event, Stream, call, init_device  # noqa: E402
from sparkd.backend.cuda.gemm import Gemm  # noqa: E402
from sparkd.backend.cuda.graphs import capture  # noqa: E402
from sparkd.backend.cuda.memory import DeviceAllocator  # noqa: E402
from sparkd.backend.dtypes import DType  # noqa: E402

# Llama-3.1-8B: hidden 4096, 32 query / 8 kv heads of 128, intermediate 14336, vocab 128256. (N, K)
SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
_BF16_ONE_BITS = 0x3F80  # weights hold 1.0: the values do not change the timing


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


def best_seconds(stream: Stream, work, reps: int) -> float:
    """The fastest of `reps` runs of `work` (after one warm-up), each between two events."""
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


def gemm_rate(gemm: Gemm, allocator: DeviceAllocator, stream: Stream, dtype: DType, size: int = 8192,
              reps: int = 10) -> float:
    """FLOP/s of a square size^3 GEMM, the best of `reps`: the compute ceiling."""
    seconds = square_gemm_seconds(gemm, allocator, stream, dtype, size, reps)
    stream.synchronize()
    allocator.release_cached()  # the operands are free again
    return 2 * size**3 / seconds


def square_gemm_seconds(gemm: Gemm, allocator: DeviceAllocator, stream: Stream, dtype: DType, size: int,
                        reps: int) -> float:
    x, w, out = (allocator.empty((size, size), dtype) for _ in range(3))
    for tensor in (x, w):
        call(driver.cuMemsetD16Async, tensor.ptr, _BF16_ONE_BITS, tensor.numel, stream.handle)
    return best_seconds(stream, lambda: gemm(out, x, w), reps)


def bench_shape(gemm: Gemm, allocator: DeviceAllocator, stream: Stream, dtype: DType, n: int, k: int, m: int,
                iters: int, l2_bytes: int) -> tuple[float, float]:
    """(bytes/s, FLOP/s) of out [m, n] = x [m, k] @ W[n, k]^T."""
    weight_bytes = n * k * dtype.itemsize
    copies = max(1, math.ceil(2 * l2_bytes / weight_bytes))
    weights = [allocator.empty((n, k), dtype) for _ in range(copies)]
    for w in weights:
        call(driver.cuMemsetD16Async, w.ptr, _BF16_ONE_BITS, w.numel, stream.handle)
    x = allocator.empty((m, k), dtype)
    call(driver.cuMemsetD16Async, x.ptr, _BF16_ONE_BITS, x.numel, stream.handle)
    out = allocator.empty((m, n), dtype)
    rotation = itertools.cycle(weights)
    seconds = timed_graph(stream, lambda: gemm(out, x, next(rotation)), iters)
    moved = weight_bytes + (m * k + m * n) * dtype.itemsize
    return moved / seconds, 2 * m * n * k / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)

    device = init_device()
    dtype = DType.parse(args.dtype)
    stream = Stream()
    allocator = DeviceAllocator()
    gemm = Gemm(allocator, stream)
    l2_bytes = call(driver.cuDeviceGetAttribute, driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
                    device.handle)
    print(f"# {device.name} ({device.arch}), {args.dtype}, L2 {l2_bytes / 2**20:.0f} MiB")
    copy_rate = copy_bandwidth(allocator, stream)
    print(f"# {args.dtype} GEMM 8192^3: {gemm_rate(gemm, allocator, stream, dtype) / 1e12:.0f} TFLOP/s")
    print(f"# cells: fraction of the {copy_rate / 1e12:.2f} TB/s copy rate (read + written) [TFLOP/s]")
    print("| M | " + " | ".join(f"{name} {n}x{k}" for name, (n, k) in SHAPES.items()) + " |")
    print("| --- " * (len(SHAPES) + 1) + "|")
    for m in args.m:
        cells = []
        for n, k in SHAPES.values():
            rate, flops = bench_shape(gemm, allocator, stream, dtype, n, k, m, args.iters, l2_bytes)
            cells.append(f"{rate / copy_rate:.2f} [{flops / 1e12:.1f}]")
            stream.synchronize()
            allocator.release_cached()  # the next shape's weight copies need the room
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
