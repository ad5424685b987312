"""The MoE router in one launch (cukernels/moe_router.cu: the router GEMV, then the routing and
alignment by its last block) against numpy.

- router_logits against the float64 product of the inputs as the device holds them:
  max |a - b| / max |b| <= 1e-5 in every dtype (the inputs are exact in fp32; only the order of
  the sums differs).
- weights, expert_ids and the whole alignment against the numpy twin (moe_route, then
  group_by_expert) run on the device's own logits, which isolates the GEMV's rounding from the
  routing: ids and alignment exactly, weights within 1e-6 (fp32 softmax on both sides); and bit
  for bit what moe_route_align, today's second launch, makes of those same logits.
- T = 1 to 4 tokens (no more than 32 // k) and 32 // k (the most one launch takes), E = 8 / 60
  / 128 / 256 with k = 1 / 2 / 8, E = 301 with k = 8, E = 512 with k = 2 and 10 (Qwen3-Next's),
  E = 1024 with k = 16 (the limits), K = 64 to 4104 (4104 fp32 at E >= 256 takes two passes), fp32
  / bf16 / fp16, router_input a column slice whose rows are spaced wider than K, renormalised or not.
  T * E <= 4096 routes by the whole last block (moe_route_block.cuh), more (E = 256 at T = 32,
  E = 512 at T = 16) by its first warp.
- The folded grid (router_grid, when a row's warps would not fit in one wave: E 301 / 512 / 1024
  at K 2048 fp32 or 4096, a warp playing two of the kernel's order warps, blocks of 16 warps) gives
  every output bit for bit as the grid of one order warp a warp, which sums in the kernel's order
  as it did before the fold; E 301 leaves the last block slots past E.
- Tied logits (repeated router rows, a zero token): ties go to the lower expert id on both paths.
- The arrival counter: launches back to back, of one shape and of three, and graph replays.
- The operands CudaOps.add_rmsnorm_for_router and router_weight make ([y | y_lo] and [W | W] in
  bf16 / fp16): the logits of the unrounded rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cpu.moe import moe_route, route_with_shared_expert
from sparkd.backend.cuda.kernels import moe_router
from sparkd.backend.cuda.kernels.moe_routing import MoeAlignment
from sparkd.backend.cuda.transfer import copy_to_device
from sparkd.backend.dtypes import DType, encode

from .moe_cases import (
    ALIGNMENT_VIEWS,
    POISON,
    ROUTER_EPS,
    check_alignment,
    download_alignment,
    poison_alignment,
    poisoned_alignment,
    route_align_on_device,
    router_case,
)

DTYPES = ["float32", "bfloat16", "float16"]
LOGITS_TOLERANCE = 1e-5
WEIGHT_ATOL = 1e-6
LOGIT_SCALE = 3.0  # logits ~ N(0, 9): numpy's fp32 softmax keeps distinct logits apart (no 0 or tied probabilities)


def random_router(rng, num_experts: int, width: int) -> np.ndarray:
    """router [E, K] float32 whose logits on unit-normal inputs are ~ N(0, LOGIT_SCALE**2)."""
    return rng.standard_normal((num_experts, width), dtype=np.float32) * np.float32(LOGIT_SCALE / np.sqrt(width))


class RouterCase:
    """router_input [T, K] (a column slice of a [T, K + 3 chunks] matrix) and router [E, K] on the
    device in `dtype`, their host copies as the device holds them, and the outputs' buffers."""

    def __init__(self, gpu, rng, num_tokens: int, num_experts: int, top_k: int, width: int, dtype: str,
                 shared: bool = False):
        """shared: the router has a row more, a shared expert's gate (Ops.sparse_moe's shared_expert)."""
        self.gpu, self.top_k, self.dtype, self.shared = gpu, top_k, DType.parse(dtype), shared
        self.chunk = 16 // self.dtype.itemsize
        rows, columns = num_experts + shared, top_k + shared
        self.wide = gpu.empty((num_tokens, width + 3 * self.chunk), self.dtype)
        self.router_input = self.wide.column_slice(self.chunk, width)
        self.router = gpu.empty((rows, width), self.dtype)
        self.router_logits = gpu.empty((num_tokens, rows), DType.float32)
        self.weights = gpu.empty((num_tokens, columns), DType.float32)
        self.expert_ids = gpu.empty((num_tokens, columns), DType.int32)
        self.alignment = poisoned_alignment(gpu, num_tokens * columns, rows)
        self.new_inputs(rng)

    def new_inputs(self, rng) -> None:
        """Fresh router_input and router."""
        num_experts, width = self.router.shape
        wide = rng.standard_normal(self.wide.shape, dtype=np.float32)
        self.set_inputs(wide, random_router(rng, num_experts, width))

    def set_inputs(self, wide: np.ndarray, router: np.ndarray) -> None:
        """router_input's matrix [T, K + 3 chunks] and router [E, K] (float32) on the device in the
        case's dtype; x and w: their host copies as held."""
        encoded = [encode(wide, self.dtype), encode(router, self.dtype)]
        for dst, host in zip((self.wide, self.router), encoded):
            copy_to_device(dst, host, self.gpu.stream)
        self.gpu.stream.synchronize()  # `encoded` is pageable: let the copies land before it goes
        self.x = self.gpu.download(self.router_input).astype(np.float64)
        self.w = self.gpu.download(self.router).astype(np.float64)

    def poison_outputs(self) -> None:
        """NaN logits and weights, POISON ids and alignment: a launch must overwrite them."""
        outputs = (self.router_logits, self.weights, self.expert_ids)
        poison = [np.full(dst.shape, value, dst.dtype.host) for dst, value in zip(outputs, (np.nan, np.nan, POISON))]
        for dst, host in zip(outputs, poison):
            copy_to_device(dst, host, self.gpu.stream)
        poison_alignment(self.gpu, self.alignment)  # synchronizes the stream while `poison` is alive

    def launch(self, renormalize: bool) -> None:
        moe_router.moe_router_route_align(self.weights, self.expert_ids, self.alignment, self.router_logits,
                                          self.router_input, self.router, renormalize, self.gpu.stream, self.shared)

    def check(self, rel_error, renormalize: bool) -> None:
        """The logits against float64; the routing against numpy on the device's logits and, bit for
        bit, against moe_route_align on them."""
        logits = self.gpu.download(self.router_logits)
        assert rel_error(logits, self.x @ self.w.T) <= LOGITS_TOLERANCE
        weights, expert_ids = self.gpu.download(self.weights), self.gpu.download(self.expert_ids)
        alignment = download_alignment(self.gpu, self.alignment)
        route = route_with_shared_expert if self.shared else moe_route
        expected_weights, expected_ids = route(logits, self.top_k, renormalize)
        np.testing.assert_array_equal(expert_ids, expected_ids)
        np.testing.assert_allclose(weights, expected_weights, rtol=0, atol=WEIGHT_ATOL)
        check_alignment(alignment, expected_ids, self.router.shape[0])

        two_launch_weights, two_launch_ids, two_launch_alignment = route_align_on_device(
            self.gpu, self.router_logits, self.top_k, renormalize, self.shared)
        np.testing.assert_array_equal(weights, two_launch_weights)
        np.testing.assert_array_equal(expert_ids, two_launch_ids)
        for name, values in two_launch_alignment.items():  # both poisoned before their launch: all of it
            np.testing.assert_array_equal(alignment[name], values, err_msg=name)

    def run_and_check(self, rel_error, renormalize: bool) -> None:
        self.poison_outputs()
        self.launch(renormalize)
        self.check(rel_error, renormalize)


