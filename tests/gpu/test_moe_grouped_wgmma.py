"""The Hopper wgmma expert GEMMs (moe_grouped_wgmma) against numpy in float64 and against the
mma.sync kernels (moe_grouped_gemm) run on the same inputs. The pieces they are built from
(wgmma.cuh) have their own diagnostics in test_wgmma_diagnostics.py. Each test runs at both
cluster sizes (`cluster`).

As in test_moe_grouped_gemm.py, the alignment kernel's outputs are built on the host and the
reference multiplies the operands as the device holds them, per sorted row:
    hidden[row]     = silu_and_mul(x[tok] @ gate_up[e].T)
    expert_out[row] = hidden[row] @ down[e].T, rounded to the dtype as the kernel stores it
Relative error is max |gpu - ref| / max |ref| <= 1e-2 (bf16/fp16; for expert_out against numpy
that includes hidden's rounding). Every test skips off sm_90.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cpu.moe import silu_and_mul
from sparkd.backend.cuda.kernels import moe_grouped_gemm, moe_grouped_wgmma

from .moe_cases import (Routing, as_stored, cached_expert_weights, check_idle_experts_and_spaced_rows,
                         check_replay_with_new_routing, one_expert_takes_every_token, random_choices,
                         random_tokens, reference, run_grouped)

pytestmark = pytest.mark.gpu

QWEN3_30B = (128, 8, 2048, 768)  # (E, k, H, I)
MIXTRAL_8X7B = (8, 2, 4096, 14336)
SAMPLED_ROWS = 64  # rows the float64 reference covers where all of them would take minutes


@pytest.fixture(autouse=True)
def _hopper(gpu):
    from sparkd.backend.cuda.driver import device_arch

    if not moe_grouped_wgmma.use_wgmma(device_arch()):
        pytest.skip(f"wgmma runs on {moe_grouped_wgmma.WGMMA_ARCH} only, this device is {device_arch()}")


@pytest.fixture(autouse=True, params=[1, 2], ids=["one-block", "pairs"])
def cluster(request, monkeypatch):
    """Every test at both cluster sizes, whatever cluster_size's rule picks for its expert count:
    one block loading its own weight slices, and pairs of M-tiles sharing them by multicast."""
    monkeypatch.setattr(moe_grouped_wgmma, "cluster_size", lambda *shape: request.param)
    return request.param


@pytest.fixture(scope="module")
def expert_weights(gpu):
    return cached_expert_weights(gpu)



# ---- the GEMMs ----

def _run(gpu, gemms, x_dev, gate_up_dev, down_dev, routing: Routing):
    """The tile plan, then gemms' (moe_grouped_wgmma or moe_grouped_gemm) gate_up and down:
    (hidden [P, I], expert_out [P, H]) as numpy."""
    return run_grouped(gpu, gemms, x_dev, gate_up_dev, down_dev, routing)[:2]


def _reference_rows(x, gate_up, down, routing: Routing, rows: np.ndarray, dtype: str):
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
    return hidden, as_stored(expert_out, dtype)


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
        hidden_ref, expert_out_ref = _reference_rows(x, gate_up, down, routing, rows, dtype)
        hidden, expert_out = hidden[rows], expert_out[rows]
    else:
        hidden_ref, expert_out_ref = reference(x, gate_up, down, routing, dtype)
    assert rel_error(hidden, hidden_ref) <= tolerance[dtype]
    assert rel_error(expert_out, expert_out_ref) <= tolerance[dtype]
    return expert_out


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
    x_dev, x = random_tokens(gpu, rng, expert_ids.shape[0], hidden_size, dtype)
    _check(gpu, rel_error, tolerance, dtype, x_dev, x, expert_weights(len(counts), hidden_size, inter, dtype), routing)


@pytest.mark.parametrize("num_tokens,top_k", [(2048, 1), (257, 2)])
def test_one_expert_takes_every_token(gpu, rel_error, tolerance, num_tokens, top_k):
    """See moe_cases.one_expert_takes_every_token."""
    routing, x_dev, x, weights = one_expert_takes_every_token(gpu, num_tokens, top_k)
    _check(gpu, rel_error, tolerance, "bfloat16", x_dev, x, weights, routing)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_idle_experts_are_never_read_and_spaced_rows_are_honoured(gpu, rel_error, tolerance, dtype):
    """See moe_cases.check_idle_experts_and_spaced_rows."""
    check_idle_experts_and_spaced_rows(gpu, rel_error, tolerance, dtype, lambda x_dev, x, weights, routing: _check(
        gpu, rel_error, tolerance, dtype, x_dev, x, weights, routing))


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
    x_dev, x = random_tokens(gpu, rng, num_tokens, hidden_size, dtype)
    weights = expert_weights(num_experts, hidden_size, inter, dtype)
    _check(gpu, rel_error, tolerance, dtype, x_dev, x, weights, routing, sampled)


def test_plan_and_gemms_replay_in_a_cuda_graph_with_new_routing(gpu, rel_error, tolerance, expert_weights):
    """The persistent grids depend on (P, E, N) and the device only: a graph captured for an even
    routing replays one where two experts take every pair."""
    check_replay_with_new_routing(gpu, rel_error, tolerance, expert_weights, moe_grouped_wgmma)
