"""Hopper expert GEMM launchers (cukernels/moe_grouped_wgmma.cu): moe_grouped_gemm's two GEMMs on
warpgroup MMAs (wgmma, sm_90a), for sm_90 devices only.

Same operands, outputs and tile plan as `moe_grouped_gemm` (P = T*k (token, expert) pairs, E
experts, H hidden size, I expert intermediate size; rows in expert order as the alignment kernel
lays them out; tile_starts from `moe_grouped_gemm.plan_tiles`, whose 128-row M-tiles these
kernels share):

    moe_grouped_gate_up: hidden [P, I] = silu(x[tok] @ gate[e]^T) * (x[tok] @ up[e]^T), in x's dtype
    moe_grouped_down:    expert_out [P, H] = hidden @ down[e]^T, summed in fp32, in hidden's dtype

bf16 and fp16, fp32 accumulation. A block is one producer warpgroup (activation rows by
cp.async, weight rows by TMA through a tensor map of the weights, into a 4-stage ring, mbarriers)
and two consumer warpgroups (wgmma m64n256k16, 64 rows each). Blocks run in clusters of
`cluster_size(P, E, K)` that take consecutive M-tiles of one expert against the same weight
tile, each block loading its share of the weight slices into every block of the cluster (TMA
multicast). The grid is persistent, one block per SM at most, so it depends on (P, E, N, K) and
the device only and the launches are graph-capturable. CudaOps picks these where
`use_wgmma(device arch)` holds.
"""

from __future__ import annotations

import numpy as np
from cuda.bindings import driver

from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream, call, current_device
from ..launch import Kernel, cluster_launch_config
from ..tensor import DeviceTensor
from ..tensor_map import swizzled_boxes
from . import i32, require, row_stride
from .moe_gemm import check_down_operands, check_gate_up_operands
from .moe_grouped_gemm import DTYPES, TILE_M, max_m_tiles, require_plan
from .moe_routing import MAX_EXPERTS

_SOURCE = "moe_grouped_wgmma.cu"
WGMMA_ARCH = "sm_90"  # wgmma exists on sm_90a only: CUBINs for it load on compute capability 9.0 alone
_TILE_N = 256  # kTileN: weight rows per tile
_GATE_UP_COLS = _TILE_N // 2  # hidden columns per gate_up tile: their gate rows and their up rows
_STAGES = 4  # kStages
_ROW_BYTES = 128  # kRowBytes: a 64-wide K slice of one row
_THREADS = 384  # kThreads: a producer and two consumer warpgroups
_HALF_ROWS = _TILE_N // 2  # weight rows of one TMA box: half of a tile's
CLUSTERS = (1, 2)  # the instantiated cluster sizes (kCluster)
# A GEMM runs in clusters of 2 (cluster_size) from this K, when its experts average a whole
# M-tile of rows or more. Measured on an H100 (session 23, docs/benchmarks.md), against one block
# loading its own weight slices and against the cp.async form before it: every GEMM of Mixtral
# and Qwen3-235B's gate_up at 4096 tokens gain 1.06-1.24x in pairs; Qwen3-30B's, Qwen3-Next's and
# Qwen3-235B's down (K 512-2048) and Qwen3-235B at 512 tokens (32 rows an expert) lose 0.77-0.97x.
MIN_SHARED_K = 4096
# Dynamic shared memory: slack to the first 1024-byte boundary (the swizzle's period), the
# stages (TILE_M activation rows, then _TILE_N weight rows), a full and an empty barrier a stage.
SMEM_BYTES = 1024 + _STAGES * (TILE_M + _TILE_N) * _ROW_BYTES + 2 * _STAGES * 8
# The registers a thread the block must start with (kLaunchRegisters): setmaxnreg hands the
# producer's surplus to the consumers within it, and a block with fewer would wait forever.
_LAUNCH_REGISTERS = 168


def _spec(kernel: str, dtype: DType, cluster: int) -> KernelSpec:
    return KernelSpec(_SOURCE, f"{kernel}<{dtype.c_type}, {cluster}>")


SPECS = [_spec(kernel, dtype, cluster)
         for kernel in ("moe_grouped_gate_up_wgmma_kernel", "moe_grouped_down_wgmma_kernel")
         for dtype in DTYPES for cluster in CLUSTERS]


def use_wgmma(device_arch: str) -> bool:
    """The host's rule for CudaOps.moe_experts' grouped GEMMs: these kernels on sm_90 (Hopper),
    moe_grouped_gemm's mma.sync ones anywhere else (where these are built as a trap)."""
    return device_arch == WGMMA_ARCH


def cluster_size(num_pairs: int, num_experts: int, k_size: int) -> int:
    """Blocks a cluster, which share each weight slice among consecutive M-tiles of an expert: 2
    where a tile streams a long K of weights (what the sharing halves) and an expert has a full
    M-tile of rows on average (so that its pair's other block is seldom idle), else 1."""
    shares = k_size >= MIN_SHARED_K and num_pairs >= TILE_M * num_experts
    return 2 if shares else 1


def persistent_blocks(num_pairs: int, num_experts: int, weight_tiles: int, max_clusters: int, cluster: int) -> int:
    """Blocks of a launch: `cluster` times the clusters the device holds at once, fewer when any
    routing has fewer cluster tiles (`cluster` M-tiles of one expert) than that."""
    cluster_tiles = max_m_tiles(num_pairs, num_experts, cluster * TILE_M)
    return cluster * min(max_clusters, cluster_tiles * weight_tiles)


