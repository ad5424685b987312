"""The tensor-core expert GEMMs (moe_grouped_gemm: plan_tiles, moe_grouped_gate_up,
moe_grouped_down) against numpy in float64, and CudaOps.moe_experts on that path.

As in test_moe_gemm.py, the alignment kernel's outputs are built on the host, and the
reference multiplies the operands as the device holds them, per sorted row:
    hidden[row]     = silu_and_mul(x[tok] @ gate_up[e].T)
    expert_out[row] = hidden[row] @ down[e].T
Relative error is max |gpu - ref| / max |ref| <= 1e-2 (bf16/fp16; for expert_out that
includes hidden's rounding).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from sparkd.backend.cpu.moe import moe_experts
from sparkd.backend.cuda.kernels import moe_grouped_gemm
from sparkd.backend.dtypes import DType

from .moe_cases import Routing, random_choices, random_expert_weights, reference

pytestmark = pytest.mark.gpu

QWEN3_30B = (2048, 768)  # (H, I) of Qwen3-30B-A3B
ODD = (200, 88)  # whole 16-byte chunks, but no K a multiple of the 64-wide K slice, no N of the 128/256 tile


@pytest.fixture(scope="module")
def expert_weights(gpu):
    """(E, H, I, dtype) -> (gate_up, down) on the device and their host copies, all experts finite;
    cached, as the Qwen3-shaped sets take seconds to draw."""

    @cache
    def make(num_experts: int, hidden_size: int, inter: int, dtype: str):
        rng = np.random.default_rng(num_experts + hidden_size + inter)
        gate_up_dev, down_dev = random_expert_weights(gpu, rng, num_experts, hidden_size, inter, dtype, idle=[])
        return gate_up_dev, down_dev, gpu.download(gate_up_dev), gpu.download(down_dev)

    return make


def _run(gpu, x_dev, gate_up_dev, down_dev, routing: Routing, stages=None):
    """plan + both kernels on the device (at pipeline depth `stages`, by default the device's):
    (hidden [P, I], expert_out [P, H]) as numpy."""
    sorted_pairs, offsets, _, _ = routing.upload(gpu)
    num_experts, inter2, hidden_size = gate_up_dev.shape
    num_pairs = routing.sorted_pairs.size
    tile_starts = gpu.empty((num_experts + 1,), DType.int32)
    hidden = gpu.empty((num_pairs, inter2 // 2), x_dev.dtype)
    expert_out = gpu.empty((num_pairs, hidden_size), DType.float32)
    moe_grouped_gemm.plan_tiles(tile_starts, offsets, gpu.stream)
    moe_grouped_gemm.moe_grouped_gate_up(hidden, x_dev, gate_up_dev, sorted_pairs, offsets, tile_starts,
                                         routing.expert_ids.shape[1], gpu.stream, stages)
    moe_grouped_gemm.moe_grouped_down(expert_out, hidden, down_dev, offsets, tile_starts, gpu.stream, stages)
    expected_starts = np.concatenate([[0], np.cumsum(-(-np.diff(routing.offsets) // moe_grouped_gemm.TILE_M))])
    np.testing.assert_array_equal(gpu.download(tile_starts), expected_starts)
    return gpu.download(hidden), gpu.download(expert_out)


def _check(gpu, rel_error, tolerance, dtype, x_dev, x, weights, routing: Routing, stages=None):
    """Runs the GEMMs and compares both outputs; weights = (gate_up_dev, down_dev, gate_up, down)."""
    gate_up_dev, down_dev, gate_up, down = weights
    hidden, expert_out = _run(gpu, x_dev, gate_up_dev, down_dev, routing, stages)
    hidden_ref, expert_out_ref = reference(x, gate_up, down, routing)
    assert np.all(np.isfinite(hidden)) and np.all(np.isfinite(expert_out)), "an idle expert's weights were used"
    assert rel_error(hidden, hidden_ref) <= tolerance[dtype]
    assert rel_error(expert_out, expert_out_ref) <= tolerance[dtype]
    return expert_out


def _tokens(gpu, rng, num_tokens, hidden_size, dtype):
    x_dev = gpu.upload(rng.standard_normal((num_tokens, hidden_size), dtype=np.float32), dtype)
    return x_dev, gpu.download(x_dev)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("num_tokens", [64, 257, 2048])
@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("num_experts", [8, 128])
def test_odd_sizes_match_numpy(gpu, rel_error, tolerance, expert_weights, dtype, num_tokens, top_k, num_experts):
    rng = np.random.default_rng(num_tokens * 1000 + top_k * 10 + num_experts)
    routing = Routing.of(random_choices(rng, num_tokens, top_k, np.arange(num_experts)), num_experts)
    x_dev, x = _tokens(gpu, rng, num_tokens, ODD[0], dtype)
    _check(gpu, rel_error, tolerance, dtype, x_dev, x, expert_weights(num_experts, *ODD, dtype), routing)


@pytest.mark.parametrize("dtype,num_experts,top_k,num_tokens", [
    ("bfloat16", 128, 8, 2048), ("bfloat16", 128, 2, 257), ("bfloat16", 128, 8, 64),
    ("float16", 8, 2, 2048), ("float16", 8, 8, 257), ("bfloat16", 8, 2, 64)])
def test_qwen3_30b_shapes_match_numpy(gpu, rel_error, tolerance, expert_weights, dtype, num_experts, top_k,
                                      num_tokens):
    rng = np.random.default_rng(num_tokens + top_k + num_experts)
    routing = Routing.of(random_choices(rng, num_tokens, top_k, np.arange(num_experts)), num_experts)
    x_dev, x = _tokens(gpu, rng, num_tokens, QWEN3_30B[0], dtype)
    _check(gpu, rel_error, tolerance, dtype, x_dev, x, expert_weights(num_experts, *QWEN3_30B, dtype), routing)


@pytest.mark.parametrize("stages", moe_grouped_gemm.STAGES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tile_edges_and_every_pipeline_depth_match_numpy(gpu, rel_error, tolerance, expert_weights, dtype, stages):
    """Expert row counts on each side of the 16-row MMA groups, the 64-row warp split and the
    128-row M-tile (so last tiles of 1 to 127 rows), 3 weight tiles of either GEMM with a last
    one of 8 rows, K of 8 past whole 64-wide slices, and 30 M-tile slots (21 used): 3 raster
    groups of 8 and a last one of 6. Both instantiated pipeline depths run, whatever the device picks."""
    counts = [0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 0, 300]
    hidden_size, inter = 520, 264
    rng = np.random.default_rng(6)
    expert_ids = rng.permutation(np.repeat(np.arange(len(counts)), counts)).astype(np.int32)[:, None]
    routing = Routing.of(expert_ids, len(counts))
    assert moe_grouped_gemm.max_m_tiles(expert_ids.size, len(counts)) == 30
    x_dev, x = _tokens(gpu, rng, expert_ids.shape[0], hidden_size, dtype)
    weights = expert_weights(len(counts), hidden_size, inter, dtype)
    _check(gpu, rel_error, tolerance, dtype, x_dev, x, weights, routing, stages)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_idle_experts_are_never_read_and_spaced_rows_are_honoured(gpu, rel_error, tolerance, dtype):
    """Tokens choose among 4 of 16 experts; the other 12 hold NaN. x is a column slice of a
    wider matrix. Weighting each token's rows gives the numpy twin's moe_experts."""
    rng = np.random.default_rng(1)
    routing = Routing.of(random_choices(rng, 300, 2, np.array([1, 2, 9, 15])), 16)
    idle = np.setdiff1d(np.arange(16), [1, 2, 9, 15])
    gate_up_dev, down_dev = random_expert_weights(gpu, rng, 16, *ODD, dtype, idle=idle)
    wide = gpu.upload(rng.standard_normal((300, ODD[0] + 24), dtype=np.float32), dtype)
    x_dev = wide.column_slice(8, ODD[0])
    x, gate_up, down = gpu.download(x_dev), gpu.download(gate_up_dev), gpu.download(down_dev)
    expert_out = _check(gpu, rel_error, tolerance, dtype, x_dev, x, (gate_up_dev, down_dev, gate_up, down), routing)

    weights = rng.random((300, 2), dtype=np.float32)
    combined = (weights[..., None] * expert_out[routing.row_of_pair].reshape(300, 2, ODD[0])).sum(axis=1)
    assert rel_error(combined, moe_experts(x, gate_up, down, weights, routing.expert_ids)) <= tolerance[dtype]


@pytest.mark.parametrize("num_tokens,top_k", [(2048, 1), (257, 2)])
def test_one_expert_takes_every_token(gpu, rel_error, tolerance, num_tokens, top_k):
    """Every token picks expert 77 first: 16 full M-tiles of one expert, or 2 and a last
    tile of one row; the 125 experts no token chose hold NaN."""
    rng = np.random.default_rng(2)
    expert_ids = np.full((num_tokens, top_k), 77, np.int32)
    if top_k == 2:
        expert_ids[:, 1] = rng.choice([3, 100], size=num_tokens)
    routing = Routing.of(expert_ids, 128)
    idle = np.setdiff1d(np.arange(128), [3, 77, 100])
    gate_up_dev, down_dev = random_expert_weights(gpu, rng, 128, *ODD, "bfloat16", idle=idle)
    x_dev, x = _tokens(gpu, rng, num_tokens, ODD[0], "bfloat16")
    weights = (gate_up_dev, down_dev, gpu.download(gate_up_dev), gpu.download(down_dev))
    _check(gpu, rel_error, tolerance, "bfloat16", x_dev, x, weights, routing)


def test_plan_and_gemms_replay_in_a_cuda_graph_with_new_routing(gpu, rel_error, tolerance, expert_weights):
    """The grids depend on (P, E, N) only: a graph captured for an even routing replays one
    where two experts take every pair (more M-tiles per expert, fewer experts)."""
    from sparkd.backend.cuda.graphs import capture
    from sparkd.backend.cuda.transfer import copy_to_device

    rng = np.random.default_rng(4)
    num_tokens, top_k, num_experts = 200, 2, 8
    first = Routing.of(random_choices(rng, num_tokens, top_k, np.arange(num_experts)), num_experts)
    second = Routing.of(random_choices(rng, num_tokens, top_k, np.array([0, 6])), num_experts)
    gate_up_dev, down_dev, gate_up, down = expert_weights(num_experts, *ODD, "bfloat16")
    x_dev, x = _tokens(gpu, rng, num_tokens, ODD[0], "bfloat16")
    sorted_pairs, offsets, _, _ = first.upload(gpu)
    tile_starts = gpu.empty((num_experts + 1,), DType.int32)
    hidden = gpu.empty((num_tokens * top_k, ODD[1]), DType.bfloat16)
    expert_out = gpu.empty((num_tokens * top_k, ODD[0]), DType.float32)

    def launch():
        moe_grouped_gemm.plan_tiles(tile_starts, offsets, gpu.stream)
        moe_grouped_gemm.moe_grouped_gate_up(hidden, x_dev, gate_up_dev, sorted_pairs, offsets, tile_starts, top_k,
                                             gpu.stream)
        moe_grouped_gemm.moe_grouped_down(expert_out, hidden, down_dev, offsets, tile_starts, gpu.stream)

    launch()  # load the kernels outside the capture, as the warm-up does
    graph, _ = capture(gpu.stream, launch)
    try:
        copy_to_device(sorted_pairs, second.sorted_pairs, gpu.stream)
        copy_to_device(offsets, second.offsets, gpu.stream)
        graph.replay(gpu.stream)
        _, expected = reference(x, gate_up, down, second)
        assert rel_error(gpu.download(expert_out), expected) <= tolerance["bfloat16"]
    finally:
        graph.destroy()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_ops_moe_experts_takes_the_grouped_path_and_matches_numpy(cuda_ops_factory, rel_error, tolerance,
                                                                       dtype):
    """Route, align, grouped GEMMs and combine through CudaOps against the numpy twin."""
    ops = cuda_ops_factory(dtype)
    rng = np.random.default_rng(5)
    num_tokens, top_k, num_experts = 257, 4, 16
    assert moe_grouped_gemm.use_grouped_gemm(num_tokens * top_k, num_experts, DType.parse(dtype))
    expert_ids = random_choices(rng, num_tokens, top_k, np.arange(num_experts))
    weights = rng.random((num_tokens, top_k), dtype=np.float32)
    gate_up = rng.standard_normal((num_experts, 2 * ODD[1], ODD[0]), dtype=np.float32) / np.sqrt(ODD[0])
    down = rng.standard_normal((num_experts, ODD[0], ODD[1]), dtype=np.float32) / np.sqrt(ODD[1])
    x = rng.standard_normal((num_tokens, ODD[0]), dtype=np.float32)
    x_dev, gate_up_dev, down_dev = (ops.upload(a, dtype) for a in (x, gate_up, down))
    out = ops.moe_experts(x_dev, gate_up_dev, down_dev, ops.upload(weights), ops.upload(expert_ids))
    x, gate_up, down = (ops.download(t) for t in (x_dev, gate_up_dev, down_dev))
    assert rel_error(ops.download(out), moe_experts(x, gate_up, down, weights, expert_ids)) <= tolerance[dtype]
