"""Tensor-core expert GEMM launchers (cukernels/moe_grouped_gemm.cu), for prefill-sized batches.

Shapes: T tokens, k = top_k, P = T*k (token, expert) pairs, E experts, H hidden size,
I expert intermediate size. Same contracts as `moe_gemm.moe_gate_up` / `moe_down`, rows
in expert order as the alignment kernel (`moe_routing.py`) lays them out:

    plan_tiles:          tile_starts [E+1] int32 <- offsets [E+1]: each expert's first M-tile
    moe_grouped_gate_up: hidden [P, I] = silu(x[tok] @ gate[e]^T) * (x[tok] @ up[e]^T), in x's dtype
    moe_grouped_down:    expert_out [P, H] = hidden @ down[e]^T, summed in fp32, in hidden's dtype

bf16 and fp16 only (mma.sync m16n8k16, fp32 accumulation); fp32 stays on moe_gemm. A block
computes TILE_M sorted rows of one expert against 256 weight rows, so an expert's weights
stream once per TILE_M of its rows rather than once per 16. The grid depends on
(P, E, N) only, never on the routing, so the three launches are graph-capturable.
The pipeline is 4 K slices deep where the device gives a block the shared memory for it
(Hopper: 192 KiB of its 227), else 2 (96 KiB: sm_120's limit is 99).
"""

from __future__ import annotations

import numpy as np

from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream, current_device
from ..tensor import DeviceTensor
from . import i32, require, require_contiguous, row_stride
from .moe_gemm import check_down_operands, check_gate_up_operands
from .moe_routing import MAX_EXPERTS

_SOURCE = "moe_grouped_gemm.cu"
DTYPES = (DType.float16, DType.bfloat16)  # the tensor-core element types
TILE_M = 128  # kTileM: sorted rows of one expert per block
_TILE_N = 256  # kTileN: weight rows per block
_GATE_UP_COLS = _TILE_N // 2  # hidden columns per gate_up block: their gate rows and their up rows
_STAGE_BYTES = (TILE_M + _TILE_N) * 128  # kStageBytes: a 64-wide K slice of A and B rows, 16-bit elements
STAGES = (4, 2)  # the instantiated pipeline depths, deepest first
_THREADS = 256  # kThreads
_PLAN_THREADS = 1024  # kPlanThreads
_MAX_GRID = 2**31 - 1  # CUDA's limit on grid dim x, which holds every (M-tile slot, weight tile) pair
# Below this many rows per expert on average, a 128-row tile is mostly padding and the
# GEMV-style moe_gemm, which streams the weights at full bandwidth, wins.
MIN_ROWS_PER_EXPERT = 16

_PLAN = KernelSpec(_SOURCE, "moe_tile_plan_kernel")


def _spec(kernel: str, dtype: DType, stages: int) -> KernelSpec:
    return KernelSpec(_SOURCE, f"{kernel}<{dtype.c_type}, {stages}>")


SPECS = [_PLAN] + [_spec(kernel, dtype, stages)
                   for kernel in ("moe_grouped_gate_up_kernel", "moe_grouped_down_kernel")
                   for dtype in DTYPES for stages in STAGES]


def use_grouped_gemm(num_pairs: int, num_experts: int, dtype: DType) -> bool:
    """The host's rule for CudaOps.moe_experts: tensor cores when the dtype has them and the
    experts get at least MIN_ROWS_PER_EXPERT rows each on average (the routing itself is
    on the device, and the launch must not wait for it)."""
    return dtype in DTYPES and num_pairs >= MIN_ROWS_PER_EXPERT * num_experts


