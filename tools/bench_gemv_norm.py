"""A decode-batch-1 layer's GEMV chain with its two pre-norms as their own kernels, against the
norms inside the GEMVs (gemv_norm.cu), at Llama-3.1-8B's and Qwen3-30B-A3B's shapes.

  python tools/bench_gemv_norm.py [--iters 5] [--layers 8] [--groups 1 2 4 8 16]

Llama: add_rmsnorm, qkv, o, add_rmsnorm, gate_up + SiLU, down, each layer with its own weights
(L layers in one graph, so the weights stream from DRAM as in the model); attention is left out.
Qwen3-MoE: add_rmsnorm, qkv, o (its experts keep their own norm, the router's). Fused: the same
chain with each norm inside the GEMV after it, for every groups-per-block choice of --groups
(the weight row groups a block runs after its one norm: qkv's / gate_up's). Times are per layer,
from replays of the captured graph; the ratio is unfused over fused, so above 1 the fused chain
is faster. The floor is the layer's weight bytes at the copy rate measured in the same run.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import DeviceBench, RandomDeviceWeights, bench_parser, copy_bandwidth, timed_graph  # noqa: E402
from sparkd.backend.cuda.kernels import gemv, gemv_norm, norm  # noqa: E402
from sparkd.backend.dtypes import DType  # noqa: E402

EPS = 1e-5
# name: (hidden, qkv rows, o's K, intermediate or None for a MoE layer's attention only)
SHAPES = {"Llama-3.1-8B": (4096, 6144, 4096, 14336), "Qwen3-30B-A3B attention": (2048, 5120, 4096, None)}


def layer_weights(make: RandomDeviceWeights, hidden: int, qkv_rows: int, o_k: int, inter: int | None) -> dict:
    weights = {"qkv": make.matrix((qkv_rows, hidden), hidden), "o": make.matrix((hidden, o_k), o_k),
               "ln1": make.upload(0.1 * make.rng.standard_normal(hidden)),
               "ln2": make.upload(0.1 * make.rng.standard_normal(hidden))}
    if inter is not None:
        weights |= {"gate_up": make.matrix((2 * inter, hidden), hidden), "down": make.matrix((hidden, inter), inter)}
    return weights


def vector(make: RandomDeviceWeights, shape, dtype: DType | None = None):
    return make.upload(make.rng.standard_normal(shape).astype(np.float32), dtype)


def bench_shape(b: DeviceBench, make: RandomDeviceWeights, name: str, shape: tuple, num_layers: int, groups: list[int],
                copy_rate: float) -> None:
    """Print the rows of one SHAPES entry: the chain with its norms apart, then fused per groups choice."""
    hidden, qkv_rows, o_k, inter = shape
    layers = [layer_weights(make, hidden, qkv_rows, o_k, inter) for _ in range(num_layers)]
    floor = sum(t.nbytes for t in layers[0].values()) / copy_rate * 1e6
    x = vector(make, (1, hidden))
    residuals = [vector(make, (1, hidden), DType.float32) for _ in range(2)]
    y = b.allocator.empty((1, hidden), b.dtype)
    qkv = b.allocator.empty((1, qkv_rows), b.dtype)
    attn = vector(make, (1, o_k))  # stands in for attention's output
    o_out = b.allocator.empty((1, hidden), b.dtype)
    act = b.allocator.empty((1, inter or 1), b.dtype)

    def unfused() -> None:
        for w in layers:
            norm.add_rmsnorm(y, residuals[0], residuals[0], x, w["ln1"], EPS, b.stream)
            gemv.gemv(qkv, y, w["qkv"], None, b.stream)
            gemv.gemv(o_out, attn, w["o"], None, b.stream)
            if inter is not None:
                norm.add_rmsnorm(y, residuals[0], residuals[0], o_out, w["ln2"], EPS, b.stream)
                gemv.gemv_silu_and_mul(act, y, w["gate_up"], None, b.stream)
                gemv.gemv(o_out, act, w["down"], None, b.stream)

    def fused(qkv_groups: int, gate_up_groups: int) -> None:
        for w in layers:
            gemv_norm.gemv_norm(qkv, residuals[1], x, residuals[0], w["ln1"], EPS, w["qkv"], None, b.stream,
                                groups_per_block=qkv_groups)
            gemv.gemv(o_out, attn, w["o"], None, b.stream)
            if inter is not None:
                gemv_norm.gemv_norm_silu_and_mul(act, residuals[0], o_out, residuals[1], w["ln2"], EPS,
                                                 w["gate_up"], None, b.stream, groups_per_block=gate_up_groups)
                gemv.gemv(o_out, act, w["down"], None, b.stream)

    base = timed_graph(b.stream, unfused, b.iters) / num_layers * 1e6
    print(f"| {name} | norms apart | - | {base:.1f} | {floor:.1f} | 1.000 |", flush=True)
    for qkv_groups, gate_up_groups in itertools.product(groups, groups if inter is not None else [1]):
        per_layer = timed_graph(b.stream, lambda: fused(qkv_groups, gate_up_groups), b.iters) / num_layers * 1e6
        print(f"| {name} | norms fused | {qkv_groups}, {gate_up_groups if inter else '-'} | {per_layer:.1f} | "
              f"{floor:.1f} | {base / per_layer:.3f} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, iters=5)
    parser.add_argument("--layers", type=int, default=8, help="layers (distinct weights) per graph")
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args(argv)
    b = DeviceBench(DType.bfloat16, args.iters)
    make = RandomDeviceWeights(b.allocator, b.stream, b.dtype)
    copy_rate = copy_bandwidth(b.allocator, b.stream)
    print(b.header(copy_rate))
    print("| shape | chain | groups (qkv, gate_up) | us / layer | floor us | unfused / this |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, shape in SHAPES.items():
        bench_shape(b, make, name, shape, args.layers, args.groups, copy_rate)
        b.stream.synchronize()
        b.allocator.release_cached()  # this shape's weights, before the next one's
        make.patterns.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
