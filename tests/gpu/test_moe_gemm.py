"""The expert GEMM kernels (moe_gate_up, moe_down) against numpy in float64, under the
launch plan the host picks and under every plan forced (rows per pass x K split).

The routing tensors the alignment kernel would make (sorted_pairs, offsets,
active_experts, num_active) are built on the host from `group_by_expert`, so these
tests do not depend on that kernel. The reference multiplies the operands as the
device holds them (bf16-rounded where bf16), per sorted row:
    hidden[row]     = silu_and_mul(x[tok] @ gate_up[e].T)
    expert_out[row] = hidden[row] @ down[e].T, rounded to the dtype as the kernel stores it
Relative error is max |gpu - ref| / max |ref|: <= 1e-5 for fp32, <= 1e-2 for bf16/fp16
(for expert_out that includes hidden's rounding to bf16/fp16).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from sparkd.backend.cpu.moe import moe_experts
from sparkd.backend.cuda.kernels import moe_gemm
from sparkd.backend.dtypes import DType

from .moe_cases import Routing, random_choices, random_expert_weights, reference

pytestmark = pytest.mark.gpu

# H and I in whole 16-byte chunks (the kernels' rule), an odd number of bf16 chunks, so
# no K divides evenly over a warp's lanes.
HIDDEN, INTER = 200, 88


def _run(gpu, x_dev, gate_up_dev, down_dev, routing: Routing, launch_plan=None):
    """Both kernels on the device (launch_plan None: the launchers' own): (hidden [P, I],
    expert_out [P, H]) as numpy."""
    sorted_pairs, offsets, active_experts, num_active = routing.upload(gpu)
    num_pairs, inter, hidden_size = routing.sorted_pairs.size, gate_up_dev.shape[1] // 2, gate_up_dev.shape[2]
    hidden = gpu.empty((num_pairs, inter), x_dev.dtype)
    expert_out = gpu.empty((num_pairs, hidden_size), x_dev.dtype)
    moe_gemm.moe_gate_up(hidden, x_dev, gate_up_dev, sorted_pairs, offsets, active_experts, num_active,
                         routing.expert_ids.shape[1], gpu.stream, launch_plan)
    moe_gemm.moe_down(expert_out, hidden, down_dev, offsets, active_experts, num_active, gpu.stream, launch_plan)
    return gpu.download(hidden), gpu.download(expert_out)


def _check(gpu, rel_error, tolerance, dtype, x_dev, gate_up_dev, down_dev, routing: Routing, launch_plan=None):
    hidden, expert_out = _run(gpu, x_dev, gate_up_dev, down_dev, routing, launch_plan)
    x, gate_up, down = gpu.download(x_dev), gpu.download(gate_up_dev), gpu.download(down_dev)
    hidden_ref, expert_out_ref = reference(x, gate_up, down, routing, dtype)
    assert np.all(np.isfinite(hidden)) and np.all(np.isfinite(expert_out)), "an idle expert's weights were used"
    assert rel_error(hidden, hidden_ref) <= tolerance[dtype]
    assert rel_error(expert_out, expert_out_ref) <= tolerance[dtype]
    return x, gate_up, down, expert_out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_tokens", [1, 5, 64, 257])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("num_experts", [8, 128])
def test_expert_gemms_match_numpy(gpu, rel_error, tolerance, dtype, num_tokens, top_k, num_experts):
    rng = np.random.default_rng(num_tokens * 1000 + top_k * 10 + num_experts)
    routing = Routing.of(random_choices(rng, num_tokens, top_k, np.arange(num_experts)), num_experts)
    idle = np.setdiff1d(np.arange(num_experts), routing.active_experts[: routing.num_active[0]])
    gate_up_dev, down_dev = random_expert_weights(gpu, rng, num_experts, HIDDEN, INTER, dtype, idle)
    x_dev = gpu.upload(rng.standard_normal((num_tokens, HIDDEN), dtype=np.float32), dtype)
    _check(gpu, rel_error, tolerance, dtype, x_dev, gate_up_dev, down_dev, routing)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_idle_experts_are_skipped_and_the_combine_gives_moe_experts(gpu, rel_error, tolerance, dtype):
    """Tokens choose among 4 of 8 experts; the other 4 hold NaN. Weighting each token's
    rows (found through row_of_pair) gives the numpy twin's moe_experts."""
    rng = np.random.default_rng(1)
    routing = Routing.of(random_choices(rng, 37, 2, np.array([1, 2, 5, 6])), 8)
    gate_up_dev, down_dev = random_expert_weights(gpu, rng, 8, HIDDEN, INTER, dtype, idle=[0, 3, 4, 7])
    x_dev = gpu.upload(rng.standard_normal((37, HIDDEN), dtype=np.float32), dtype)
    x, gate_up, down, expert_out = _check(gpu, rel_error, tolerance, dtype, x_dev, gate_up_dev, down_dev, routing)

    weights = rng.random((37, 2), dtype=np.float32)
    combined = (weights[..., None] * expert_out[routing.row_of_pair].reshape(37, 2, HIDDEN)).sum(axis=1)
    assert rel_error(combined, moe_experts(x, gate_up, down, weights, routing.expert_ids)) <= tolerance[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_one_expert_takes_every_token(gpu, rel_error, tolerance, dtype, top_k):
    """All 257 tokens pick expert 77 first: its rows run in many full tiles and a last tile of one row."""
    rng = np.random.default_rng(2)
    expert_ids = np.full((257, top_k), 77, np.int32)
    if top_k == 2:
        expert_ids[:, 1] = rng.choice([3, 100], size=257)
    routing = Routing.of(expert_ids, 128)
    idle = np.setdiff1d(np.arange(128), [3, 77, 100])
    gate_up_dev, down_dev = random_expert_weights(gpu, rng, 128, HIDDEN, INTER, dtype, idle)
    x_dev = gpu.upload(rng.standard_normal((257, HIDDEN), dtype=np.float32), dtype)
    _check(gpu, rel_error, tolerance, dtype, x_dev, gate_up_dev, down_dev, routing)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("rows_per_pass", moe_gemm.M_TILES)
@pytest.mark.parametrize("k_split", moe_gemm.K_SPLITS)
def test_every_plan_matches_numpy(gpu, rel_error, tolerance, dtype, rows_per_pass, k_split):
    """Forced plans on skewed routing: expert 3 takes 40 rows (several passes at any tile,
    a partial last one), others one or a few. Tiles are partial (I = 88: 11 gate_up tiles
    of 8 columns; H = 200: 12.5 down tiles of 16 rows) and K splits unevenly (25 and 11
    bf16 chunks, 7 and 3 k-steps of 4 chunks, over up to 4 warps)."""
    rng = np.random.default_rng(10 * rows_per_pass + k_split)
    expert_ids = random_choices(rng, 40, 2, np.arange(8))
    expert_ids[:, 0] = 3
    expert_ids[:, 1] = np.where(expert_ids[:, 1] == 3, 5, expert_ids[:, 1])
    routing = Routing.of(expert_ids, 8)
    idle = np.setdiff1d(np.arange(8), routing.active_experts[: routing.num_active[0]])
    gate_up_dev, down_dev = random_expert_weights(gpu, rng, 8, HIDDEN, INTER, dtype, idle)
    x_dev = gpu.upload(rng.standard_normal((40, HIDDEN), dtype=np.float32), dtype)
    _check(gpu, rel_error, tolerance, dtype, x_dev, gate_up_dev, down_dev, routing,
           moe_gemm.ExpertGemmPlan(rows_per_pass, k_split))


@pytest.fixture(scope="module")
def model_sized_weights(gpu):
    """dtype -> (gate_up, down) on the device for 16 experts at H = 2048, I = 776, all finite;
    cached, as drawing them takes seconds."""

    @cache
    def make(dtype: str):
        return random_expert_weights(gpu, np.random.default_rng(3), 16, 2048, 776, dtype, idle=[])

    return make


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_tokens,k_split", [(1, None), (33, None), (33, 1), (33, 2), (33, 4)])
def test_model_sized_rows_split_k_over_warps(gpu, rel_error, tolerance, model_sized_weights, dtype, num_tokens,
                                             k_split):
    """H = 2048 and I = 776 (97 bf16 chunks): long K slices, several batches of loads each,
    the last one partial, under the host's plan (k_split None; at one token on a large GPU
    it splits K) and each K split forced. x's rows are spaced, as a column slice of a
    wider matrix."""
    rng = np.random.default_rng(num_tokens)
    routing = Routing.of(random_choices(rng, num_tokens, 4, np.arange(16)), 16)
    gate_up_dev, down_dev = model_sized_weights(dtype)
    wide = gpu.upload(rng.standard_normal((num_tokens, 2048 + 64), dtype=np.float32), dtype)
    launch_plan = None if k_split is None else moe_gemm.ExpertGemmPlan(
        moe_gemm.expert_tile(num_tokens * 4, 16), k_split)
    _check(gpu, rel_error, tolerance, dtype, wide.column_slice(32, 2048), gate_up_dev, down_dev, routing, launch_plan)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_results_repeat_bit_for_bit(gpu, model_sized_weights, dtype):
    """The sums run in a fixed order (K slices meet in shared memory, no atomics): the same
    launch twice, K split over 4 warps, gives identical bits."""
    rng = np.random.default_rng(5)
    routing = Routing.of(random_choices(rng, 33, 4, np.arange(16)), 16)
    gate_up_dev, down_dev = model_sized_weights(dtype)
    x_dev = gpu.upload(rng.standard_normal((33, 2048), dtype=np.float32), dtype)
    launch_plan = moe_gemm.ExpertGemmPlan(moe_gemm.expert_tile(33 * 4, 16), 4)
    first = _run(gpu, x_dev, gate_up_dev, down_dev, routing, launch_plan)
    second = _run(gpu, x_dev, gate_up_dev, down_dev, routing, launch_plan)
    for a, b in zip(first, second):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_launches_replay_in_a_cuda_graph_with_new_routing(gpu, rel_error, tolerance):
    """The grid depends on (T, k, E) only: a graph captured for one routing replays another."""
    from sparkd.backend.cuda.graphs import capture
    from sparkd.backend.cuda.transfer import copy_to_device

    rng = np.random.default_rng(4)
    first = Routing.of(random_choices(rng, 5, 2, np.arange(8)), 8)
    second = Routing.of(random_choices(rng, 5, 2, np.array([0, 6])), 8)
    gate_up_dev, down_dev = random_expert_weights(gpu, rng, 8, HIDDEN, INTER, "bfloat16", idle=[])
    x_dev = gpu.upload(rng.standard_normal((5, HIDDEN), dtype=np.float32), "bfloat16")
    routing_dev = first.upload(gpu)
    hidden = gpu.empty((10, INTER), DType.bfloat16)
    expert_out = gpu.empty((10, HIDDEN), DType.bfloat16)

    def launch():
        moe_gemm.moe_gate_up(hidden, x_dev, gate_up_dev, *routing_dev, 2, gpu.stream)
        moe_gemm.moe_down(expert_out, hidden, down_dev, *routing_dev[1:], gpu.stream)

    launch()  # load the kernels outside the capture, as the warm-up does
    graph, _ = capture(gpu.stream, launch)
    try:
        for device, host in zip(routing_dev, (second.sorted_pairs, second.offsets, second.active_experts,
                                              second.num_active)):
            copy_to_device(device, host, gpu.stream)
        graph.replay(gpu.stream)
        _, expected = reference(gpu.download(x_dev), gpu.download(gate_up_dev), gpu.download(down_dev), second,
                                "bfloat16")
        assert rel_error(gpu.download(expert_out), expected) <= tolerance["bfloat16"]
    finally:
        graph.destroy()
