"""MoE routing and alignment kernels (cukernels/moe_routing.cu) against numpy; the combine is
test_moe_combine.py's.

- Routing against `sparkd.backend.cpu.moe.moe_route` run on the logits as the device
  holds them: expert ids exactly, weights within 1e-6 (both sides compute in fp32
  from the same values, whatever the storage dtype).
- Alignment against `group_by_expert`, exactly: the same offsets, the same stable
  order of pairs, row_of_pair the inverse of sorted_pairs, the active experts in
  order; with one block (P <= 2048) and with the count and scatter kernels, P = 1
  to 32768, E = 8 to 1024.
- Routing and alignment in one call (`moe_route_align`, one launch up to FUSED_MAX_TOKENS (16) tokens,
  by one warp up to WARP_MAX_PAIRS (32) pairs): bit for bit what moe_route returns, aligned as above.
- The whole chain, with a stand-in for the expert GEMMs, captured in a CUDA graph
  and replayed on new routing.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cpu.moe import group_by_expert, moe_route, route_with_shared_expert
from sparkd.backend.cuda.kernels import moe_routing
from sparkd.backend.cuda.transfer import copy_to_device
from sparkd.backend.dtypes import DType, decode, encode

from .moe_cases import (
    check_alignment,
    combine_on_device,
    download_alignment,
    poisoned_alignment,
    reference_combine,
    route_align_on_device,
)

DTYPES = ["float32", "bfloat16", "float16"]
WEIGHT_ATOL = 1e-6


def separated_logits(rng, num_tokens: int, num_experts: int) -> np.ndarray:
    """[T, E] float32: each row a shuffle of E values 8/E apart in [-4, 4), shifted.

    No two distinct logits are within rounding of each other, so the softmax order
    is the same on both sides; in bf16/fp16 some become exactly equal, a tie both
    sides give to the lower id."""
    grid = (np.arange(num_experts) + 0.5) * (8.0 / num_experts) - 4.0
    rows = np.stack([rng.permutation(grid) for _ in range(num_tokens)]) + rng.uniform(-1, 1, (num_tokens, 1))
    return rows.astype(np.float32)


def route_on_device(gpu, logits_dev, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    num_tokens = logits_dev.shape[0]
    weights, expert_ids = gpu.empty((num_tokens, top_k), DType.float32), gpu.empty((num_tokens, top_k), DType.int32)
    moe_routing.moe_route(weights, expert_ids, logits_dev, renormalize, gpu.stream)
    return gpu.download(weights), gpu.download(expert_ids)


def check_route(gpu, logits_dev, top_k: int) -> None:
    """Both renormalisation modes against the numpy twin on the stored logits."""
    stored = gpu.download(logits_dev).astype(np.float32)
    for renormalize in (False, True):
        weights, expert_ids = route_on_device(gpu, logits_dev, top_k, renormalize)
        expected_weights, expected_ids = moe_route(stored, top_k, renormalize)
        np.testing.assert_array_equal(expert_ids, expected_ids)
        np.testing.assert_allclose(weights, expected_weights, rtol=0, atol=WEIGHT_ATOL)


# ---- routing ----

ROUTE_SHAPES = [(num_experts, top_k) for num_experts in (8, 128, 512) for top_k in (1, 2, 8, 10)
                if top_k <= num_experts]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_experts,top_k", ROUTE_SHAPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_route_matches_numpy(gpu, dtype, num_experts, top_k, num_tokens):
    rng = np.random.default_rng(num_experts * 1000 + top_k * 10 + num_tokens)
    check_route(gpu, gpu.upload(separated_logits(rng, num_tokens, num_experts), dtype), top_k)


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts,top_k", [(1024, 16), (33, 16), (1, 1)])
def test_route_at_the_limits(gpu, num_experts, top_k):
    """The most experts and choices, an E that leaves one expert in a lane's last slot, one expert."""
    check_route(gpu, gpu.upload(separated_logits(np.random.default_rng(num_experts), 20, num_experts)), top_k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_experts,top_k", [(8, 8), (128, 10), (1024, 16)])
def test_equal_logits_go_to_the_lower_expert_id(gpu, dtype, num_experts, top_k):
    rng = np.random.default_rng(num_experts)
    logits = rng.integers(-3, 3, size=(12, num_experts)).astype(np.float32)  # rows full of ties
    logits[0] = 0.0
    logits[1] = np.arange(num_experts) % 4
    logits[2] = -1.0
    top = [i for i in (num_experts - 1, 5, 37, 69, 100) if i < num_experts]
    logits[2, top] = 2.0  # the maximum in several lanes and slots
    logits[3] = -1.0
    logits[3, num_experts // 2], logits[3, num_experts // 4] = 0.0, -0.0  # +0 and -0 compare equal
    logits_dev = gpu.upload(logits, dtype)
    check_route(gpu, logits_dev, top_k)

    _, expert_ids = route_on_device(gpu, logits_dev, top_k, renormalize=False)
    np.testing.assert_array_equal(expert_ids[0], np.arange(top_k))
    by_value = np.concatenate([np.arange(value, num_experts, 4) for value in (3, 2, 1, 0)])
    np.testing.assert_array_equal(expert_ids[1], by_value[:top_k])
    assert expert_ids[2, :len(top)].tolist() == sorted(top)
    assert expert_ids[3, :2].tolist() == [num_experts // 4, num_experts // 2]


@pytest.mark.gpu
def test_route_reads_spaced_rows(gpu):
    """router_logits as a column slice of a wider matrix (a fused projection's output)."""
    rng = np.random.default_rng(3)
    wide = np.concatenate([rng.standard_normal((9, 5)), separated_logits(rng, 9, 64), rng.standard_normal((9, 3))],
                          axis=1).astype(np.float32)
    check_route(gpu, gpu.upload(wide).column_slice(5, 64), 6)


# ---- alignment ----

def align_on_device(gpu, expert_ids: np.ndarray, num_experts: int) -> dict[str, np.ndarray]:
    alignment = poisoned_alignment(gpu, expert_ids.size, num_experts)
    moe_routing.moe_align(alignment, gpu.upload(expert_ids.astype(np.int32)), gpu.stream)
    return download_alignment(gpu, alignment)


def hot_expert_ids(rng, num_tokens: int, top_k: int, num_experts: int, hot: int, used: int) -> np.ndarray:
    """[T, k]: every token picks `hot`, and k-1 distinct others among experts [0, used);
    experts from `used` on get nothing. The hot expert sits in every slot position."""
    others = np.array([e for e in range(used) if e != hot])
    picks = np.argsort(rng.random((num_tokens, others.size)), axis=1)[:, :top_k - 1]
    expert_ids = np.concatenate([np.full((num_tokens, 1), hot), others[picks]], axis=1)
    rng.permuted(expert_ids, axis=1, out=expert_ids)
    return expert_ids


# P from 1 to 32768, either side of the one-block limit (2048) and of a 256-pair round,
# E = 8 to 1024 (the count kernel's grid shrinks as E grows).
ALIGN_SHAPES = [(1, 1, 8), (1, 8, 128), (7, 2, 8), (64, 8, 128), (300, 10, 512), (256, 8, 128), (2049, 1, 8),
                (257, 8, 8), (600, 8, 128), (1200, 8, 1024), (4096, 2, 8), (4096, 8, 128)]


@pytest.mark.parametrize("num_pairs", [0, 1, 2048, 2049, 8192, 32768, 10**6])
@pytest.mark.parametrize("num_experts", [1, 8, 128, 1024])
def test_align_grid_gives_every_pair_one_block(num_pairs, num_experts):
    """Host side only: chunks are whole rounds of 256 pairs, cover [0, P) and leave no block idle."""
    blocks, chunk = moe_routing.align_grid(num_pairs, num_experts)
    if num_pairs <= moe_routing.ONE_BLOCK_MAX_PAIRS:
        assert (blocks, chunk) == (1, num_pairs)
        return
    assert chunk % 256 == 0 and (blocks - 1) * chunk < num_pairs <= blocks * chunk


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,top_k,num_experts", ALIGN_SHAPES)
def test_alignment_groups_routed_pairs_like_numpy(gpu, num_tokens, top_k, num_experts):
    rng = np.random.default_rng(num_tokens + top_k + num_experts)
    _, expert_ids = moe_route(separated_logits(rng, num_tokens, num_experts), top_k, False)
    check_alignment(align_on_device(gpu, expert_ids, num_experts), expert_ids, num_experts)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(300, 4, 64), (4096, 8, 128), (2500, 1, 8)])
def test_alignment_with_idle_experts_and_one_expert_for_every_token(gpu, num_tokens, top_k, num_experts):
    """One block, then the count and scatter kernels; with k = 1 every pair goes to one expert."""
    rng = np.random.default_rng(4)
    hot, used = 5, min(20, num_experts)
    expert_ids = hot_expert_ids(rng, num_tokens, top_k, num_experts, hot, used)
    result = align_on_device(gpu, expert_ids, num_experts)
    check_alignment(result, expert_ids, num_experts)
    counts = np.diff(result["offsets"])
    assert counts[hot] == num_tokens and not counts[used:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [10, 1000])
def test_pairs_outside_the_experts_get_no_row_and_add_nothing(gpu, num_tokens):
    """The device cannot raise: an id outside [0, E) is left out of the sort and the sum
    (one block, and the count and scatter kernels)."""
    num_experts, top_k, hidden = 16, 3, 8
    rng = np.random.default_rng(5)
    expert_ids = rng.integers(0, num_experts, size=(num_tokens, top_k))
    expert_ids[2, 1], expert_ids[7, 0], expert_ids[7, 2] = -1, num_experts, 1 << 30
    expert_ids[-1, 2] = -5
    valid = (expert_ids >= 0) & (expert_ids < num_experts)
    result = align_on_device(gpu, expert_ids, num_experts)

    row_of_pair, offsets = result["row_of_pair"], result["offsets"]
    assert (row_of_pair[~valid.reshape(-1)] == -1).all()
    np.testing.assert_array_equal(np.diff(offsets), np.bincount(expert_ids[valid], minlength=num_experts))
    assert offsets[0] == 0
    rows = result["sorted_pairs"][:offsets[-1]]
    np.testing.assert_array_equal(rows, group_by_expert(np.where(valid, expert_ids, num_experts), num_experts + 1)[0]
                                  [:offsets[-1]])  # the valid pairs in a stable sort
    np.testing.assert_array_equal(row_of_pair[rows], np.arange(rows.size))

    weights = rng.uniform(0.1, 1, size=expert_ids.shape).astype(np.float32)
    expert_out = rng.standard_normal((expert_ids.size, hidden)).astype(np.float32)
    out = combine_on_device(gpu, expert_out, weights, row_of_pair, "float32")
    np.testing.assert_array_equal(out, reference_combine(expert_out, weights * valid, np.maximum(row_of_pair, 0)))


# ---- routing and alignment in one call ----

def check_route_align(gpu, logits_dev, top_k: int) -> None:
    """The same weights and ids, bit for bit, as moe_route alone; the alignment of numpy's ids."""
    stored = gpu.download(logits_dev).astype(np.float32)
    for renormalize in (False, True):
        weights, expert_ids, result = route_align_on_device(gpu, logits_dev, top_k, renormalize)
        alone_weights, alone_ids = route_on_device(gpu, logits_dev, top_k, renormalize)
        np.testing.assert_array_equal(weights, alone_weights)
        np.testing.assert_array_equal(expert_ids, alone_ids)
        expected_weights, expected_ids = moe_route(stored, top_k, renormalize)
        np.testing.assert_array_equal(expert_ids, expected_ids)
        np.testing.assert_allclose(weights, expected_weights, rtol=0, atol=WEIGHT_ATOL)
        check_alignment(result, expected_ids, logits_dev.shape[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(1, 1, 8), (1, 8, 128), (7, 2, 8), (4, 8, 128),
                                                          (32, 1, 1024), (3, 5, 33), (5, 8, 128), (16, 10, 512),
                                                          (16, 8, 128), (16, 16, 1024), (17, 8, 128), (64, 8, 128)])
def test_route_align_matches_route_then_align(gpu, dtype, num_tokens, top_k, num_experts):
    """One warp up to 32 pairs (one, a lane each, all of them, E not a multiple of 32), one
    block up to 16 tokens (the most pairs, 256, at k = 16); 17 and more take two launches."""
    rng = np.random.default_rng(num_tokens * 7 + top_k + num_experts)
    check_route_align(gpu, gpu.upload(separated_logits(rng, num_tokens, num_experts), dtype), top_k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(1, 10, 512), (2, 10, 512), (3, 8, 128), (16, 10, 512),
                                                          (16, 15, 33), (40, 8, 128)])
