"""Expert GEMM launchers (cukernels/moe_gemm.cu): the two projections of the routed experts.

Shapes: T tokens, k = top_k, P = T*k (token, expert) pairs, E experts, H hidden size,
I expert intermediate size. The rows of both outputs are the pairs in expert order
("sorted rows"), as the alignment kernel (`moe_routing.py`) lays them out:
sorted_pairs [P], offsets [E+1], active_experts [min(E, P)] and num_active [1], int32.

    moe_gate_up: hidden [P, I] = silu(x[tok] @ gate[e]^T) * (x[tok] @ up[e]^T), in x's dtype
    moe_down:    expert_out [P, H] float32 = hidden @ down[e]^T

Each selected expert's weights stream once per tile of `expert_tile(P, E)` of its rows
(16-byte loads, split-K in a block, as gemv); an expert no token chose is never read.
Both launches depend only on shapes, never on routing, so they are graph-capturable.
"""

from __future__ import annotations

import numpy as np

from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream
from ..tensor import DeviceTensor
from . import ACCESS_BYTES, ELEMENT_TYPES, i32, require, require_contiguous, require_dtype

_SOURCE = "moe_gemm.cu"
M_TILES = (1, 4, 16)  # the kM instantiations: sorted rows of one expert per pass over its weights
_ROWS_PER_BLOCK = 4  # kRows: weight rows per block
_GATE_UP_COLS_PER_BLOCK = _ROWS_PER_BLOCK // 2  # kGateUpCols: a gate and an up row per hidden column
_MAX_WARPS = 8  # kMaxWarps
_CHUNKS_PER_THREAD = 4  # per weight row, as in gemv: below this many a thread, fewer warps split K
_MAX_GRID_Y = 65535  # CUDA's limit on grid dim y, which holds one slot per possible active expert

SPECS = [KernelSpec(_SOURCE, f"{kernel}<{dtype.c_type}, {tile}>")
         for kernel in ("moe_gate_up_kernel", "moe_down_kernel") for dtype in ELEMENT_TYPES for tile in M_TILES]


