"""Routing cases and the float64 reference shared by the expert GEMM tests
(test_moe_gemm.py, test_moe_grouped_gemm.py, test_moe_grouped_wgmma.py): host copies of what
the alignment kernel makes, so those tests do not depend on it; `as_stored`, the rounding
of a result to the device's dtype; the combine on the device and its numpy loop
(test_moe_combine.py, test_moe_routing.py); and the alignment on the device, poisoned before
a launch, downloaded and checked against group_by_expert (test_moe_routing.py, test_moe_router.py);
the router's operands as CudaOps makes them, with their logits in numpy (test_moe_router.py,
test_cuda_ops.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from sparkd.backend.cpu.moe import group_by_expert, silu_and_mul
from sparkd.backend.cuda.kernels import moe_routing
from sparkd.backend.cuda.kernels.moe_routing import MoeAlignment
from sparkd.backend.cuda.transfer import copy_to_device
from sparkd.backend.dtypes import DType, decode, encode


@dataclass
class Routing:
    """Host copies of the alignment kernel's outputs for expert_ids [T, k] over E experts."""

    expert_ids: np.ndarray  # [T, k]
    sorted_pairs: np.ndarray  # [P]
    offsets: np.ndarray  # [E + 1]
    active_experts: np.ndarray  # [min(E, P)], past num_active: padding the kernels must not read
    num_active: np.ndarray  # [1]

    @classmethod
    def of(cls, expert_ids: np.ndarray, num_experts: int) -> Routing:
        pairs, offsets = group_by_expert(expert_ids, num_experts)
        active = np.flatnonzero(np.diff(offsets)).astype(np.int32)
        slots = min(num_experts, expert_ids.size)
        idle = np.setdiff1d(np.arange(num_experts), active)
        padding = idle[0] if idle.size else 0  # an idle expert's id, whose weights are NaN
        active_experts = np.full(slots, padding, np.int32)
        active_experts[: active.size] = active
        return cls(expert_ids, pairs.astype(np.int32), offsets.astype(np.int32), active_experts,
                   np.array([active.size], np.int32))

    def upload(self, gpu):
        return [gpu.upload(a) for a in (self.sorted_pairs, self.offsets, self.active_experts, self.num_active)]

    @property
    def row_of_pair(self) -> np.ndarray:
        rows = np.empty_like(self.sorted_pairs)
        rows[self.sorted_pairs] = np.arange(self.sorted_pairs.size, dtype=np.int32)
        return rows


def random_choices(rng, num_tokens: int, top_k: int, experts: np.ndarray) -> np.ndarray:
    """[T, k] distinct experts per token, drawn from `experts`."""
    picks = np.argsort(rng.random((num_tokens, experts.size)), axis=1)[:, :top_k]
    return experts[picks].astype(np.int32)


def random_expert_weights(gpu, rng, num_experts, hidden, inter, dtype, idle):
    """gate_up [E, 2I, H] and down [E, H, I] on the device, NaN for the idle experts (never read)."""
    gate_up = rng.standard_normal((num_experts, 2 * inter, hidden), dtype=np.float32) / np.sqrt(hidden)
    down = rng.standard_normal((num_experts, hidden, inter), dtype=np.float32) / np.sqrt(inter)
    gate_up[idle], down[idle] = np.nan, np.nan
    return gpu.upload(gate_up, dtype), gpu.upload(down, dtype)


# (H, I): whole 16-byte chunks, but no K a multiple of the 64-wide K slice, no N of the 128/256 tile
ODD = (200, 88)


def cached_expert_weights(gpu):
    """(E, H, I, dtype) -> (gate_up, down) on the device and their host copies, all experts finite;
    cached, as the Qwen3-shaped sets take seconds to draw."""

    @cache
    def make(num_experts: int, hidden_size: int, inter: int, dtype: str):
        rng = np.random.default_rng(num_experts + hidden_size + inter)
        gate_up_dev, down_dev = random_expert_weights(gpu, rng, num_experts, hidden_size, inter, dtype, idle=[])
        return gate_up_dev, down_dev, gpu.download(gate_up_dev), gpu.download(down_dev)

    return make


