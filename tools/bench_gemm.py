"""cuBLASLt and the gemv kernel at decode shapes, as fractions of the copy bandwidth measured in
the same run, and the measured table from which the engine picks one of them, and cuBLASLt's
algorithm, per shape.

  python tools/bench_gemm.py [--dtype bfloat16] [--m 1 2 4 ... 256] [--candidates 16] [--iters 50]
                             [--model DIR] [--write-table [PATH]]

A GEMM at small M is bound by reading the weight, so bytes moved / time, divided
by the device-to-device copy rate (bytes read plus written), says how much of the
memory system it uses: 1.0 is the ceiling a skinny-GEMM kernel could reach.
Each shape cycles through enough weight copies to exceed twice the L2, and the
timed launches are replayed from one CUDA graph, so neither the cache nor Python
launch overhead inflates the figures. lm_head and the MoE router write fp32, as the engine
runs them; the router's K is twice the hidden size (its split rows [y | y_lo], CudaOps.router_weight).
cuBLASLt runs each of its heuristic's first --candidates algorithms: its first choice, and the
fastest (by more than NOISE) with its rank.

Shapes: Llama-3.1-8B's, Qwen3-30B-A3B's and Qwen3-Next-80B-A3B's dense ones, plus those of the
checkpoint at --model (its config.json).
The "picks" column is what the engine's `Gemm` runs for that shape and M, timed. With
--write-table it comes from the table this run measures, written to PATH (by
default this device's file in the sparkd cache, where the engine reads it; see
sparkd/backend/cuda/gemm_table.py): for every shape and M tile (gemm_table.M_TILES)
measured, the fastest cuBLASLt algorithm and its fraction, and gemv's up to M 16. Entries
of shapes this run did not measure are kept.
Without it, the column shows the table the engine would load now.
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda.bindings import driver  # noqa: E402
from nvmath.bindings import cublasLt  # noqa: E402

from bench_common import bench_parser, best_seconds, copy_bandwidth, timed_graph  # noqa: E402
from sparkd.backend.cuda.driver import Stream, call, init_device  # noqa: E402
from sparkd.backend.cuda.gemm import Gemm  # noqa: E402
from sparkd.backend.cuda.gemm_table import (  # noqa: E402
    GEMV,
    M_TILES,
    GemmTable,
    Measurement,
    ShapeKey,
    cache_table_path,
    read_table,
)
from sparkd.backend.cuda.kernels import gemv  # noqa: E402
from sparkd.backend.cuda.memory import DeviceAllocator  # noqa: E402
from sparkd.backend.cuda.tensor import DeviceTensor  # noqa: E402
from sparkd.backend.dtypes import DType  # noqa: E402
from sparkd.models.config import ModelConfig, read_hf_configs  # noqa: E402

# Llama-3.1-8B: hidden 4096, 32 query / 8 kv heads of 128, intermediate 14336, vocab 128256. (N, K)
SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
# Qwen3-30B-A3B's dense GEMMs (tools/bench_moe.py's shape): hidden 2048, 32 query / 4 kv heads
# of 128, 128 experts, vocab 151936. The expert GEMMs are not cuBLASLt's (moe_gemm.cu).
MOE_SHAPES = {
    "moe qkv": (5120, 2048),
    "moe o": (2048, 4096),
    "moe router": (128, 2 * 2048),
    "moe lm_head": (151936, 2048),
}
# Qwen3-Next-80B-A3B's (tools/bench_hybrid.py's shape) that the two above lack: a delta net's
# in_proj ([q k v | z | b | a] rows), the gated attention's qkv (query and gate rows) and the
# shared expert's gate_up, down and gate. Its out_proj and o are "moe o"'s shape, its lm_head
# "moe lm_head"'s.
HYBRID_SHAPES = {
    "hybrid in_proj": (12352, 2048),
    "hybrid qkv": (9216, 2048),
    "hybrid shared gate_up": (1024, 2048),
    "hybrid shared down": (2048, 512),
    "hybrid shared gate": (1, 2048),
}
LLAMA_LAYERS = 32
LOGITS = "lm_head"
FP32_OUTPUTS = ("lm_head", "router")  # logits and router logits are written in fp32, as the engine runs them
NOISE = 0.02  # timings of one algorithm agree within about 1% from run to run
_BF16_ONE_BITS = 0x3F80  # weights hold 1.0: the values do not change the timing


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


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(N, K) of each GEMM of a dense decoder layer, and of lm_head."""
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"qkv": (q_width + 2 * kv_width, hidden), "o": (hidden, q_width), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), LOGITS: (config.vocab_size, hidden)}