def expert_tile(num_pairs: int, num_experts: int) -> int:
    """The kM tile for P pairs over E experts: the smallest tile >= ceil(P / E), at most 16.

    The host cannot see the routing (it lives on the device, and the launch must not
    wait for it), so it plans for the mean rows per expert. Any tile is correct: an
    expert with more rows takes more passes over its weights (the later ones mostly
    from L2), one with fewer leaves part of the tile idle."""
    require(num_pairs >= 1 and num_experts >= 1, f"need pairs and experts, got P = {num_pairs}, E = {num_experts}")
    rows_per_expert = -(-num_pairs // num_experts)
    return next((tile for tile in M_TILES if tile >= rows_per_expert), M_TILES[-1])


def moe_gate_up(hidden: DeviceTensor, x: DeviceTensor, gate_up: DeviceTensor, sorted_pairs: DeviceTensor,
                offsets: DeviceTensor, active_experts: DeviceTensor, num_active: DeviceTensor, top_k: int,
                stream: Stream) -> None:
    """hidden[row] = silu_and_mul(gate_up[e] @ x[sorted_pairs[row] // top_k]) for every sorted row of every
    active expert e. x [T, H] (rows may be spaced), gate_up [E, 2I, H] = [gate | up] per expert,
    hidden [P = T*top_k, I] in x's dtype; fp32 accumulation."""
    require(x.ndim == 2 and x.strides[1] == 1, f"x must be [T, H] with unit column stride, got {x}")
    require_dtype("x", x, *ELEMENT_TYPES)
    require(gate_up.ndim == 3 and gate_up.shape[1] % 2 == 0, f"gate_up must be [E, 2I, H], got shape {gate_up.shape}")
    num_tokens, hidden_size = x.shape
    num_experts, inter_size = gate_up.shape[0], gate_up.shape[1] // 2
    require(top_k >= 1, f"top_k must be at least 1, got {top_k}")
    num_pairs = num_tokens * top_k
    require(gate_up.shape[2] == hidden_size,
            f"gate_up's last dim must be x's hidden size {hidden_size}, got shape {gate_up.shape}")
    _require_weights("gate_up", gate_up, x.dtype)
    _require_rows("hidden", hidden, (num_pairs, inter_size), x.dtype)
    _require_routing(sorted_pairs, offsets, active_experts, num_active, num_pairs, num_experts)
    _require_chunks(x.dtype, {"H": hidden_size, "I": inter_size, "x's row stride": _row_stride(x)})
    _require_aligned(x=x, gate_up=gate_up)
    if num_pairs == 0 or inter_size == 0:
        return
    kernel = get_kernel(KernelSpec(_SOURCE, f"moe_gate_up_kernel<{x.dtype.c_type}, "
                                            f"{expert_tile(num_pairs, num_experts)}>"))
    args = [hidden, x, gate_up, sorted_pairs, offsets, active_experts, num_active, i32(top_k), i32(hidden_size),
            i32(inter_size), np.int64(_row_stride(x))]
    grid = (inter_size // _GATE_UP_COLS_PER_BLOCK, min(num_experts, num_pairs))
    kernel.launch(grid, 32 * _warps(hidden_size, x.dtype), args, stream=stream)


def moe_down(expert_out: DeviceTensor, hidden: DeviceTensor, down: DeviceTensor, offsets: DeviceTensor,
             active_experts: DeviceTensor, num_active: DeviceTensor, stream: Stream) -> None:
    """expert_out[row] = down[e] @ hidden[row] for every sorted row of every active expert e.
    hidden [P, I], down [E, H, I] in hidden's dtype, expert_out [P, H] float32; fp32 accumulation."""
    require(hidden.ndim == 2, f"hidden must be [P, I], got shape {hidden.shape}")
    require(down.ndim == 3, f"down must be [E, H, I], got shape {down.shape}")
    num_pairs, inter_size = hidden.shape
    num_experts, hidden_size = down.shape[:2]
    require(down.shape[2] == inter_size,
            f"down's last dim must be hidden's intermediate size {inter_size}, got shape {down.shape}")
    require_dtype("hidden", hidden, *ELEMENT_TYPES)
    require_contiguous("hidden", hidden)
    _require_weights("down", down, hidden.dtype)
    _require_rows("expert_out", expert_out, (num_pairs, hidden_size), DType.float32)
    _require_routing(None, offsets, active_experts, num_active, num_pairs, num_experts)
    _require_chunks(hidden.dtype, {"H": hidden_size, "I": inter_size})
    _require_aligned(hidden=hidden, down=down)
    if num_pairs == 0 or hidden_size == 0:
        return
    kernel = get_kernel(KernelSpec(_SOURCE, f"moe_down_kernel<{hidden.dtype.c_type}, "
                                            f"{expert_tile(num_pairs, num_experts)}>"))
    args = [expert_out, hidden, down, offsets, active_experts, num_active, i32(hidden_size), i32(inter_size)]
    grid = (hidden_size // _ROWS_PER_BLOCK, min(num_experts, num_pairs))
    kernel.launch(grid, 32 * _warps(inter_size, hidden.dtype), args, stream=stream)


# ---- preconditions ----

def _row_stride(x: DeviceTensor) -> int:
    """Elements between x's rows; a single row has none to honour."""
    return x.row_stride if x.shape[0] > 1 else x.shape[1]


def _warps(k: int, dtype: DType) -> int:
    """Warps splitting a K of k elements: one per _CHUNKS_PER_THREAD chunks a lane, up to _MAX_WARPS."""
    chunks = k // (ACCESS_BYTES // dtype.itemsize)
    return min(_MAX_WARPS, max(1, -(-chunks // (32 * _CHUNKS_PER_THREAD))))


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
