"""The mixture-of-experts `Ops` on CUDA: the router weight's form, routing, alignment and the
expert GEMMs (GEMV-style at decode sizes, grouped on the tensor cores for prefill), through
`kernels/moe_*.py`.

`CudaOps` takes these methods from `MoeOps`; they use its allocator, stream, gemm, device,
download, upload and linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dtypes import DType
from .kernels import moe_gemm, moe_grouped_gemm, moe_grouped_wgmma, moe_router, moe_routing
from .tensor import DeviceTensor


@dataclass(frozen=True)
class ExpertSum:
    """What `MoeOps.sparse_moe` returns: the MoE block's output [T, H] before its combine, as its
    (token, expert) pairs' rows expert_out [P, H] (model dtype), weights [T, k] float32 and
    row_of_pair [P] int32. The next layer's input norm sums them itself (`CudaOps.add_rmsnorm`:
    norm.combine_add_rmsnorm), which saves a launch at every MoE layer; any other op that takes
    the block's output gets them combined first (`MoeOps.combined`)."""

    expert_out: DeviceTensor
    weights: DeviceTensor
    row_of_pair: DeviceTensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.weights.shape[0], self.expert_out.shape[1]

    @property
    def dtype(self) -> DType:
        return self.expert_out.dtype


class MoeOps:
    """Mixed into CudaOps."""

    def router_weight(self, router: DeviceTensor, shared_gate: DeviceTensor | None = None) -> DeviceTensor:
        """[W | W] [E, 2H] in the model dtype beside add_rmsnorm_for_router's split rows (bf16 / fp16:
        its products are exact in the fp32 accumulator); W itself in fp32. A shared_gate [1, H] is
        appended to W first (row E)."""
        if router.dtype is DType.float32 and shared_gate is None:
            return router
        weight = self.download(router)
        if shared_gate is not None:
            weight = np.concatenate([weight, self.download(shared_gate)])
        if router.dtype is not DType.float32:
            weight = np.concatenate([weight, weight], axis=1)
        return self.upload(weight, router.dtype)

    def moe_route(self, router_logits: DeviceTensor, top_k: int, renormalize: bool) -> tuple[DeviceTensor, DeviceTensor]:
        weights, expert_ids = self._routing_outputs(router_logits.shape[0], router_logits.shape[1], top_k)
        moe_routing.moe_route(weights, expert_ids, router_logits, renormalize, self.stream)
        return weights, expert_ids

    def moe_experts(self, x: DeviceTensor, gate_up: DeviceTensor, down: DeviceTensor, weights: DeviceTensor,
                    expert_ids: DeviceTensor) -> DeviceTensor:
        """Align the (token, expert) pairs by expert, then `_aligned_experts`: no host sync, capturable."""
        if weights.shape != expert_ids.shape:
            raise ValueError(f"weights {weights.shape} and expert_ids {expert_ids.shape} must both be [T, k]")
        alignment = moe_routing.MoeAlignment.allocate(self.allocator, expert_ids.numel, gate_up.shape[0])
        moe_routing.moe_align(alignment, expert_ids, self.stream)
        return self.combined(ExpertSum(self._aligned_experts(x, gate_up, down, weights, alignment), weights,
                                       alignment.row_of_pair))

    def combined(self, x: DeviceTensor | ExpertSum) -> DeviceTensor:
        """x itself, or an ExpertSum's rows combined in token order: [T, H] in their dtype."""
        if not isinstance(x, ExpertSum):
            return x
        out = self.allocator.empty(x.shape, x.dtype)
        moe_routing.moe_combine(out, x.expert_out, x.weights, x.row_of_pair, self.stream)
        return out

    def sparse_moe(self, x: DeviceTensor, router_input: DeviceTensor, router: DeviceTensor, gate_up: DeviceTensor,
                   down: DeviceTensor, top_k: int, renormalize: bool, shared_expert: bool = False) -> ExpertSum:
        """The router GEMM (fp32 logits; in bf16 / fp16 [y | y_lo] @ [W | W]^T), the routing and its
        alignment, then `_aligned_experts`. A decode step's few pairs (T * k <= WARP_MAX_PAIRS) take
        one launch for all three (moe_router: a GEMV whose last block routes and aligns) wherever its
        16-byte loads can read the operands; more take the GEMM (on the tensor cores), then
        moe_route_align. With shared_expert, each token's pairs end in the shared expert's (the
        router's last row its gate), so the expert GEMMs run it with the routed ones. The rows
        are left for the op after the block to combine (ExpertSum)."""
        num_tokens, num_experts = x.shape[0], router.shape[0]  # router rows: the experts gate_up stacks
        pairs_per_token = top_k + shared_expert
        weights, expert_ids = self._routing_outputs(num_tokens, num_experts - shared_expert, top_k, shared_expert)
        alignment = moe_routing.MoeAlignment.allocate(self.allocator, num_tokens * pairs_per_token, num_experts)
        if (num_tokens * pairs_per_token <= moe_routing.WARP_MAX_PAIRS
                and moe_router.unsupported_reason(router_input, router) is None):
            router_logits = self.allocator.empty((num_tokens, num_experts), DType.float32)
            moe_router.moe_router_route_align(weights, expert_ids, alignment, router_logits, router_input, router,
                                              renormalize, self.stream, shared_expert)
        else:
            router_logits = self.linear(router_input, router, out_dtype=np.float32)
            moe_routing.moe_route_align(weights, expert_ids, alignment, router_logits, renormalize, self.stream,
                                        shared_expert)
        return ExpertSum(self._aligned_experts(x, gate_up, down, weights, alignment), weights, alignment.row_of_pair)

    def shared_expert_among_routed(self, num_tokens: int, top_k: int, num_experts: int) -> bool:
        """Where the folded pairs still take the one-launch router (T * (k + 1) <= WARP_MAX_PAIRS)
        and the GEMV-style expert GEMMs run the shared expert's T rows in one pass, it costs what
        a routed expert does, and its three GEMVs and their gated add beside the router go. The
        Qwen3-Next MoE block's graph time, among / beside (session 14): 0.92 at T = 1 and 2; 1.06
        at T = 3, whose 33 folded pairs miss the one-launch router that the routed 30 take; 1.0-1.04
        at T = 4-8; 1.07-1.20 at T >= 12, where its rows run kM at a time, each pass streaming its
        weights again after the routed experts have finished."""
        pairs = num_tokens * (top_k + 1)
        return pairs <= moe_routing.WARP_MAX_PAIRS and num_tokens <= moe_gemm.expert_tile(pairs, num_experts)

    def _routing_outputs(self, num_tokens: int, num_experts: int, top_k: int,
                         shared_expert: bool = False) -> tuple[DeviceTensor, DeviceTensor]:
        """weights [T, k] float32 and expert_ids [T, k] int32 (k + 1 columns with a shared expert's),
        for a valid top_k of num_experts routed experts."""
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and the number of experts ({num_experts}), got {top_k}")
        columns = top_k + shared_expert
        return (self.allocator.empty((num_tokens, columns), DType.float32),
                self.allocator.empty((num_tokens, columns), DType.int32))

    def _aligned_experts(self, x: DeviceTensor, gate_up: DeviceTensor, down: DeviceTensor, weights: DeviceTensor,
                         alignment: moe_routing.MoeAlignment) -> DeviceTensor:
        """The selected experts' GEMMs (SiLU fused into gate_up) on their rows only -> their output
        rows [T * k, H] in expert order (alignment.row_of_pair says where each pair's is). The
        expert GEMMs are picked on the host from shapes alone: with bf16/fp16 and at least
        MIN_ROWS_PER_EXPERT rows per expert on average (prefill), the tensor-core grouped GEMM
        (moe_grouped_gemm's one-block tile plan, then its mma.sync kernels, or on Hopper
        moe_grouped_wgmma's); otherwise (decode, fp32) the GEMV-style moe_gemm, which streams the
        weights at full bandwidth."""
        num_pairs, top_k = weights.numel, weights.shape[1]
        num_experts, inter2, hidden_size = gate_up.shape
        hidden = self.allocator.empty((num_pairs, inter2 // 2), x.dtype)
        expert_out = self.allocator.empty((num_pairs, hidden_size), x.dtype)  # rounded as moe_experts says
        if moe_grouped_gemm.use_grouped_gemm(num_pairs, num_experts, x.dtype):
            tile_starts = self.allocator.empty((num_experts + 1,), DType.int32)
            moe_grouped_gemm.plan_tiles(tile_starts, alignment.offsets, self.stream)
            grouped = moe_grouped_wgmma if moe_grouped_wgmma.use_wgmma(self.device.arch) else moe_grouped_gemm
            grouped.moe_grouped_gate_up(hidden, x, gate_up, alignment.sorted_pairs, alignment.offsets, tile_starts,
                                        top_k, self.stream)
            grouped.moe_grouped_down(expert_out, hidden, down, alignment.offsets, tile_starts, self.stream)
        else:
            moe_gemm.moe_gate_up(hidden, x, gate_up, alignment.sorted_pairs, alignment.offsets,
                                 alignment.active_experts, alignment.num_active, top_k, self.stream)
            moe_gemm.moe_down(expert_out, hidden, down, alignment.offsets, alignment.active_experts,
                              alignment.num_active, self.stream)
        return expert_out