# (512, 2) at T = 16 (8192 logits) takes the one-warp path at a large E; (512, 10) is
# Qwen3-Next's router and (1024, 16) the limits, whole blocks at T <= 3 and T <= 2; (301, 8) a
# folded grid whose last block has slots past E.
SHAPES = [(num_experts, top_k) for num_experts in (8, 60, 128, 256) for top_k in (1, 2, 8)] + [
    (301, 8), (512, 2), (512, 10), (1024, 16)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 2048, 4096, 4104])
@pytest.mark.parametrize("num_experts,top_k", SHAPES)
def test_router_matches_numpy(gpu, rel_error, dtype, width, num_experts, top_k):
    """T = 1, 2, 3, 4 and 32 // k tokens (those of T * k <= 32), each renormalised and not. E = 60
    with K = 64 leaves the last block slots past E; K = 2048 in bf16 puts two experts in a block."""
    rng = np.random.default_rng(num_experts * 10000 + top_k * 1000 + width)
    for num_tokens in sorted({1, 2, 3, 4, 32 // top_k} & set(range(1, 32 // top_k + 1))):
        case = RouterCase(gpu, rng, num_tokens, num_experts, top_k, width, dtype)
        for renormalize in (False, True):
            case.run_and_check(rel_error, renormalize)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (128, 8), (512, 10), (1023, 15)])
