"""Expert GEMM launchers (cukernels/moe_gemm.cu): the two projections of the routed experts.

Shapes: T tokens, k = top_k, P = T*k (token, expert) pairs, E experts, H hidden size,
I expert intermediate size. The rows of both outputs are the pairs in expert order
("sorted rows"), as the alignment kernel (`moe_routing.py`) lays them out:
sorted_pairs [P], offsets [E+1], active_experts [min(E, P)] and num_active [1], int32.

    moe_gate_up: hidden [P, I] = silu(x[tok] @ gate[e]^T) * (x[tok] @ up[e]^T), in x's dtype
    moe_down:    expert_out [P, H] = hidden @ down[e]^T, summed in fp32, in hidden's dtype

A warp streams a tile of 16 weight rows of one expert into tensor-core operands (bf16 /
fp16; fp32, the parity mode, sums by IEEE FMA on the CUDA cores in a fixed order) and runs
up to `ExpertGemmPlan.rows_per_pass` of the expert's rows against it; an expert no token
chose is never read. Both launches depend only on shapes, never on routing, so they are
graph-capturable, and their results are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream, current_device
from ..tensor import DeviceTensor
from . import (
    ACCESS_BYTES,
    ELEMENT_TYPES,
    i32,
    require,
    require_contiguous,
    require_dtype,
    row_stride,
)

_SOURCE = "moe_gemm.cu"
M_TILES = (8, 16, 32)  # the kM instantiations: sorted rows of one expert per pass over its weights
K_SPLITS = (1, 2, 4)  # warps of a block that may share one weight tile's K
_WARPS_PER_BLOCK = 4  # kWarps
_RESIDENT_WARPS_PER_SM = 12  # kWarps * kMinBlocksPerSm
_TILE_ROWS = 16  # kTileRows: weight rows per warp tile (gate_up: 8 gate and the 8 matching up rows)
_STEP_CHUNKS = 4  # kStepChunks: 16-byte chunks of a row per k-step
_BATCH_STEPS = 8  # kBatchSteps for 16-bit types: a K slice of fewer steps leaves loads unissued
_MAX_GRID_Y = 65535  # CUDA's limit on grid dim y, which holds one slot per possible active expert

SPECS = [KernelSpec(_SOURCE, f"{kernel}<{dtype.c_type}, {tile}>")
         for kernel in ("moe_gate_up_kernel", "moe_down_kernel") for dtype in ELEMENT_TYPES for tile in M_TILES]


@dataclass(frozen=True)
class ExpertGemmPlan:
    """How a launch divides the work: `rows_per_pass` (kM, one of M_TILES) sorted rows of
    an expert run against each pass over its weights, and `k_split` (one of K_SPLITS) warps
    share each weight tile, one slice of K each."""

    rows_per_pass: int
    k_split: int

    def __post_init__(self):
        require(self.rows_per_pass in M_TILES, f"rows_per_pass must be one of {M_TILES}, got {self.rows_per_pass}")
        require(self.k_split in K_SPLITS, f"k_split must be one of {K_SPLITS}, got {self.k_split}")


def expert_tile(num_pairs: int, num_experts: int) -> int:
    """The kM tile for P pairs over E experts: the smallest tile of at least 4x the mean rows
    per expert (counting at least one), at most M_TILES[-1].

    The host cannot see the routing (it lives on the device, and the launch must not
    wait for it), so it plans for the mean with room for the spread: at T = 64, k = 8,
    E = 128 (4 rows on average, a few experts 10 or 12) one pass of 16 rows serves
    every expert. Rows past an expert's count cost registers only, and an expert with
    more rows than the tile streams its weights once more per tile of rows."""
    require(num_pairs >= 1 and num_experts >= 1, f"need pairs and experts, got P = {num_pairs}, E = {num_experts}")
    wanted = 4 * max(num_pairs, num_experts)  # 4 * mean * E, the mean at least one row
    return next((tile for tile in M_TILES if tile * num_experts >= wanted), M_TILES[-1])


def choose_k_split(num_tiles: int, num_slots: int, k_steps: int, num_sms: int) -> int:
    """Warps per weight tile: the most that keep every warp of the grid resident at once
    (num_tiles * num_slots tiles, _RESIDENT_WARPS_PER_SM a multiprocessor) with at least a
    full batch of loads per K slice. Splitting matters when few experts are active (batch 1):
    it puts more loads in flight without a second wave of blocks."""
    resident = num_sms * _RESIDENT_WARPS_PER_SM
    fitting = [split for split in K_SPLITS
               if num_tiles * num_slots * split <= resident and k_steps >= split * _BATCH_STEPS]
    return max(fitting, default=1)


def plan(num_pairs: int, num_experts: int, num_tiles: int, k: int, dtype: DType, num_sms: int) -> ExpertGemmPlan:
    """The plan for one GEMM: P pairs over E experts, num_tiles weight tiles an expert
    (`gate_up_tiles` / `down_tiles`), a K of k elements of dtype, on num_sms multiprocessors."""
    k_steps = -(-_chunks(k, dtype) // _STEP_CHUNKS)
    return ExpertGemmPlan(expert_tile(num_pairs, num_experts),
                          choose_k_split(num_tiles, min(num_experts, num_pairs), k_steps, num_sms))


def gate_up_tiles(inter_size: int) -> int:
    """Warp tiles of one expert's gate_up: 8 hidden columns each, their gate and up rows."""
    return -(-inter_size // (_TILE_ROWS // 2))


def down_tiles(hidden_size: int) -> int:
    """Warp tiles of one expert's down: 16 rows each."""
    return -(-hidden_size // _TILE_ROWS)


def moe_gate_up(hidden: DeviceTensor, x: DeviceTensor, gate_up: DeviceTensor, sorted_pairs: DeviceTensor,
                offsets: DeviceTensor, active_experts: DeviceTensor, num_active: DeviceTensor, top_k: int,
                stream: Stream, launch_plan: ExpertGemmPlan | None = None) -> None:
    """hidden[row] = silu_and_mul(gate_up[e] @ x[sorted_pairs[row] // top_k]) for every sorted row of every
    active expert e. x [T, H] (rows may be spaced), gate_up [E, 2I, H] = [gate | up] per expert,
    hidden [P = T*top_k, I] in x's dtype; fp32 accumulation. launch_plan: None for `plan`'s choice."""
    shapes = check_gate_up_operands(hidden, x, gate_up, top_k, ELEMENT_TYPES)
    num_pairs, num_experts, hidden_size, inter_size = shapes
    _require_routing(sorted_pairs, offsets, active_experts, num_active, num_pairs, num_experts)
    if num_pairs == 0 or inter_size == 0:
        return
    args = [hidden, x, gate_up, sorted_pairs, offsets, active_experts, num_active, i32(top_k), i32(hidden_size),
            i32(inter_size), np.int64(row_stride(x))]
    _launch("moe_gate_up_kernel", x.dtype, shapes, gate_up_tiles(inter_size), hidden_size, launch_plan, args, stream)


def moe_down(expert_out: DeviceTensor, hidden: DeviceTensor, down: DeviceTensor, offsets: DeviceTensor,
             active_experts: DeviceTensor, num_active: DeviceTensor, stream: Stream,
             launch_plan: ExpertGemmPlan | None = None) -> None:
    """expert_out[row] = down[e] @ hidden[row] for every sorted row of every active expert e.
    hidden [P, I], down [E, H, I] and expert_out [P, H] in hidden's dtype; fp32 accumulation, each
    output rounded once. launch_plan: None for `plan`'s choice."""
    shapes = check_down_operands(expert_out, hidden, down, ELEMENT_TYPES)
    num_pairs, num_experts, hidden_size, inter_size = shapes
    _require_routing(None, offsets, active_experts, num_active, num_pairs, num_experts)
    if num_pairs == 0 or hidden_size == 0:
        return
    args = [expert_out, hidden, down, offsets, active_experts, num_active, i32(hidden_size), i32(inter_size)]
    _launch("moe_down_kernel", hidden.dtype, shapes, down_tiles(hidden_size), inter_size, launch_plan, args, stream)


def _launch(kernel: str, dtype: DType, shapes: ExpertShapes, num_tiles: int, k: int,
            launch_plan: ExpertGemmPlan | None, args: list, stream: Stream) -> None:
    """`kernel`<dtype, kM> over num_tiles warp tiles of each possible active expert, K = k
    long, with the plan's k_split appended to args; the plan is `plan`'s choice unless given.
    Grid: (blocks over an expert's tiles, one slot per possible active expert)."""
    num_pairs, num_experts = shapes.num_pairs, shapes.num_experts
    launch_plan = launch_plan or plan(num_pairs, num_experts, num_tiles, k, dtype, current_device().sm_count)
    grid = (-(-num_tiles // (_WARPS_PER_BLOCK // launch_plan.k_split)), min(num_experts, num_pairs))
    get_kernel(KernelSpec(_SOURCE, f"{kernel}<{dtype.c_type}, {launch_plan.rows_per_pass}>")).launch(
        grid, 32 * _WARPS_PER_BLOCK, [*args, i32(launch_plan.k_split)], stream=stream)


# ---- preconditions ----

class ExpertShapes(NamedTuple):
    num_pairs: int  # P = T * k
    num_experts: int  # E
    hidden_size: int  # H
    inter_size: int  # I


def check_gate_up_operands(hidden: DeviceTensor, x: DeviceTensor, gate_up: DeviceTensor, top_k: int,
                           dtypes: tuple[DType, ...]) -> ExpertShapes:
    """The operand rules of every gate_up kernel (this one and moe_grouped_gemm's): x [T, H] in one
    of `dtypes` with unit column stride, gate_up [E, 2I, H] and hidden [T*top_k, I] in x's dtype,
    contiguous, H, I and x's row stride whole 16-byte chunks, 16-byte aligned."""
    require(x.ndim == 2 and x.strides[1] == 1, f"x must be [T, H] with unit column stride, got {x}")
    require_dtype("x", x, *dtypes)
    require(gate_up.ndim == 3 and gate_up.shape[1] % 2 == 0, f"gate_up must be [E, 2I, H], got shape {gate_up.shape}")
    num_tokens, hidden_size = x.shape
    num_experts, inter_size = gate_up.shape[0], gate_up.shape[1] // 2
    require(top_k >= 1, f"top_k must be at least 1, got {top_k}")
    num_pairs = num_tokens * top_k
    require(gate_up.shape[2] == hidden_size,
            f"gate_up's last dim must be x's hidden size {hidden_size}, got shape {gate_up.shape}")
    _require_weights("gate_up", gate_up, x.dtype)
    _require_rows("hidden", hidden, (num_pairs, inter_size), x.dtype)
    _require_chunks(x.dtype, {"H": hidden_size, "I": inter_size, "x's row stride": row_stride(x)})
    _require_aligned(x=x, gate_up=gate_up, hidden=hidden)
    return ExpertShapes(num_pairs, num_experts, hidden_size, inter_size)


def check_down_operands(expert_out: DeviceTensor, hidden: DeviceTensor, down: DeviceTensor,
                        dtypes: tuple[DType, ...]) -> ExpertShapes:
    """The operand rules of every down kernel: hidden [P, I] in one of `dtypes`, down [E, H, I]
    and expert_out [P, H] in its dtype, all contiguous, H and I whole 16-byte chunks, 16-byte
    aligned."""
    require(hidden.ndim == 2, f"hidden must be [P, I], got shape {hidden.shape}")
    require(down.ndim == 3, f"down must be [E, H, I], got shape {down.shape}")
    num_pairs, inter_size = hidden.shape
    num_experts, hidden_size = down.shape[:2]
    require(down.shape[2] == inter_size,
            f"down's last dim must be hidden's intermediate size {inter_size}, got shape {down.shape}")
    require_dtype("hidden", hidden, *dtypes)
    require_contiguous("hidden", hidden)
    _require_weights("down", down, hidden.dtype)
    _require_rows("expert_out", expert_out, (num_pairs, hidden_size), hidden.dtype)
    _require_chunks(hidden.dtype, {"H": hidden_size, "I": inter_size})
    _require_aligned(hidden=hidden, down=down, expert_out=expert_out)
    return ExpertShapes(num_pairs, num_experts, hidden_size, inter_size)


def _chunks(k: int, dtype: DType) -> int:
    """16-byte chunks in a row of k elements."""
    return k // (ACCESS_BYTES // dtype.itemsize)


def _require_weights(name: str, weight: DeviceTensor, dtype: DType) -> None:
    require(weight.dtype is dtype, f"{name} must be {dtype.name} like the activations, got {weight.dtype.name}")
    require_contiguous(name, weight)


def _require_rows(name: str, out: DeviceTensor, shape: tuple[int, int], dtype: DType) -> None:
    require(out.shape == shape and out.dtype is dtype,
            f"{name} must be {list(shape)} {dtype.name}, got {list(out.shape)} {out.dtype.name}")
    require_contiguous(name, out)


def _require_routing(sorted_pairs: DeviceTensor | None, offsets: DeviceTensor, active_experts: DeviceTensor,
                     num_active: DeviceTensor, num_pairs: int, num_experts: int) -> None:
    """The alignment kernel's outputs for P pairs over E experts (sorted_pairs only where read)."""
    expected = {"offsets": (offsets, num_experts + 1), "active_experts": (active_experts, min(num_experts, num_pairs)),
                "num_active": (num_active, 1)}
    if sorted_pairs is not None:
        expected["sorted_pairs"] = (sorted_pairs, num_pairs)
    for name, (tensor, size) in expected.items():
        require(tensor.shape == (size,) and tensor.dtype is DType.int32,
                f"{name} must be [{size}] int32, got {list(tensor.shape)} {tensor.dtype.name}")
        require_contiguous(name, tensor)
    require(num_experts <= _MAX_GRID_Y, f"at most {_MAX_GRID_Y} experts, got {num_experts}")


def _require_chunks(dtype: DType, extents: dict[str, int]) -> None:
    """Both GEMMs read whole 16-byte chunks of every row: each extent (a K or a stride) must divide into them."""
    chunk = ACCESS_BYTES // dtype.itemsize
    for name, extent in extents.items():
        require(extent % chunk == 0,
                f"moe_gemm reads 16-byte chunks: {name} ({extent}) must be a multiple of {chunk} for {dtype.name}")


def _require_aligned(**tensors: DeviceTensor) -> None:
    for name, tensor in tensors.items():
        require(tensor.ptr % ACCESS_BYTES == 0, f"moe_gemm needs {name} 16-byte aligned, got 0x{tensor.ptr:x}")
