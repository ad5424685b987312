"""A MoE layer's router at decode in one launch (cukernels/moe_router.cu):

  moe_router_route_align(weights, expert_ids, alignment, router_logits, router_input, router,
                         renormalize, stream)
      router_logits [T, E] float32 = router_input [T, K] @ router [E, K]^T (fp32 accumulation),
      then what moe_routing.moe_route_align makes of them (weights, expert_ids, the alignment),
      bit for bit, for a decode step's T * k <= WARP_MAX_PAIRS pairs.

It replaces the router GEMM and moe_route_align's one-warp launch: the GEMV's blocks spread
the router's rows over the SMs, and the block that finishes last routes and aligns.
"""

from __future__ import annotations

import numpy as np

from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream
from ..tensor import DeviceTensor
from . import ACCESS_BYTES, ELEMENT_TYPES, i32, require, require_contiguous, require_dtype, row_stride
from .moe_routing import WARP_MAX_PAIRS, MoeAlignment, check_route_align

_SOURCE = "moe_router.cu"
_ORDER_CHUNKS = 2  # kRouterOrderChunks: a row's chunks each of the kernel's order threads adds up
_MAX_WARPS = 16  # kRouterMaxWarps: the most warps a block has, and the 16 an SM holds (its launch bound)
_MAX_FOLDS = 2  # kRouterMaxFolds
_BLOCK_WARPS = 8  # short rows: experts share blocks of this many warps
_WAVE_WARPS = 16 * 128  # the warps one wave holds: 16 an SM on 128 SMs, about an H100's or H200's 132


def _spec(dtype: DType) -> KernelSpec:
    return KernelSpec(_SOURCE, f"moe_router_route_align_kernel<{dtype.c_type}>")


SPECS = [_spec(dtype) for dtype in ELEMENT_TYPES]


def router_grid(num_experts: int, num_chunks: int) -> tuple[int, int, int]:
    """(blocks, threads per block, warps per expert) for E router rows of `num_chunks` 16-byte
    chunks. The kernel's order of sums splits a row over the warps (up to _MAX_WARPS) that give a
    thread _ORDER_CHUNKS chunks of it, and the grid gives each row that many warps, every load in
    flight at once; rows that need fewer than _BLOCK_WARPS warps share a block. E 128, K 4096 bf16:
    128 blocks of 8 warps, about one an H200 SM. When those warps would not fit in one wave, a warp
    plays two of them (the same sums, twice the chunks a thread) and experts share blocks of
    _MAX_WARPS warps, one an SM: E 512, K 4096 bf16, 128 blocks of 4 experts of 4 warps, not 512
    blocks of 8 warps in two waves."""
    warps_per_expert = min(_MAX_WARPS, max(1, -(-num_chunks // (32 * _ORDER_CHUNKS))))
    if num_experts * warps_per_expert <= _WAVE_WARPS or warps_per_expert % _MAX_FOLDS:
        experts_per_block = max(1, _BLOCK_WARPS // warps_per_expert)
    else:
        warps_per_expert //= _MAX_FOLDS
        experts_per_block = _MAX_WARPS // warps_per_expert
    return -(-num_experts // experts_per_block), 32 * warps_per_expert * experts_per_block, warps_per_expert


def unsupported_reason(router_input: DeviceTensor, router: DeviceTensor) -> str | None:
    """Why the kernel's 16-byte loads cannot read router_input [T, K] and router [E, K] (2-D, of
    one float dtype), or None when they can."""
    chunk = ACCESS_BYTES // router_input.dtype.itemsize
    k, stride = router_input.shape[1], row_stride(router_input)
    if k % chunk or stride % chunk:
        return (f"moe_router reads 16-byte chunks: K ({k}) and router_input's row stride ({stride}) must be "
                f"multiples of {chunk} for {router_input.dtype.name}")
    if router_input.ptr % ACCESS_BYTES or router.ptr % ACCESS_BYTES:
        return (f"moe_router needs router_input and router 16-byte aligned, got router_input at "
                f"0x{router_input.ptr:x}, router at 0x{router.ptr:x}")
    return None


def moe_router_route_align(weights: DeviceTensor, expert_ids: DeviceTensor, alignment: MoeAlignment,
                           router_logits: DeviceTensor, router_input: DeviceTensor, router: DeviceTensor,
                           renormalize: bool, stream: Stream, shared_expert: bool = False) -> None:
    """router_logits [T, E] float32 (contiguous) = router_input [T, K] @ router [E, K]^T, then
    weights [T, k] float32, expert_ids [T, k] int32 and `alignment` (sized for T*k pairs and E
    experts) as moe_routing.moe_route_align makes them from those logits (shared_expert as
    there: router's last row is the shared expert's gate); one launch, graph-capturable, for
    T * k <= WARP_MAX_PAIRS (k counting the shared expert's pair).

    router_input and router share a dtype (float32 / float16 / bfloat16); router_input's rows
    may be spaced (a column slice), router is contiguous; K and the row stride are whole
    16-byte chunks and both start 16-byte aligned (`unsupported_reason`). Launches must not
    overlap: the kernel's blocks count themselves in on one device counter (sparkd routes on the
    main stream only: `Ops.beside` side work never routes)."""
    require(router_input.ndim == 2 and router.ndim == 2,
            f"router_input must be [T, K] and router [E, K], got shapes {router_input.shape} and {router.shape}")
    require_dtype("router_input", router_input, *ELEMENT_TYPES)
    require_dtype("router", router, router_input.dtype)
    (num_tokens, k), num_experts = router_input.shape, router.shape[0]
    require(router.shape[1] == k, f"router must be [E, K={k}] like router_input's K, got shape {router.shape}")
    require(router_input.strides[1] == 1,
            f"router_input needs unit column stride, got strides {router_input.strides}")
    require_contiguous("router", router)
    require(router_logits.shape == (num_tokens, num_experts),
            f"router_logits must be [T={num_tokens}, E={num_experts}], got shape {router_logits.shape}")
    require_dtype("router_logits", router_logits, DType.float32)
    require_contiguous("router_logits", router_logits)
    check_route_align(weights, expert_ids, alignment, router_logits, shared_expert)
    pairs_per_token = weights.shape[1]
    require(num_tokens * pairs_per_token <= WARP_MAX_PAIRS,
            f"moe_router routes at most {WARP_MAX_PAIRS} (token, expert) pairs, got T={num_tokens} * "
            f"top_k={pairs_per_token - shared_expert}{' + 1' if shared_expert else ''} = "
            f"{num_tokens * pairs_per_token}: run the router GEMM, then moe_route_align")
    reason = unsupported_reason(router_input, router)
    require(reason is None, reason)
    blocks, threads, warps_per_expert = router_grid(num_experts, k // (ACCESS_BYTES // router.dtype.itemsize))
    args = [weights, expert_ids, *alignment.outputs(), router_logits, router_input, router, i32(num_tokens),
            i32(num_experts), i32(pairs_per_token - shared_expert), i32(k), np.int64(row_stride(router_input)),
            i32(warps_per_expert), i32(bool(renormalize)), i32(bool(shared_expert))]
    get_kernel(_spec(router_input.dtype)).launch(blocks, threads, args, stream=stream)