def test_router_with_a_shared_expert_matches_numpy(gpu, rel_error, dtype, num_experts, top_k):
    """A router row more, a shared expert's gate: the E + 1 logits, then route_with_shared_expert's
    pairs and their alignment over E + 1 experts, at every T with T (k + 1) <= 32; (512, 10) is
    Qwen3-Next's, whose last block routes with all its threads at T <= 7, and (1023, 15) the limits."""
    rng = np.random.default_rng(num_experts * 100 + top_k)
    for num_tokens in range(1, 32 // (top_k + 1) + 1):
        case = RouterCase(gpu, rng, num_tokens, num_experts, top_k, 2048, dtype, shared=True)
        for renormalize in (False, True):
            case.run_and_check(rel_error, renormalize)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_experts,top_k", [(60, 8), (128, 8), (512, 2), (512, 10), (1024, 16)])
def test_router_breaks_ties_to_the_lower_expert(gpu, rel_error, dtype, num_experts, top_k):
    """Tied logits, bit for bit: token 0's input is zero (every logit 0, so the choices are
    experts 0 to k - 1), and router rows repeat (E // 4 distinct rows, each at random experts;
    every expert's sums run in one order, so repeated rows give equal logits), which ties
    experts across segments and around the k-th choice. T = 2 and 32 // k: the whole block,
    and for (512, 2) at T = 16 the one warp."""
    rng = np.random.default_rng(num_experts * 100 + top_k)
    width = 2048  # bf16: two experts a block of 4 warps each; fp32: one expert of 8 warps
    for num_tokens in sorted({2, 32 // top_k}):
        case = RouterCase(gpu, rng, num_tokens, num_experts, top_k, width, dtype)
        wide = rng.standard_normal(case.wide.shape, dtype=np.float32)
        wide[0] = 0.0
        distinct = random_router(rng, num_experts // 4, width)
        case.set_inputs(wide, distinct[rng.integers(0, len(distinct), num_experts)])
        for renormalize in (False, True):
            case.run_and_check(rel_error, renormalize)
        logits = gpu.download(case.router_logits)
        assert np.all(logits[0] == 0.0)
        np.testing.assert_array_equal(gpu.download(case.expert_ids)[0], np.arange(top_k))
        for row in logits[1:]:  # the ties are there to break
            assert len(np.unique(row)) < num_experts


def outputs(case: RouterCase) -> dict[str, np.ndarray]:
    """Every output of the case's last launch, by name."""
    named = {"router_logits": case.router_logits, "weights": case.weights, "expert_ids": case.expert_ids}
    downloaded = {name: case.gpu.download(tensor) for name, tensor in named.items()}
    return {**downloaded, **download_alignment(case.gpu, case.alignment)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,width", [("bfloat16", 4096), ("float32", 2048), ("float32", 4104)])
@pytest.mark.parametrize("num_experts,top_k", [(301, 8), (512, 10), (1024, 16)])
def test_router_folded_grid_sums_as_the_unfolded_one(gpu, rel_error, monkeypatch, dtype, width, num_experts,
                                                     top_k):
    """router_grid folds these rows (fewer warps an expert, 16-warp blocks); without the fold
    (_WAVE_WARPS past any E) each warp is one order warp, as in every grid before the fold: the
    logits, and so the routing and alignment, are the same bits. T = 1, 2 and 32 // k, renormalised."""
    chunks = width * DType.parse(dtype).itemsize // 16
    with monkeypatch.context() as patch:
        patch.setattr(moe_router, "_WAVE_WARPS", 1 << 30)  # every grid fits: no fold
        unfolded_grid = moe_router.router_grid(num_experts, chunks)
    folded_grid = moe_router.router_grid(num_experts, chunks)
    assert folded_grid[1] == 512 and 2 * folded_grid[2] == unfolded_grid[2]
    rng = np.random.default_rng(num_experts + width)
    for num_tokens in sorted({1, 2, 32 // top_k}):
        case = RouterCase(gpu, rng, num_tokens, num_experts, top_k, width, dtype)
        case.run_and_check(rel_error, renormalize=True)
        folded = outputs(case)
        with monkeypatch.context() as patch:
            patch.setattr(moe_router, "router_grid", lambda *_: unfolded_grid)
            case.run_and_check(rel_error, renormalize=True)
        for name, values in outputs(case).items():
            np.testing.assert_array_equal(folded[name], values, err_msg=name)


@pytest.mark.gpu
def test_router_counter_resets_for_the_next_launch(gpu, rel_error):
    """The blocks count themselves in on one device counter that the last block resets: the same
    launch twice in a row, then shapes of different grids (128 blocks of 8 warps, one, 128 of 16)
    back to back, and again. A counter left behind would make no block the last one, and leave the
    outputs poisoned."""
    rng = np.random.default_rng(11)
    decode = RouterCase(gpu, rng, 1, 128, 8, 4096, "bfloat16")
    small = RouterCase(gpu, rng, 16, 8, 2, 64, "float32")
    folded = RouterCase(gpu, rng, 2, 512, 10, 4096, "bfloat16")
    for case in (decode, decode, small, decode, small, small, folded, decode, folded):
        case.new_inputs(rng)
        case.run_and_check(rel_error, renormalize=True)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_router_replays_in_a_cuda_graph(gpu, rel_error, num_tokens):
    """Captured once, replayed on new inputs copied into its buffers: every replay routes them."""
    from sparkd.backend.cuda.graphs import capture

    rng = np.random.default_rng(12)
    case = RouterCase(gpu, rng, num_tokens, 128, 8, 4096, "bfloat16")
    case.launch(renormalize=True)  # loads the kernel outside the capture, as the warm-up does
    graph, _ = capture(gpu.stream, lambda: case.launch(renormalize=True))
    try:
        for _ in range(3):
            case.new_inputs(rng)
            case.poison_outputs()
            graph.replay(gpu.stream)
            case.check(rel_error, renormalize=True)
    finally:
        graph.destroy()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_router_on_the_rows_add_rmsnorm_for_router_writes(cuda_ops_factory, rel_error, dtype, num_tokens):
    """router_input and router as CudaOps makes them for sparse_moe ([y | y_lo] and [W | W] in bf16 /
    fp16, y and W in fp32): the logits of the normed rows before their rounding, as NumpyOps
    computes them in fp32, to 1e-5; the routing that of numpy on the device's logits."""
    ops = cuda_ops_factory(dtype)
    hidden, num_experts, top_k = 2048, 128, 8
    case = router_case(ops, np.random.default_rng(13 + num_tokens), num_tokens, hidden, num_experts)

    _, router_input, _ = ops.add_rmsnorm_for_router(case.x, case.residual, case.norm_weight, ROUTER_EPS)
    router_logits = ops.allocator.empty((num_tokens, num_experts), DType.float32)
    weights = ops.allocator.empty((num_tokens, top_k), DType.float32)
    expert_ids = ops.allocator.empty((num_tokens, top_k), DType.int32)
    alignment = MoeAlignment.allocate(ops.allocator, num_tokens * top_k, num_experts)
    moe_router.moe_router_route_align(weights, expert_ids, alignment, router_logits, router_input,
                                      ops.router_weight(case.router), True, ops.stream)

    logits = ops.download(router_logits)
    assert rel_error(logits, case.expected_logits) <= LOGITS_TOLERANCE
    expected_weights, expected_ids = moe_route(logits, top_k, True)
    np.testing.assert_array_equal(ops.download(expert_ids), expected_ids)
    np.testing.assert_allclose(ops.download(weights), expected_weights, rtol=0, atol=WEIGHT_ATOL)
    check_alignment({name: ops.download(getattr(alignment, name)) for name in ALIGNMENT_VIEWS}, expected_ids,
                    num_experts)