@dataclass
class Cell:
    """One implementation at one shape and M."""

    seconds: float  # per call
    moved: int  # bytes read plus written
    flops: float

    def fraction(self, copy_rate: float) -> float:
        return self.moved / self.seconds / copy_rate

    def show(self, copy_rate: float) -> str:
        return f"{self.fraction(copy_rate):.2f} [{self.flops / self.seconds / 1e12:.1f}]"


class ShapeBench:
    """One weight shape: copies of the weight cycled past the L2, timed through either implementation."""

    def __init__(self, allocator: DeviceAllocator, stream: Stream, dtype: DType, out_dtype: DType, n: int, k: int,
                 l2_bytes: int, iters: int):
        self.allocator, self.stream, self.dtype, self.out_dtype, self.iters = allocator, stream, dtype, out_dtype, iters
        copies = max(1, math.ceil(2 * l2_bytes / (n * k * dtype.itemsize)))
        self.weights = [self.ones((n, k)) for _ in range(copies)]

    def ones(self, shape: tuple[int, int]) -> DeviceTensor:
        tensor = self.allocator.empty(shape, self.dtype)
        # Any finite values do: the timing does not depend on them (fp32 reads the pattern as ~1.002).
        call(driver.cuMemsetD16Async, tensor.ptr, _BF16_ONE_BITS, tensor.nbytes // 2, self.stream.handle)
        return tensor

    def operands(self, m: int) -> tuple[DeviceTensor, DeviceTensor]:
        """(x [m, K], out [m, N])."""
        n, k = self.weights[0].shape
        return self.ones((m, k)), self.allocator.empty((m, n), self.out_dtype)

    def measure(self, run, x: DeviceTensor, out: DeviceTensor) -> Cell:
        """`run(out, x, weight)`, cycling through the weight copies."""
        rotation = itertools.cycle(self.weights)
        seconds = timed_graph(self.stream, lambda: run(out, x, next(rotation)), self.iters)
        (m, n), k = out.shape, x.shape[1]
        return Cell(seconds, self.weights[0].nbytes + x.nbytes + out.nbytes, 2 * m * n * k)


def fastest_rank(tried: list[Cell]) -> int:
    """The rank of the fastest of cuBLASLt's candidates; 0, the heuristic's own choice, unless
    another beats it by more than NOISE (a closer win may be run-to-run noise)."""
    rank = min(range(len(tried)), key=lambda i: tried[i].seconds)
    return rank if tried[rank].seconds * (1 + NOISE) < tried[0].seconds else 0


def bench_shapes(model_dir: str | None) -> dict[str, tuple[int, int]]:
    shapes = {**SHAPES, **MOE_SHAPES, **HYBRID_SHAPES}
    if model_dir:
        for name, shape in linear_shapes(ModelConfig.from_hf(*read_hf_configs(model_dir))).items():
            if shape not in shapes.values():
                shapes[f"model {name}"] = shape
    return shapes


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, 50, ("bfloat16", "float16"))
    parser.add_argument("--m", type=int, nargs="+", default=list(M_TILES),
                        help="rows of x (default: the table's M tiles)")
    parser.add_argument("--candidates", type=int, default=16,
                        help="how many of cuBLASLt's heuristic's algorithms to time (default %(default)s)")
    parser.add_argument("--model", metavar="DIR", help="also the GEMM shapes of this checkpoint (its config.json)")
    parser.add_argument("--write-table", nargs="?", const="", metavar="PATH",
                        help="write the measured table (default: this device's file in the sparkd cache)")
    args = parser.parse_args(argv)
    if any(m < 1 for m in args.m) or args.candidates < 1:
        parser.error(f"--m values and --candidates must be >= 1, got {args.m} and {args.candidates}")

    device = init_device()
    dtype = DType.parse(args.dtype)
    stream = Stream()
    allocator = DeviceAllocator()
    gemm = Gemm(allocator, stream)
    table_path = None
    if args.write_table is not None:
        table_path = Path(args.write_table) if args.write_table else cache_table_path(device.name, device.arch)
        gemm.table = read_table(table_path) or GemmTable(device.name, device.arch)
        gemm.table.cublaslt_version = cublasLt.get_version()  # the picks below run the algorithms measured here
    l2_bytes = call(driver.cuDeviceGetAttribute, driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
                    device.handle)
    print(f"# {device.name} ({device.arch}), {args.dtype}, L2 {l2_bytes / 2**20:.0f} MiB")
    copy_rate = copy_bandwidth(allocator, stream)
    print(f"# {args.dtype} GEMM 8192^3: {gemm_rate(gemm, allocator, stream, dtype) / 1e12:.0f} TFLOP/s")
    print(f"# cells: fraction of the {copy_rate / 1e12:.2f} TB/s copy rate (read + written) [TFLOP/s]; "
          f"picks: what Gemm runs ({f'the table written to {table_path}' if table_path else 'the table in use'})")
    print(f"| shape | M | cuBLASLt, heuristic's first | cuBLASLt, fastest of its first {args.candidates} [rank] | gemv "
          "| picks |")
    print("| --- | --- | --- | --- | --- | --- |")
    llama_seconds = {}  # Llama shape -> (cuBLASLt, as picked) seconds per call at M = 1
    for name, (n, k) in bench_shapes(args.model).items():
        out_dtype = DType.float32 if name.endswith(FP32_OUTPUTS) else dtype
        bench = ShapeBench(allocator, stream, dtype, out_dtype, n, k, l2_bytes, args.iters)
        for m in args.m:
            x, out = bench.operands(m)
            weight = bench.weights[0]
            candidates = gemm.candidates(out, x, weight, args.candidates)
            tried = [bench.measure(lambda out, x, w, algo=algo: gemm.cublaslt(out, x, w, algo=algo), x, out)
                     for algo in candidates]
            rank = fastest_rank(tried)
            fast = None
            if gemv.unsupported_reason(x, weight) is None:
                fast = bench.measure(lambda out, x, w: gemv.gemv(out, x, w, None, stream), x, out)
            if table_path and m in M_TILES:
                gemm.table.entries[ShapeKey(n, k, dtype.name, m)] = Measurement(
                    float(f"{tried[rank].fraction(copy_rate):.4g}"),
                    float(f"{fast.fraction(copy_rate):.4g}") if fast else 0.0, candidates[rank].hex() if rank else "")
            picked = fast if gemm.picks_gemv(x, weight) else bench.measure(gemm.cublaslt, x, out)
            print(f"| {name} {n}x{k} | {m} | {tried[0].show(copy_rate)} | {tried[rank].show(copy_rate)} [{rank}] | "
                  f"{fast.show(copy_rate) if fast else '-'} | {'gemv' if picked is fast else 'cuBLASLt'} "
                  f"{picked.show(copy_rate)} |", flush=True)
            if m == 1 and name in SHAPES:
                llama_seconds[name] = (tried[0].seconds, picked.seconds)
        stream.synchronize()
        allocator.release_cached()  # the next shape's weight copies need the room
    if len(llama_seconds) == len(SHAPES):
        print_llama_token(llama_seconds, dtype, copy_rate)
    if table_path:
        write_table(gemm.table, table_path, copy_rate, argv)
    return 0