def random_tokens(gpu, rng, num_tokens, hidden_size, dtype):
    """x [T, H] on the device and its host copy as the device holds it."""
    x_dev = gpu.upload(rng.standard_normal((num_tokens, hidden_size), dtype=np.float32), dtype)
    return x_dev, gpu.download(x_dev)


def run_grouped(gpu, gemms, x_dev, gate_up_dev, down_dev, routing: Routing, *options):
    """moe_grouped_gemm's tile plan, then gemms' (moe_grouped_gemm or moe_grouped_wgmma) gate_up and
    down, each given `options` after the stream: (hidden [P, I], expert_out [P, H], tile_starts
    [E + 1]) as numpy."""
    from sparkd.backend.cuda.kernels import moe_grouped_gemm

    sorted_pairs, offsets, _, _ = routing.upload(gpu)
    num_experts, inter2, hidden_size = gate_up_dev.shape
    num_pairs = routing.sorted_pairs.size
    tile_starts = gpu.empty((num_experts + 1,), DType.int32)
    hidden = gpu.empty((num_pairs, inter2 // 2), x_dev.dtype)
    expert_out = gpu.empty((num_pairs, hidden_size), x_dev.dtype)
    moe_grouped_gemm.plan_tiles(tile_starts, offsets, gpu.stream)
    gemms.moe_grouped_gate_up(hidden, x_dev, gate_up_dev, sorted_pairs, offsets, tile_starts,
                              routing.expert_ids.shape[1], gpu.stream, *options)
    gemms.moe_grouped_down(expert_out, hidden, down_dev, offsets, tile_starts, gpu.stream, *options)
    return gpu.download(hidden), gpu.download(expert_out), gpu.download(tile_starts)


def one_expert_takes_every_token(gpu, num_tokens: int, top_k: int):
    """(routing, x_dev, x, weights) where every token picks expert 77 first (and 3 or 100 second
    with top_k 2): 16 full 128-row M-tiles of one expert, or 2 and a last tile of one row; the
    125 experts no token chose hold NaN, so reading any of them shows."""
    rng = np.random.default_rng(2)
    expert_ids = np.full((num_tokens, top_k), 77, np.int32)
    if top_k == 2:
        expert_ids[:, 1] = rng.choice([3, 100], size=num_tokens)
    idle = np.setdiff1d(np.arange(128), [3, 77, 100])
    gate_up_dev, down_dev = random_expert_weights(gpu, rng, 128, *ODD, "bfloat16", idle=idle)
    x_dev, x = random_tokens(gpu, rng, num_tokens, ODD[0], "bfloat16")
    return (Routing.of(expert_ids, 128), x_dev, x,
            (gate_up_dev, down_dev, gpu.download(gate_up_dev), gpu.download(down_dev)))


def check_idle_experts_and_spaced_rows(gpu, rel_error, tolerance, dtype, run_and_check):
    """Tokens choose among 4 of 16 experts; the other 12 hold NaN. x is a column slice of a wider
    matrix. run_and_check(x_dev, x, weights, routing) -> expert_out runs a kernel family and
    checks its outputs; weighting each token's rows must then give the numpy twin's moe_experts."""
    from sparkd.backend.cpu.moe import moe_experts

    rng = np.random.default_rng(1)
    routing = Routing.of(random_choices(rng, 300, 2, np.array([1, 2, 9, 15])), 16)
    idle = np.setdiff1d(np.arange(16), [1, 2, 9, 15])
    gate_up_dev, down_dev = random_expert_weights(gpu, rng, 16, *ODD, dtype, idle=idle)
    wide = gpu.upload(rng.standard_normal((300, ODD[0] + 24), dtype=np.float32), dtype)
    x_dev = wide.column_slice(8, ODD[0])
    x, gate_up, down = gpu.download(x_dev), gpu.download(gate_up_dev), gpu.download(down_dev)
    expert_out = run_and_check(x_dev, x, (gate_up_dev, down_dev, gate_up, down), routing)
    weights = rng.random((300, 2), dtype=np.float32)
    combined = (weights[..., None] * expert_out[routing.row_of_pair].reshape(300, 2, ODD[0])).sum(axis=1)
    assert rel_error(combined, moe_experts(x, gate_up, down, weights, routing.expert_ids)) <= tolerance[dtype]


def check_replay_with_new_routing(gpu, rel_error, tolerance, expert_weights, kernels):
    """`kernels` (moe_grouped_gemm or moe_grouped_wgmma) after the tile plan, captured once for an
    even routing, replayed for one where two experts take every pair: their grids depend on
    (P, E, N) and the device only, whatever the routing."""
    from sparkd.backend.cuda.graphs import capture
    from sparkd.backend.cuda.kernels import moe_grouped_gemm
    from sparkd.backend.cuda.transfer import copy_to_device

    rng = np.random.default_rng(4)
    num_tokens, top_k, num_experts = 200, 2, 8
    first = Routing.of(random_choices(rng, num_tokens, top_k, np.arange(num_experts)), num_experts)
    second = Routing.of(random_choices(rng, num_tokens, top_k, np.array([0, 6])), num_experts)
    gate_up_dev, down_dev, gate_up, down = expert_weights(num_experts, *ODD, "bfloat16")
    x_dev, x = random_tokens(gpu, rng, num_tokens, ODD[0], "bfloat16")
    sorted_pairs, offsets, _, _ = first.upload(gpu)
    tile_starts = gpu.empty((num_experts + 1,), DType.int32)
    hidden = gpu.empty((num_tokens * top_k, ODD[1]), DType.bfloat16)
    expert_out = gpu.empty((num_tokens * top_k, ODD[0]), DType.bfloat16)

    def launch():
        moe_grouped_gemm.plan_tiles(tile_starts, offsets, gpu.stream)
        kernels.moe_grouped_gate_up(hidden, x_dev, gate_up_dev, sorted_pairs, offsets, tile_starts, top_k, gpu.stream)
        kernels.moe_grouped_down(expert_out, hidden, down_dev, offsets, tile_starts, gpu.stream)

    launch()  # load the kernels outside the capture, as the warm-up does
    graph, _ = capture(gpu.stream, launch)
    try:
        copy_to_device(sorted_pairs, second.sorted_pairs, gpu.stream)
        copy_to_device(offsets, second.offsets, gpu.stream)
        graph.replay(gpu.stream)
        _, expected = reference(x, gate_up, down, second, "bfloat16")
        assert rel_error(gpu.download(expert_out), expected) <= tolerance["bfloat16"]
    finally:
        graph.destroy()


def as_stored(array: np.ndarray, dtype: str) -> np.ndarray:
    """What a result becomes in the device's `dtype` (via float32, round to nearest even), as float32."""
    target = DType.parse(dtype)
    return decode(encode(np.asarray(array, np.float32), target), target).astype(np.float32)


def reference(x, gate_up, down, routing: Routing, dtype: str):
    """(hidden [P, I] in float64, expert_out [P, H] summed in float64 and stored in `dtype`, as the
    kernels store it), rows in expert order."""
    x, gate_up, down = (np.asarray(a, np.float64) for a in (x, gate_up, down))
    top_k = routing.expert_ids.shape[1]
    hidden = np.zeros((routing.sorted_pairs.size, gate_up.shape[1] // 2))
    expert_out = np.zeros((routing.sorted_pairs.size, down.shape[1]))
    for expert in routing.active_experts[: routing.num_active[0]]:
        rows = slice(routing.offsets[expert], routing.offsets[expert + 1])
        hidden[rows] = silu_and_mul(x[routing.sorted_pairs[rows] // top_k] @ gate_up[expert].T)
        expert_out[rows] = hidden[rows] @ down[expert].T
    return hidden, as_stored(expert_out, dtype)


def combine_on_device(gpu, expert_out, weights, row_of_pair, dtype) -> np.ndarray:
    out = gpu.empty((weights.shape[0], expert_out.shape[1]), dtype)
    moe_routing.moe_combine(out, gpu.upload(expert_out, dtype), gpu.upload(weights),
                            gpu.upload(row_of_pair.astype(np.int32)), gpu.stream)
    return gpu.download(out)


def reference_combine(expert_out, weights, row_of_pair) -> np.ndarray:
    """out[t] = sum_j weights[t, j] * expert_out[row_of_pair[t*k + j]] in float32, j in order,
    each product and each sum rounded on its own."""
    num_tokens, top_k = weights.shape
    rows = expert_out[row_of_pair.reshape(num_tokens, top_k)]  # [T, k, H]
    out = np.zeros((num_tokens, expert_out.shape[1]), np.float32)
    for j in range(top_k):
        out = out + weights[:, j, None] * rows[:, j]
    return out


# ---- the alignment on the device ----

POISON = -7  # what the alignment buffers hold before a launch: the kernel must overwrite all it promises
ALIGNMENT_VIEWS = ("offsets", "sorted_pairs", "row_of_pair", "active_experts", "num_active")


def poisoned_alignment(gpu, num_pairs: int, num_experts: int) -> MoeAlignment:
    alignment = MoeAlignment.allocate(gpu.allocator, num_pairs, num_experts)
    poison_alignment(gpu, alignment)
    return alignment


def poison_alignment(gpu, alignment: MoeAlignment) -> None:
    """POISON in every view, the kernels' scratch included."""
    for name in (*ALIGNMENT_VIEWS, "block_counts"):
        view = getattr(alignment, name)
        copy_to_device(view, np.full(view.shape, POISON, np.int32), gpu.stream)
    gpu.stream.synchronize()  # the host arrays are pageable temporaries


def download_alignment(gpu, alignment: MoeAlignment) -> dict[str, np.ndarray]:
    return {name: gpu.download(getattr(alignment, name)) for name in ALIGNMENT_VIEWS}


def check_alignment(result: dict[str, np.ndarray], expert_ids: np.ndarray, num_experts: int) -> None:
    """group_by_expert's stable sort exactly, its inverse, and the active experts in order."""
    expected_pairs, expected_offsets = group_by_expert(expert_ids, num_experts)
    np.testing.assert_array_equal(result["offsets"], expected_offsets)
    np.testing.assert_array_equal(result["sorted_pairs"], expected_pairs)
    np.testing.assert_array_equal(result["row_of_pair"][expected_pairs], np.arange(expert_ids.size))
    active = np.flatnonzero(np.diff(expected_offsets))
    assert result["num_active"].tolist() == [active.size]
    np.testing.assert_array_equal(result["active_experts"][:active.size], active)


def route_align_on_device(gpu, logits_dev, top_k: int, renormalize: bool, shared: bool = False):
    """(weights, expert_ids, alignment arrays) from one moe_route_align call (with `shared`, the
    logits' last column a shared expert's gate: k + 1 pairs a token)."""
    num_tokens, num_experts = logits_dev.shape
    columns = top_k + shared
    weights, expert_ids = gpu.empty((num_tokens, columns), DType.float32), gpu.empty((num_tokens, columns), DType.int32)
    alignment = poisoned_alignment(gpu, num_tokens * columns, num_experts)
    moe_routing.moe_route_align(weights, expert_ids, alignment, logits_dev, renormalize, gpu.stream, shared)
    return gpu.download(weights), gpu.download(expert_ids), download_alignment(gpu, alignment)


ROUTER_EPS = 1e-6


@dataclass
class RouterCase:
    """A MoE router's operands on the device: x [T, H], norm_weight [H] and router [E, H] in the ops'
    dtype, residual [T, H] float32 (and its host copy); the router on the host as stored, and
    expected_logits [T, E] float64: NumpyOps' fp32 add_rmsnorm rows (unrounded) times it."""

    x: object
    residual: object
    norm_weight: object
    router: object
    residual_host: np.ndarray
    router_host: np.ndarray
    expected_logits: np.ndarray


def router_case(ops, rng, num_tokens: int, hidden: int, num_experts: int) -> RouterCase:
    from sparkd.backend.cpu.ops import NumpyOps

    x = ops.upload(rng.standard_normal((num_tokens, hidden)).astype(np.float32), ops.dtype)
    residual = ops.upload(rng.standard_normal((num_tokens, hidden)).astype(np.float32), np.float32)
    norm_weight = ops.upload((1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32), ops.dtype)
    router = ops.upload((rng.standard_normal((num_experts, hidden)) * 0.05).astype(np.float32), ops.dtype)
    x_h, residual_h, norm_h, router_h = (ops.download(t).astype(np.float32) for t in (x, residual, norm_weight, router))
    y_ref, _ = NumpyOps().add_rmsnorm(x_h, residual_h, norm_h, ROUTER_EPS)
    return RouterCase(x, residual, norm_weight, router, residual_h, router_h,
                      y_ref.astype(np.float64) @ router_h.astype(np.float64).T)
