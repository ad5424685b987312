"""Mixture-of-experts launchers around the expert GEMMs (cukernels/moe_routing.cu).

A MoE block on the device runs, all on one stream and graph-capturable:
  moe_route_align(weights, expert_ids, alignment, router_logits, renormalize, stream)
      router_logits [T, E] -> weights [T, k] float32, expert_ids [T, k] int32
      (the twin of sparkd.backend.cpu.moe.moe_route), and the T*k (token, expert)
      pairs sorted by expert into a `MoeAlignment` (the twin of group_by_expert, plus
      the inverse map and the active experts): one launch up to FUSED_MAX_TOKENS
      tokens (one warp's up to WARP_MAX_PAIRS pairs), else moe_route then moe_align;
      up to WARP_MAX_PAIRS pairs, moe_router.moe_router_route_align runs the router GEMM
      that makes router_logits and all of this in one launch;
  the expert GEMMs (moe_gemm.py), writing expert_out [P, H] in the activations' dtype, in
      expert order;
  moe_combine(out, expert_out, weights, row_of_pair, stream)
      out[t] = sum_j weights[t, j] * expert_out[row_of_pair[t*k + j]] in fp32, [T, H].
moe_route and moe_align also run alone (ids that did not come from the device's routing).
Pair p = t*k + j is token t's j-th choice; P = T*k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream
from ..memory import DeviceAllocator
from ..tensor import DeviceTensor
from . import (
    ELEMENT_TYPES,
    element_name,
    element_specs,
    i32,
    require,
    require_contiguous,
    require_dtype,
    round_up,
    vector_width,
)

_SOURCE = "moe_routing.cu"
MAX_EXPERTS = 1024  # kMaxExperts
MAX_TOP_K = 16  # kMaxTopK
# kMaxFusedTokens: routing and alignment in one launch up to here. Measured on the H200
# (tools/bench_moe_routing.py, E 128, k 8): at 1 token 5.8 us against 6.0 us for the two
# launches, at 64 tokens 18.3 us against 7.5 us (one block routes them 4 a warp); at up
# to 16 every routing warp has one token at most, as at 1.
FUSED_MAX_TOKENS = 16
WARP_MAX_PAIRS = 32  # up to here one warp routes and aligns (moe_route_align_warp_kernel), a pair a lane
ONE_BLOCK_MAX_PAIRS = 2048  # more pairs are aligned by the count and scatter kernels
_ROUTE_WARPS = 4  # kRouteWarps: tokens per block
_RANK_THREADS = 256  # kRankThreads: the alignment blocks
_FUSED_THREADS = 512  # kFusedThreads
# The scatter kernel's every block reads all blocks' counts [blocks, E]: a few
# thousand ints keep that one L2 round trip per thread or so, while at least
# _MIN_COUNT_BLOCKS keep the ranking short when E is large.
_COUNTS_BUDGET = 4096
_MIN_COUNT_BLOCKS = 16
_COMBINE_THREADS = 256

_ALIGN = KernelSpec(_SOURCE, "moe_align_kernel")
_ALIGN_COUNT = KernelSpec(_SOURCE, "moe_align_count_kernel")
_ALIGN_SCATTER = KernelSpec(_SOURCE, "moe_align_scatter_kernel")


def _route_spec(dtype: DType) -> KernelSpec:
    return KernelSpec(_SOURCE, f"moe_route_kernel<{dtype.c_type}>")


def _route_align_spec(dtype: DType) -> KernelSpec:
    return KernelSpec(_SOURCE, f"moe_route_align_kernel<{dtype.c_type}>")


def _route_align_warp_spec(dtype: DType) -> KernelSpec:
    return KernelSpec(_SOURCE, f"moe_route_align_warp_kernel<{dtype.c_type}>")


SPECS = ([spec(dtype) for spec in (_route_spec, _route_align_spec, _route_align_warp_spec)
          for dtype in ELEMENT_TYPES]
         + [_ALIGN, _ALIGN_COUNT, _ALIGN_SCATTER]
         + element_specs(_SOURCE, "moe_combine_kernel"))


def _check_route(weights: DeviceTensor, expert_ids: DeviceTensor, router_logits: DeviceTensor,
                 shared_expert: bool = False) -> None:
    require(router_logits.ndim == 2, f"router_logits must be [T, E], got shape {router_logits.shape}")
    require_dtype("router_logits", router_logits, *ELEMENT_TYPES)
    require(router_logits.strides[1] == 1 or router_logits.shape[1] == 1,
            f"router_logits needs unit column stride, got strides {router_logits.strides}")
    num_tokens, columns = router_logits.shape
    require(1 <= columns - shared_expert and columns <= MAX_EXPERTS,
            f"moe_route handles 1 to {MAX_EXPERTS} experts, got E = {columns}"
            + (" counting the shared expert" if shared_expert else ""))
    num_experts = columns - shared_expert
    require(weights.ndim == 2 and weights.shape[0] == num_tokens,
            f"weights must be [T={num_tokens}, top_k{' + 1' if shared_expert else ''}], got shape {weights.shape}")
    top_k = weights.shape[1] - shared_expert
    require(1 <= top_k <= min(num_experts, MAX_TOP_K - shared_expert),
            f"top_k must be between 1 and min(E={num_experts}, {MAX_TOP_K - shared_expert}), got {top_k}")
    require(expert_ids.shape == weights.shape,
            f"expert_ids must be [T, top_k] = {weights.shape} like weights, got {expert_ids.shape}")
    require_dtype("weights", weights, DType.float32)
    require_dtype("expert_ids", expert_ids, DType.int32)
    require_contiguous("weights", weights)
    require_contiguous("expert_ids", expert_ids)


def _route_args(router_logits: DeviceTensor, top_k: int, renormalize: bool, shared_expert: bool) -> list:
    """The routing kernels' trailing arguments: logits, T, E (the routed experts), k, row stride,
    renormalize, shared."""
    num_tokens, columns = router_logits.shape
    row_stride = router_logits.row_stride if num_tokens > 1 else columns
    return [router_logits, i32(num_tokens), i32(columns - shared_expert), i32(top_k), np.int64(row_stride),
            i32(bool(renormalize)), i32(bool(shared_expert))]


def moe_route(weights: DeviceTensor, expert_ids: DeviceTensor, router_logits: DeviceTensor, renormalize: bool,
              stream: Stream, shared_expert: bool = False) -> None:
    """Each token's top-k experts: router_logits [T, E] (float32/float16/bfloat16, rows
    may be spaced) -> weights [T, k] float32, expert_ids [T, k] int32, both contiguous.

    fp32 softmax over E, the k largest probabilities in descending order, ties to
    the lower expert id; with `renormalize` divided by their sum. E <= 1024, k <= 16.
    With shared_expert, router_logits [T, E + 1] end in a shared expert's gate: each token's
    k choices of the first E are followed by expert E, weighted sigmoid(logit E) (weights
    and expert_ids [T, k + 1]; the twin of cpu.moe.route_with_shared_expert)."""
    _check_route(weights, expert_ids, router_logits, shared_expert)
    num_tokens = router_logits.shape[0]
    if num_tokens == 0:
        return
    top_k = weights.shape[1] - shared_expert
    get_kernel(_route_spec(router_logits.dtype)).launch(
        -(-num_tokens // _ROUTE_WARPS), 32 * _ROUTE_WARPS,
        [weights, expert_ids, *_route_args(router_logits, top_k, renormalize, shared_expert)], stream=stream)


def align_grid(num_pairs: int, num_experts: int) -> tuple[int, int]:
    """(blocks, pairs per block) of an alignment: one block for up to ONE_BLOCK_MAX_PAIRS
    pairs, else the count and scatter kernels' grid, chunks a multiple of their block."""
    if num_pairs <= ONE_BLOCK_MAX_PAIRS:
        return 1, num_pairs
    blocks = min(-(-num_pairs // _RANK_THREADS), max(_MIN_COUNT_BLOCKS, _COUNTS_BUDGET // num_experts))
    chunk = round_up(-(-num_pairs // blocks), _RANK_THREADS)
    return -(-num_pairs // chunk), chunk


@dataclass
class MoeAlignment:
    """The T*k pairs sorted by expert, for P pairs and E experts; int32 views of one
    allocation, written whole by `moe_align` (or `moe_route_align`):

    offsets [E+1]              rows of expert e are offsets[e] .. offsets[e+1]-1;
    sorted_pairs [P]           the pair in each row, ascending within an expert (a stable
                               sort by expert: group_by_expert's order);
    row_of_pair [P]            the row of each pair (the inverse of sorted_pairs);
    active_experts [min(E, P)] the experts with >= 1 pair, ascending; entries from
                               num_active on are unused;
    num_active [1]             how many experts have pairs;
    block_counts [blocks * E]  scratch of the count and scatter kernels (empty when
                               one block aligns, see `align_grid`)."""

    offsets: DeviceTensor
    sorted_pairs: DeviceTensor
    row_of_pair: DeviceTensor
    active_experts: DeviceTensor
    num_active: DeviceTensor
    block_counts: DeviceTensor

    @property
    def num_pairs(self) -> int:
        return self.sorted_pairs.shape[0]

    @property
    def num_experts(self) -> int:
        return self.offsets.shape[0] - 1

    @classmethod
    def allocate(cls, allocator: DeviceAllocator, num_pairs: int, num_experts: int) -> MoeAlignment:
        require(num_pairs >= 0, f"num_pairs must not be negative, got {num_pairs}")
        require(1 <= num_experts <= MAX_EXPERTS, f"moe_align handles 1 to {MAX_EXPERTS} experts, got E = {num_experts}")
        blocks, _ = align_grid(num_pairs, num_experts)
        sizes = [num_experts + 1, num_pairs, num_pairs, min(num_experts, num_pairs), 1,
                 blocks * num_experts if blocks > 1 else 0]
        storage = allocator.empty((sum(sizes),), DType.int32)
        views, offset = [], 0
        for size in sizes:
            views.append(DeviceTensor(storage.ptr + 4 * offset, (size,), DType.int32, None, storage.owner))
            offset += size
        return cls(*views)

    def outputs(self) -> list[DeviceTensor]:
        """The kernels' leading arguments: offsets, sorted_pairs, row_of_pair, active_experts, num_active."""
        return [self.offsets, self.sorted_pairs, self.row_of_pair, self.active_experts, self.num_active]


def moe_align(alignment: MoeAlignment, expert_ids: DeviceTensor, stream: Stream) -> None:
    """Sort the pairs of expert_ids [T, k] int32 (contiguous, ids in [0, E)) by expert into
    `alignment` (sized for P = T*k pairs and E experts): one launch for up to
    ONE_BLOCK_MAX_PAIRS pairs, else two (count, scatter) over many blocks. No host sync.

    A pair whose id lies outside [0, E) gets row -1 and no row (the device cannot raise)."""
    require_dtype("expert_ids", expert_ids, DType.int32)
    require_contiguous("expert_ids", expert_ids)
    num_pairs, num_experts = alignment.num_pairs, alignment.num_experts
    require(expert_ids.numel == num_pairs,
            f"expert_ids has {expert_ids.numel} pairs but the alignment is sized for {num_pairs}")
    blocks, chunk = align_grid(num_pairs, num_experts)
    if blocks == 1:
        get_kernel(_ALIGN).launch(
            1, _RANK_THREADS, [*alignment.outputs(), expert_ids, i32(num_pairs), i32(num_experts)], stream=stream)
        return
    sizes = [expert_ids, i32(num_pairs), i32(num_experts), i32(chunk)]
    get_kernel(_ALIGN_COUNT).launch(
        blocks, _RANK_THREADS, [alignment.block_counts, alignment.row_of_pair, *sizes], stream=stream)
    get_kernel(_ALIGN_SCATTER).launch(
        blocks, _RANK_THREADS, [*alignment.outputs(), alignment.block_counts, *sizes], stream=stream)


def check_route_align(weights: DeviceTensor, expert_ids: DeviceTensor, alignment: MoeAlignment,
                      router_logits: DeviceTensor, shared_expert: bool = False) -> None:
    """The operand rules of a routing with its alignment (moe_route_align, and moe_router's
    launch, which writes router_logits first): moe_route's, and `alignment` sized for the
    T*k pairs of E experts (with a shared expert, T*(k + 1) pairs of E + 1)."""
    _check_route(weights, expert_ids, router_logits, shared_expert)
    num_tokens, num_experts = router_logits.shape
    num_pairs = num_tokens * weights.shape[1]
    require((alignment.num_pairs, alignment.num_experts) == (num_pairs, num_experts),
            f"the alignment is sized for {alignment.num_pairs} pairs of {alignment.num_experts} experts, the routing "
            f"makes {num_pairs} pairs of {num_experts}")


def moe_route_align(weights: DeviceTensor, expert_ids: DeviceTensor, alignment: MoeAlignment,
                    router_logits: DeviceTensor, renormalize: bool, stream: Stream,
                    shared_expert: bool = False) -> None:
    """`moe_route` (shared_expert as there) then `moe_align` of its expert_ids into `alignment`
    (sized for all the pairs and experts), with the same results; in one launch up to
    WARP_MAX_PAIRS pairs or FUSED_MAX_TOKENS tokens."""
    check_route_align(weights, expert_ids, alignment, router_logits, shared_expert)
    num_tokens = router_logits.shape[0]
    top_k = weights.shape[1] - shared_expert
    args = [weights, expert_ids, *alignment.outputs(), *_route_args(router_logits, top_k, renormalize, shared_expert)]
    if alignment.num_pairs <= WARP_MAX_PAIRS:
        get_kernel(_route_align_warp_spec(router_logits.dtype)).launch(1, 32, args, stream=stream)
    elif num_tokens <= FUSED_MAX_TOKENS:
        get_kernel(_route_align_spec(router_logits.dtype)).launch(1, _FUSED_THREADS, args, stream=stream)
    else:
        moe_route(weights, expert_ids, router_logits, renormalize, stream, shared_expert)
        moe_align(alignment, expert_ids, stream)


def moe_combine(out: DeviceTensor, expert_out: DeviceTensor, weights: DeviceTensor, row_of_pair: DeviceTensor,
                stream: Stream) -> None:
    """out[t] = sum_j weights[t, j] * expert_out[row_of_pair[t*k + j]], j = 0..k-1 in fp32, rounded
    to out's dtype once: out [T, H] (float32/float16/bfloat16), expert_out [P, H] in out's dtype,
    weights [T, k] float32, row_of_pair [P] int32 (a `MoeAlignment`'s); all contiguous."""
    require(out.ndim == 2 and expert_out.ndim == 2 and weights.ndim == 2,
            f"out [T, H], expert_out [P, H] and weights [T, k] must be 2-D, got {out.shape}, {expert_out.shape}, "
            f"{weights.shape}")
    num_tokens, hidden = out.shape
    top_k = weights.shape[1]
    num_pairs = num_tokens * top_k
    require(weights.shape[0] == num_tokens, f"weights must be [T={num_tokens}, k], got shape {weights.shape}")
    require(expert_out.shape == (num_pairs, hidden),
            f"expert_out must be [T*k, H] = {(num_pairs, hidden)}, got {expert_out.shape}")
    require(row_of_pair.shape == (num_pairs,), f"row_of_pair must be [T*k] = [{num_pairs}], got {row_of_pair.shape}")
    require_dtype("out", out, *ELEMENT_TYPES)
    require_dtype("expert_out", expert_out, out.dtype)
    require_dtype("weights", weights, DType.float32)
    require_dtype("row_of_pair", row_of_pair, DType.int32)
    for name, tensor in (("out", out), ("expert_out", expert_out), ("weights", weights), ("row_of_pair", row_of_pair)):
        require_contiguous(name, tensor)
    if out.numel == 0:
        return
    width = vector_width(out.dtype, (out, expert_out), (hidden,))  # 16-byte loads of expert_out and stores of out
    threads = min(_COMBINE_THREADS, round_up(hidden // width, 32))
    get_kernel(KernelSpec(_SOURCE, element_name("moe_combine_kernel", out.dtype, width))).launch(
        (num_tokens, -(-hidden // (width * threads))), threads,
        [out, expert_out, weights, row_of_pair, i32(hidden), i32(top_k)], stream=stream)
