"""The tensor-core expert GEMMs (moe_grouped_gemm: plan_tiles, moe_grouped_gate_up,
moe_grouped_down) against numpy in float64, and CudaOps.moe_experts on that path.

As in test_moe_gemm.py, the alignment kernel's outputs are built on the host, and the
reference multiplies the operands as the device holds them, per sorted row:
    hidden[row]     = silu_and_mul(x[tok] @ gate_up[e].T)
    expert_out[row] = hidden[row] @ down[e].T, rounded to the dtype as the kernel stores it
Relative error is max |gpu - ref| / max |ref| <= 1e-2 (bf16/fp16; for expert_out that
includes hidden's rounding).
"""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cpu.moe import moe_experts
from sparkd.backend.cuda.kernels import moe_grouped_gemm
from sparkd.backend.dtypes import DType

from .moe_cases import (ODD, Routing, cached_expert_weights, check_idle_experts_and_spaced_rows,
                         check_replay_with_new_routing, one_expert_takes_every_token, random_choices,
                         random_tokens, reference, run_grouped)

pytestmark = pytest.mark.gpu

QWEN3_30B = (2048, 768)  # (H, I) of Qwen3-30B-A3B


@pytest.fixture(scope="module")
def expert_weights(gpu):
    return cached_expert_weights(gpu)


def _run(gpu, x_dev, gate_up_dev, down_dev, routing: Routing, stages=None):
    """plan + both kernels on the device (at pipeline depth `stages`, by default the device's):
    (hidden [P, I], expert_out [P, H]) as numpy; checks the plan's tile starts."""
    hidden, expert_out, tile_starts = run_grouped(gpu, moe_grouped_gemm, x_dev, gate_up_dev, down_dev, routing, stages)
    expected_starts = np.concatenate([[0], np.cumsum(-(-np.diff(routing.offsets) // moe_grouped_gemm.TILE_M))])
    np.testing.assert_array_equal(tile_starts, expected_starts)
    return hidden, expert_out


def _check(gpu, rel_error, tolerance, dtype, x_dev, x, weights, routing: Routing, stages=None):
    """Runs the GEMMs and compares both outputs; weights = (gate_up_dev, down_dev, gate_up, down)."""
    gate_up_dev, down_dev, gate_up, down = weights
    hidden, expert_out = _run(gpu, x_dev, gate_up_dev, down_dev, routing, stages)
    hidden_ref, expert_out_ref = reference(x, gate_up, down, routing, dtype)
    assert np.all(np.isfinite(hidden)) and np.all(np.isfinite(expert_out)), "an idle expert's weights were used"
    assert rel_error(hidden, hidden_ref) <= tolerance[dtype]
    assert rel_error(expert_out, expert_out_ref) <= tolerance[dtype]
    return expert_out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("num_tokens", [64, 257, 2048])
@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("num_experts", [8, 128])
def test_odd_sizes_match_numpy(gpu, rel_error, tolerance, expert_weights, dtype, num_tokens, top_k, num_experts):
    rng = np.random.default_rng(num_tokens * 1000 + top_k * 10 + num_experts)
    routing = Routing.of(random_choices(rng, num_tokens, top_k, np.arange(num_experts)), num_experts)
    x_dev, x = random_tokens(gpu, rng, num_tokens, ODD[0], dtype)
    _check(gpu, rel_error, tolerance, dtype, x_dev, x, expert_weights(num_experts, *ODD, dtype), routing)


@pytest.mark.parametrize("dtype,num_experts,top_k,num_tokens", [
    ("bfloat16", 128, 8, 2048), ("bfloat16", 128, 2, 257), ("bfloat16", 128, 8, 64),
    ("float16", 8, 2, 2048), ("float16", 8, 8, 257), ("bfloat16", 8, 2, 64)])
def test_qwen3_30b_shapes_match_numpy(gpu, rel_error, tolerance, expert_weights, dtype, num_experts, top_k,
                                      num_tokens):
    rng = np.random.default_rng(num_tokens + top_k + num_experts)
    routing = Routing.of(random_choices(rng, num_tokens, top_k, np.arange(num_experts)), num_experts)
    x_dev, x = random_tokens(gpu, rng, num_tokens, QWEN3_30B[0], dtype)
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
    x_dev, x = random_tokens(gpu, rng, expert_ids.shape[0], hidden_size, dtype)
    weights = expert_weights(len(counts), hidden_size, inter, dtype)
    _check(gpu, rel_error, tolerance, dtype, x_dev, x, weights, routing, stages)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_idle_experts_are_never_read_and_spaced_rows_are_honoured(gpu, rel_error, tolerance, dtype):
    """See moe_cases.check_idle_experts_and_spaced_rows."""
    check_idle_experts_and_spaced_rows(gpu, rel_error, tolerance, dtype, lambda x_dev, x, weights, routing: _check(
        gpu, rel_error, tolerance, dtype, x_dev, x, weights, routing))


@pytest.mark.parametrize("num_tokens,top_k", [(2048, 1), (257, 2)])
def test_one_expert_takes_every_token(gpu, rel_error, tolerance, num_tokens, top_k):
    """See moe_cases.one_expert_takes_every_token."""
    routing, x_dev, x, weights = one_expert_takes_every_token(gpu, num_tokens, top_k)
    _check(gpu, rel_error, tolerance, "bfloat16", x_dev, x, weights, routing)


def test_plan_and_gemms_replay_in_a_cuda_graph_with_new_routing(gpu, rel_error, tolerance, expert_weights):
    """The grids depend on (P, E, N) only: a graph captured for an even routing replays one
    where two experts take every pair (more M-tiles per expert, fewer experts)."""
    check_replay_with_new_routing(gpu, rel_error, tolerance, expert_weights, moe_grouped_gemm)


@pytest.mark.parametrize("num_tokens,grouped", [(257, True), (3, False)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_ops_moe_experts_matches_numpy_on_either_path(cuda_ops_factory, rel_error, tolerance, dtype, num_tokens,
                                                          grouped):
    """Align, expert GEMMs (grouped for prefill, GEMV-style for decode) and combine through
    CudaOps against the numpy twin: the output is [T, H], each token's rows summed."""
    ops = cuda_ops_factory(dtype)
    rng = np.random.default_rng(5)
    top_k, num_experts = 4, 16
    assert moe_grouped_gemm.use_grouped_gemm(num_tokens * top_k, num_experts, DType.parse(dtype)) == grouped
    expert_ids = random_choices(rng, num_tokens, top_k, np.arange(num_experts))
    weights = rng.random((num_tokens, top_k), dtype=np.float32)
    gate_up = rng.standard_normal((num_experts, 2 * ODD[1], ODD[0]), dtype=np.float32) / np.sqrt(ODD[0])
    down = rng.standard_normal((num_experts, ODD[0], ODD[1]), dtype=np.float32) / np.sqrt(ODD[1])
    x = rng.standard_normal((num_tokens, ODD[0]), dtype=np.float32)
    x_dev, gate_up_dev, down_dev = (ops.upload(a, dtype) for a in (x, gate_up, down))
    out = ops.moe_experts(x_dev, gate_up_dev, down_dev, ops.upload(weights), ops.upload(expert_ids))
    x, gate_up, down = (ops.download(t) for t in (x_dev, gate_up_dev, down_dev))
    assert rel_error(ops.download(out), moe_experts(x, gate_up, down, weights, expert_ids)) <= tolerance[dtype]