def test_route_align_with_a_shared_expert_matches_numpy(gpu, dtype, num_tokens, top_k, num_experts):
    """Logits [T, E + 1] ending in a shared expert's gate: each token's k choices of the first E,
    then expert E weighted sigmoid(its logit), aligned over E + 1 experts (route_with_shared_expert);
    by one warp (T (k + 1) <= 32), one block (T <= 16, k + 1 = 16 the most) and two launches."""
    rng = np.random.default_rng(num_tokens * 11 + top_k + num_experts)
    gates = rng.uniform(-6, 6, (num_tokens, 1)).astype(np.float32)
    logits_dev = gpu.upload(np.concatenate([separated_logits(rng, num_tokens, num_experts), gates], axis=1), dtype)
    stored = gpu.download(logits_dev).astype(np.float32)
    for renormalize in (False, True):
        weights, expert_ids, result = route_align_on_device(gpu, logits_dev, top_k, renormalize, shared=True)
        expected_weights, expected_ids = route_with_shared_expert(stored, top_k, renormalize)
        np.testing.assert_array_equal(expert_ids, expected_ids)
        np.testing.assert_allclose(weights, expected_weights, rtol=0, atol=WEIGHT_ATOL)
        check_alignment(result, expected_ids, num_experts + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [4, 16])  # the warp's and the block's kernel