def moe_grouped_gate_up(hidden: DeviceTensor, x: DeviceTensor, gate_up: DeviceTensor, sorted_pairs: DeviceTensor,
                        offsets: DeviceTensor, tile_starts: DeviceTensor, top_k: int, stream: Stream) -> None:
    """hidden[row] = silu_and_mul(gate_up[e] @ x[sorted_pairs[row] // top_k]) for every sorted row of every
    expert e that has rows. x [T, H] (rows may be spaced), gate_up [E, 2I, H] = [gate | up] per expert,
    hidden [P = T*top_k, I] in x's dtype (bf16/fp16); tile_starts from `moe_grouped_gemm.plan_tiles`."""
    num_pairs, num_experts, hidden_size, inter_size = check_gate_up_operands(hidden, x, gate_up, top_k, DTYPES)
    weight_tiles = -(-inter_size // _GATE_UP_COLS)
    require_plan(sorted_pairs, offsets, tile_starts, num_pairs, num_experts, weight_tiles)
    if num_pairs == 0 or inter_size == 0:
        return
    device = _hopper(num_experts)
    # gate_up [E, 2I, H] as [2E, I, H]: a box is 128 gate (or up) rows of one expert.
    weights = swizzled_boxes(gate_up.view((2 * num_experts, inter_size, hidden_size)), _HALF_ROWS)
    args = [hidden, x, weights, sorted_pairs, offsets, tile_starts, i32(num_experts), i32(top_k), i32(hidden_size),
            i32(inter_size), np.int64(row_stride(x))]
    _launch(device, "moe_grouped_gate_up_wgmma_kernel", x.dtype, num_pairs, num_experts, hidden_size, weight_tiles,
            args, stream)


def moe_grouped_down(expert_out: DeviceTensor, hidden: DeviceTensor, down: DeviceTensor, offsets: DeviceTensor,
                     tile_starts: DeviceTensor, stream: Stream) -> None:
    """expert_out[row] = down[e] @ hidden[row] for every sorted row of every expert e that has rows.
    hidden [P, I] (bf16/fp16), down [E, H, I] and expert_out [P, H] in hidden's dtype; tile_starts
    from `moe_grouped_gemm.plan_tiles`; fp32 accumulation, each output rounded once."""
    num_pairs, num_experts, hidden_size, inter_size = check_down_operands(expert_out, hidden, down, DTYPES)
    weight_tiles = -(-hidden_size // _TILE_N)
    require_plan(None, offsets, tile_starts, num_pairs, num_experts, weight_tiles)
    if num_pairs == 0 or hidden_size == 0:
        return
    device = _hopper(num_experts)
    weights = swizzled_boxes(down, _HALF_ROWS)
    args = [expert_out, hidden, weights, offsets, tile_starts, i32(num_experts), i32(hidden_size), i32(inter_size)]
    _launch(device, "moe_grouped_down_wgmma_kernel", hidden.dtype, num_pairs, num_experts, inter_size, weight_tiles,
            args, stream)


def _hopper(num_experts: int):
    """The current device, an sm_90 one: off it the kernels are traps, so this refuses first."""
    device = current_device()
    require(use_wgmma(device.arch), f"the wgmma expert GEMMs run on {WGMMA_ARCH} only, this device is {device.arch}")
    require(num_experts <= MAX_EXPERTS, f"the wgmma expert GEMMs take at most {MAX_EXPERTS} experts, got {num_experts}")
    return device


def _launch(device, kernel_name: str, dtype: DType, num_pairs: int, num_experts: int, k_size: int, weight_tiles: int,
            args: list, stream: Stream) -> None:
    """The persistent grid of clusters on the sm_90 `device`."""
    cluster = cluster_size(num_pairs, num_experts, k_size)
    kernel = get_kernel(_spec(kernel_name, dtype, cluster))
    _require_register_budget(kernel)
    max_clusters = _max_clusters(kernel, cluster, device.sm_count)
    blocks = persistent_blocks(num_pairs, num_experts, weight_tiles, max_clusters, cluster)
    kernel.launch(blocks, _THREADS, args, shared_mem=SMEM_BYTES, stream=stream,
                  cluster=(cluster, 1, 1) if cluster > 1 else None)


_max_clusters_of: dict[str, int] = {}


def _max_clusters(kernel: Kernel, cluster: int, sm_count: int) -> int:
    """Clusters of `cluster` blocks the device runs at once (one block an SM; a cluster's blocks
    share a GPC, so pairs may leave SMs over): the persistent grid's size."""
    if cluster == 1:
        return sm_count
    if kernel.name not in _max_clusters_of:
        kernel.allow_dynamic_shared(SMEM_BYTES)
        config = cluster_launch_config(cluster, _THREADS, cluster, SMEM_BYTES, driver.CUstream(0))
        clusters = call(driver.cuOccupancyMaxActiveClusters, kernel.function, config)
        require(clusters >= 1, f"{kernel.name} fits no cluster of {cluster} blocks on this device")
        _max_clusters_of[kernel.name] = clusters
    return _max_clusters_of[kernel.name]


_budgets_checked: set[str] = set()


def _require_register_budget(kernel: Kernel) -> None:
    """setmaxnreg deadlocks a block that starts with fewer registers than the budgets it moves:
    refuse such a build (a different ptxas) instead of hanging the device."""
    if kernel.name in _budgets_checked:
        return
    registers = call(driver.cuFuncGetAttribute, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS,
                     kernel.function)
    if registers < _LAUNCH_REGISTERS:
        raise RuntimeError(f"{kernel.name} was built with {registers} registers a thread; its setmaxnreg budgets "
                           f"need {_LAUNCH_REGISTERS}")
    _budgets_checked.add(kernel.name)
