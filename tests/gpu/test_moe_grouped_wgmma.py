"""The Hopper wgmma expert GEMMs (moe_grouped_wgmma) against numpy in float64 and against the
mma.sync kernels (moe_grouped_gemm) run on the same inputs. The pieces they are built from
(wgmma.cuh) have their own diagnostics in test_wgmma_diagnostics.py.

As in test_moe_grouped_gemm.py, the alignment kernel's outputs are built on the host and the
reference multiplies the operands as the device holds them, per sorted row:
    hidden[row]     = silu_and_mul(x[tok] @ gate_up[e].T)
    expert_out[row] = hidden[row] @ down[e].T
Relative error is max |gpu - ref| / max |ref| <= 1e-2 (bf16/fp16; for expert_out against numpy
that includes hidden's rounding). Every test skips off sm_90.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from sparkd.backend.cpu.moe import moe_experts, silu_and_mul
from sparkd.backend.cuda.kernels import moe_grouped_gemm, moe_grouped_wgmma
from sparkd.backend.dtypes import DType

from .moe_cases import Routing, random_choices, random_expert_weights, reference

pytestmark = pytest.mark.gpu

QWEN3_30B = (128, 8, 2048, 768)  # (E, k, H, I)
MIXTRAL_8X7B = (8, 2, 4096, 14336)
ODD = (200, 88)  # (H, I): whole 16-byte chunks, no K a multiple of 64, no N of the 128/256 tile
SAMPLED_ROWS = 64  # rows the float64 reference covers where all of them would take minutes


@pytest.fixture(autouse=True)
def _hopper(gpu):
    from sparkd.backend.cuda.driver import device_arch

    if not moe_grouped_wgmma.use_wgmma(device_arch()):
        pytest.skip(f"wgmma runs on {moe_grouped_wgmma.WGMMA_ARCH} only, this device is {device_arch()}")


@pytest.fixture(scope="module")
def expert_weights(gpu):
    """(E, H, I, dtype) -> (gate_up, down) on the device and their host copies, all experts finite; cached."""

    @cache
    def make(num_experts: int, hidden_size: int, inter: int, dtype: str):
        rng = np.random.default_rng(num_experts + hidden_size + inter)
        gate_up_dev, down_dev = random_expert_weights(gpu, rng, num_experts, hidden_size, inter, dtype, idle=[])
        return gate_up_dev, down_dev, gpu.download(gate_up_dev), gpu.download(down_dev)

    return make



# ---- the GEMMs ----

def _run(gpu, gemms, x_dev, gate_up_dev, down_dev, routing: Routing):
    """The tile plan, then gemms' (moe_grouped_wgmma or moe_grouped_gemm) gate_up and down:
    (hidden [P, I], expert_out [P, H]) as numpy."""
    sorted_pairs, offsets, _, _ = routing.upload(gpu)
    num_experts, inter2, hidden_size = gate_up_dev.shape
    num_pairs = routing.sorted_pairs.size
    tile_starts = gpu.empty((num_experts + 1,), DType.int32)
    hidden = gpu.empty((num_pairs, inter2 // 2), x_dev.dtype)
    expert_out = gpu.empty((num_pairs, hidden_size), DType.float32)
    moe_grouped_gemm.plan_tiles(tile_starts, offsets, gpu.stream)
    gemms.moe_grouped_gate_up(hidden, x_dev, gate_up_dev, sorted_pairs, offsets, tile_starts,
                              routing.expert_ids.shape[1], gpu.stream)
    gemms.moe_grouped_down(expert_out, hidden, down_dev, offsets, tile_starts, gpu.stream)
    return gpu.download(hidden), gpu.download(expert_out)


def _reference_rows(x, gate_up, down, routing: Routing, rows: np.ndarray):
    """`reference` at the sorted rows `rows` only: (hidden [len(rows), I], expert_out [len(rows), H])."""
    top_k = routing.expert_ids.shape[1]
    experts = np.searchsorted(routing.offsets, rows, side="right") - 1
    hidden = np.zeros((rows.size, gate_up.shape[1] // 2))
    expert_out = np.zeros((rows.size, down.shape[1]))
    for expert in np.unique(experts):
        at = experts == expert
        tokens = routing.sorted_pairs[rows[at]] // top_k
        hidden[at] = silu_and_mul(x[tokens].astype(np.float64) @ gate_up[expert].astype(np.float64).T)
        expert_out[at] = hidden[at] @ down[expert].astype(np.float64).T
    return hidden, expert_out


def _check(gpu, rel_error, tolerance, dtype, x_dev, x, weights, routing: Routing, sampled=False):
    """Runs both GEMM pairs and compares the wgmma outputs with the mma.sync ones (every row) and
    with numpy (every row, or SAMPLED_ROWS random ones and the first and last); weights =
    (gate_up_dev, down_dev, gate_up, down). Returns the wgmma expert_out."""
    gate_up_dev, down_dev, gate_up, down = weights
    hidden, expert_out = _run(gpu, moe_grouped_wgmma, x_dev, gate_up_dev, down_dev, routing)
    assert np.all(np.isfinite(hidden)) and np.all(np.isfinite(expert_out)), "an idle expert's weights were used"
    hidden_mma, expert_out_mma = _run(gpu, moe_grouped_gemm, x_dev, gate_up_dev, down_dev, routing)
    assert rel_error(hidden, hidden_mma) <= tolerance[dtype]
    assert rel_error(expert_out, expert_out_mma) <= tolerance[dtype]
    num_pairs = routing.sorted_pairs.size
    if sampled:
        rng = np.random.default_rng(num_pairs)
        rows = np.unique(np.concatenate([[0, num_pairs - 1], rng.choice(num_pairs, SAMPLED_ROWS, replace=False)]))
        hidden_ref, expert_out_ref = _reference_rows(x, gate_up, down, routing, rows)
        hidden, expert_out = hidden[rows], expert_out[rows]
    else:
        hidden_ref, expert_out_ref = reference(x, gate_up, down, routing)
    assert rel_error(hidden, hidden_ref) <= tolerance[dtype]
    assert rel_error(expert_out, expert_out_ref) <= tolerance[dtype]
    return expert_out


def _tokens(gpu, rng, num_tokens, hidden_size, dtype):
    x_dev = gpu.upload(rng.standard_normal((num_tokens, hidden_size), dtype=np.float32), dtype)
    return x_dev, gpu.download(x_dev)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tile_edges_match_numpy_and_mma_sync(gpu, rel_error, tolerance, expert_weights, dtype):
    """Expert row counts on each side of the 64-row consumer split and the 128-row M-tile (last
    tiles of 1 to 127 rows, the second consumer idle up to 64), experts with none, 9 weight tiles
    of either GEMM with a last one of 8 rows, K of 8 past whole 64-wide slices, and 25 M-tiles:
    225 tiles a GEMM, so blocks of the persistent grid take several and the ring wraps across tiles."""
    counts = [0, 1, 15, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 0, 300]
    hidden_size, inter = 2056, 1032
    rng = np.random.default_rng(6)
    expert_ids = rng.permutation(np.repeat(np.arange(len(counts)), counts)).astype(np.int32)[:, None]
    routing = Routing.of(expert_ids, len(counts))
    x_dev, x = _tokens(gpu, rng, expert_ids.shape[0], hidden_size, dtype)
    _check(gpu, rel_error, tolerance, dtype, x_dev, x, expert_weights(len(counts), hidden_size, inter, dtype), routing)


@pytest.mark.parametrize("num_tokens,top_k", [(2048, 1), (257, 2)])
def test_one_expert_takes_every_token(gpu, rel_error, tolerance, num_tokens, top_k):
    """Every token picks expert 77 first: 16 full M-tiles of one expert, or 2 and a last tile of
    one row; the experts no token chose hold NaN, so reading any of them shows."""
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


@pytest.mark.parametrize("model,num_tokens,dtype,sampled", [
    (QWEN3_30B, 4096, "bfloat16", True), (QWEN3_30B, 37, "bfloat16", False), (QWEN3_30B, 37, "float16", False),
    (MIXTRAL_8X7B, 512, "bfloat16", True)], ids=["qwen3-4096", "qwen3-37-bf16", "qwen3-37-fp16", "mixtral-512"])
def test_model_shapes_match_numpy_and_mma_sync(gpu, rel_error, tolerance, expert_weights, model, num_tokens, dtype,
                                               sampled):
    """Qwen3-30B-A3B at a 4096-token prefill (about 2.5 M-tiles an expert, a last one of any size)
    and at 37 tokens (2.3 rows an expert: every M-tile partial, one consumer idle); Mixtral at 512
    tokens (128 rows an expert on average, K = 4096 and 14336)."""
    num_experts, top_k, hidden_size, inter = model
    rng = np.random.default_rng(num_tokens + num_experts)
    routing = Routing.of(random_choices(rng, num_tokens, top_k, np.arange(num_experts)), num_experts)
    x_dev, x = _tokens(gpu, rng, num_tokens, hidden_size, dtype)
    weights = expert_weights(num_experts, hidden_size, inter, dtype)
    _check(gpu, rel_error, tolerance, dtype, x_dev, x, weights, routing, sampled)


def test_plan_and_gemms_replay_in_a_cuda_graph_with_new_routing(gpu, rel_error, tolerance, expert_weights):
    """The persistent grids depend on (P, E, N) and the device only: a graph captured for an even
    routing replays one where two experts take every pair."""
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
        moe_grouped_wgmma.moe_grouped_gate_up(hidden, x_dev, gate_up_dev, sorted_pairs, offsets, tile_starts, top_k,
                                              gpu.stream)
        moe_grouped_wgmma.moe_grouped_down(expert_out, hidden, down_dev, offsets, tile_starts, gpu.stream)

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