def test_route_align_with_idle_experts_and_one_expert_for_every_token(gpu, num_tokens):
    top_k, num_experts, hot = 8, 128, 77
    logits = separated_logits(np.random.default_rng(8), num_tokens, num_experts)
    logits[:, 20:] -= 50.0  # experts 20.. are never chosen
    logits[:, hot] += 100.0  # nor is expert 77 ever passed over
    check_route_align(gpu, gpu.upload(logits), top_k)
    _, expert_ids, result = route_align_on_device(gpu, gpu.upload(logits), top_k, True)
    assert (expert_ids[:, 0] == hot).all()
    counts = np.diff(result["offsets"])
    assert counts[hot] == num_tokens and counts[:20].sum() == num_tokens * (top_k - 1)


# ---- the whole chain in a CUDA graph ----

# A stand-in for the expert GEMMs that walks the alignment as they do:
# expert_out[row] = (e + 1) * x[token of row] for the rows of each active expert e.
FAKE_EXPERTS = """
__global__ void fake_experts(float* expert_out, const float* x, const int* offsets, const int* sorted_pairs,
                             const int* active_experts, const int* num_active, int top_k, int hidden) {
  if (blockIdx.x >= *num_active) return;
  const int expert = active_experts[blockIdx.x];
  for (int row = offsets[expert]; row < offsets[expert + 1]; ++row) {
    const int token = sorted_pairs[row] / top_k;
    for (int h = threadIdx.x; h < hidden; h += blockDim.x)
      expert_out[row * hidden + h] = (expert + 1) * x[token * hidden + h];
  }
}
"""


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [16, 1024])
def test_route_align_combine_replay_in_a_cuda_graph(gpu, compile_test_kernel, rel_error, tolerance, num_tokens):
    """16 tokens: the fused launch; 1024 (8192 pairs): routing, then the count and scatter kernels.
    Each replay routes new logits; the alignment must follow them exactly."""
    from sparkd.backend.cuda.graphs import capture

    top_k, num_experts, hidden = 8, 128, 256
    num_pairs = num_tokens * top_k
    fake_experts = compile_test_kernel(FAKE_EXPERTS, "fake_experts")
    logits = gpu.empty((num_tokens, num_experts), DType.bfloat16)
    x = gpu.empty((num_tokens, hidden), DType.float32)
    weights, expert_ids = gpu.empty((num_tokens, top_k), DType.float32), gpu.empty((num_tokens, top_k), DType.int32)
    alignment = poisoned_alignment(gpu, num_pairs, num_experts)
    expert_out = gpu.empty((num_pairs, hidden), DType.float32)
    out = gpu.empty((num_tokens, hidden), DType.float32)

    def moe_block():
        moe_routing.moe_route_align(weights, expert_ids, alignment, logits, True, gpu.stream)
        fake_experts.launch(min(num_experts, num_pairs), 128,
                            [expert_out, x, alignment.offsets, alignment.sorted_pairs, alignment.active_experts,
                             alignment.num_active, np.int32(top_k), np.int32(hidden)], stream=gpu.stream)
        moe_routing.moe_combine(out, expert_out, weights, alignment.row_of_pair, gpu.stream)

    rng = np.random.default_rng(6)

    def new_inputs():
        """Fresh logits and x on the device -> (the expected out, numpy's expert ids)."""
        host_logits = encode(separated_logits(rng, num_tokens, num_experts), DType.bfloat16)
        host_x = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
        copy_to_device(logits, host_logits, gpu.stream)
        copy_to_device(x, host_x, gpu.stream)
        gpu.stream.synchronize()  # the host arrays are pageable temporaries
        expected_weights, expected_ids = moe_route(decode(host_logits, DType.bfloat16), top_k, True)
        return ((expected_weights * (expected_ids + 1)).sum(axis=1, dtype=np.float64)[:, None] * host_x,
                expected_ids)

    def check(expected, expected_ids):
        assert rel_error(gpu.download(out), expected) <= tolerance["float32"]
        check_alignment(download_alignment(gpu, alignment), expected_ids, num_experts)

    expected, expected_ids = new_inputs()
    moe_block()  # eager first: loads the kernels outside the capture, as the warm-up does
    check(expected, expected_ids)
    graph, _ = capture(gpu.stream, moe_block)
    try:
        for _ in range(3):
            expected, expected_ids = new_inputs()
            graph.replay(gpu.stream)
            check(expected, expected_ids)
    finally:
        graph.destroy()