def max_m_tiles(num_pairs: int, num_experts: int, tile_rows: int = TILE_M) -> int:
    """M-tile slots of the grid: an upper bound on sum_e ceil(count_e / tile_rows) over any routing of P pairs,
    as each of the at most min(E, P) active experts leaves at most one partial tile."""
    return -(-num_pairs // tile_rows) + min(num_experts, num_pairs)


def smem_bytes(stages: int) -> int:
    """Dynamic shared memory of both GEMM kernels at a pipeline depth: `stages` K slices of A and B."""
    return stages * _STAGE_BYTES


def pipeline_stages(max_shared_per_block: int) -> int:
    """The deepest instantiated pipeline whose shared memory a block of this device may have."""
    for stages in STAGES:
        if smem_bytes(stages) <= max_shared_per_block:
            return stages
    raise ValueError(f"the grouped expert GEMMs need {smem_bytes(STAGES[-1])} bytes of shared memory per block, "
                     f"this device allows {max_shared_per_block}")


def plan_tiles(tile_starts: DeviceTensor, offsets: DeviceTensor, stream: Stream) -> None:
    """tile_starts[e] = sum over e' < e of ceil(count(e') / TILE_M), tile_starts[E] = the total,
    from a `MoeAlignment`'s offsets [E+1]; both int32, contiguous. One block."""
    num_experts = offsets.shape[0] - 1
    _require_ints(offsets=(offsets, num_experts + 1), tile_starts=(tile_starts, num_experts + 1))
    require(1 <= num_experts <= min(MAX_EXPERTS, _PLAN_THREADS),
            f"plan_tiles handles 1 to {min(MAX_EXPERTS, _PLAN_THREADS)} experts, got E = {num_experts}")
    get_kernel(_PLAN).launch(1, _PLAN_THREADS, [tile_starts, offsets, i32(num_experts)], stream=stream)


def moe_grouped_gate_up(hidden: DeviceTensor, x: DeviceTensor, gate_up: DeviceTensor, sorted_pairs: DeviceTensor,
                        offsets: DeviceTensor, tile_starts: DeviceTensor, top_k: int, stream: Stream,
                        stages: int | None = None) -> None:
    """hidden[row] = silu_and_mul(gate_up[e] @ x[sorted_pairs[row] // top_k]) for every sorted row of every
    expert e that has rows. x [T, H] (rows may be spaced), gate_up [E, 2I, H] = [gate | up] per expert,
    hidden [P = T*top_k, I] in x's dtype (bf16/fp16); tile_starts from `plan_tiles`; fp32 accumulation.
    stages: the pipeline depth, one of STAGES; by default the deepest this device allows."""
    _require_stages(stages)
    num_pairs, num_experts, hidden_size, inter_size = check_gate_up_operands(hidden, x, gate_up, top_k, DTYPES)
    weight_tiles = -(-inter_size // _GATE_UP_COLS)
    require_plan(sorted_pairs, offsets, tile_starts, num_pairs, num_experts, weight_tiles)
    if num_pairs == 0 or inter_size == 0:
        return
    num_slots = max_m_tiles(num_pairs, num_experts)
    args = [hidden, x, gate_up, sorted_pairs, offsets, tile_starts, i32(num_experts), i32(num_slots), i32(top_k),
            i32(hidden_size), i32(inter_size), np.int64(row_stride(x))]
    _launch("moe_grouped_gate_up_kernel", x.dtype, num_slots * weight_tiles, args, stages, stream)


def moe_grouped_down(expert_out: DeviceTensor, hidden: DeviceTensor, down: DeviceTensor, offsets: DeviceTensor,
                     tile_starts: DeviceTensor, stream: Stream, stages: int | None = None) -> None:
    """expert_out[row] = down[e] @ hidden[row] for every sorted row of every expert e that has rows.
    hidden [P, I] (bf16/fp16), down [E, H, I] and expert_out [P, H] in hidden's dtype; tile_starts
    from `plan_tiles`; fp32 accumulation, each output rounded once. stages: as for moe_grouped_gate_up."""
    _require_stages(stages)
    num_pairs, num_experts, hidden_size, inter_size = check_down_operands(expert_out, hidden, down, DTYPES)
    weight_tiles = -(-hidden_size // _TILE_N)
    require_plan(None, offsets, tile_starts, num_pairs, num_experts, weight_tiles)
    if num_pairs == 0 or hidden_size == 0:
        return
    num_slots = max_m_tiles(num_pairs, num_experts)
    args = [expert_out, hidden, down, offsets, tile_starts, i32(num_experts), i32(num_slots), i32(hidden_size),
            i32(inter_size)]
    _launch("moe_grouped_down_kernel", hidden.dtype, num_slots * weight_tiles, args, stages, stream)


def _launch(kernel: str, dtype: DType, num_blocks: int, args: list, stages: int | None, stream: Stream) -> None:
    """One block per (M-tile slot, weight tile); by default at the deepest pipeline the device allows."""
    if stages is None:
        stages = pipeline_stages(current_device().max_shared_per_block_optin)
    get_kernel(_spec(kernel, dtype, stages)).launch(num_blocks, _THREADS, args, shared_mem=smem_bytes(stages),
                                                    stream=stream)


# ---- preconditions ----

def require_plan(sorted_pairs: DeviceTensor | None, offsets: DeviceTensor, tile_starts: DeviceTensor,
                  num_pairs: int, num_experts: int, weight_tiles: int) -> None:
    """The alignment's offsets (and sorted_pairs where read) and plan_tiles' tile_starts for P pairs over E experts,
    and a grid of every M-tile slot times `weight_tiles` within CUDA's limit."""
    expected = {"offsets": (offsets, num_experts + 1), "tile_starts": (tile_starts, num_experts + 1)}
    if sorted_pairs is not None:
        expected["sorted_pairs"] = (sorted_pairs, num_pairs)
    _require_ints(**expected)
    num_blocks = max_m_tiles(num_pairs, num_experts) * weight_tiles
    require(num_blocks <= _MAX_GRID,
            f"at most {_MAX_GRID} blocks, got {num_blocks} for P = {num_pairs}, E = {num_experts} and "
            f"{weight_tiles} weight tiles")


def _require_stages(stages: int | None) -> None:
    require(stages is None or stages in STAGES, f"stages must be one of {STAGES} or None, got {stages}")


def _require_ints(**tensors: tuple[DeviceTensor, int]) -> None:
    """Each named tensor is [size] int32, contiguous."""
    for name, (tensor, size) in tensors.items():
        require(tensor.shape == (size,) and tensor.dtype is DType.int32,
                f"{name} must be [{size}] int32, got {list(tensor.shape)} {tensor.dtype.name}")
        require_contiguous(name, tensor)