def print_llama_token(seconds: dict[str, tuple[float, float]], dtype: DType, copy_rate: float) -> None:
    """The GEMMs of one Llama-3.1-8B decode token at M = 1: cuBLASLt alone, as picked, and the copy-rate floor."""
    calls = {name: 1 if name == LOGITS else LLAMA_LAYERS for name in SHAPES}
    cublaslt, picked = (sum(calls[name] * seconds[name][i] for name in SHAPES) for i in (0, 1))
    floor = sum(calls[name] * n * k * dtype.itemsize for name, (n, k) in SHAPES.items()) / copy_rate
    print(f"# Llama-3.1-8B GEMMs of one decode token at M=1: cuBLASLt {cublaslt * 1e3:.2f} ms, as picked "
          f"{picked * 1e3:.2f} ms; weights at the copy rate {floor * 1e3:.2f} ms "
          f"({floor / cublaslt:.2f} -> {floor / picked:.2f} of that floor)")


def write_table(table: GemmTable, path: Path, copy_rate: float, argv: list[str] | None) -> None:
    table.command = " ".join(["python", "tools/bench_gemm.py", *(sys.argv[1:] if argv is None else argv)])
    table.measured_at = datetime.now(UTC).isoformat(timespec="seconds")
    table.copy_rate = copy_rate
    table.save(path)
    wins = sum(entry.winner == GEMV for entry in table.entries.values())
    print(f"# wrote {path}: gemv wins {wins} of {len(table.entries)} (shape, dtype, M tile) entries")


if __name__ == "__main__":
    sys.exit(main())
