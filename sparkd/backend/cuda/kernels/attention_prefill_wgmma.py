"""Hopper prefill attention launcher (cukernels/attention_prefill_wgmma.cu): `prefill_attention` on
warpgroup MMAs (wgmma, sm_90a) for bf16 / fp16 at head_dim 128, sm_90 devices only.

Same operands, outputs and semantics as `attention.prefill_attention` (varlen causal paged
attention with GQA; query token i of sequence s at position seq_lens[s] - query_len + i):

  q, out [T, Hq, D] contiguous        k_cache, v_cache [NB, Hkv, BS, D]
  meta: CudaAttentionMetadata (device query_start_loc [B+1], seq_lens [B], block_tables [B, max_blocks])

A block is one producer warpgroup (cp.async of K and V tiles of 64 keys through the block table
into a 4-stage ring, mbarriers) and two consumer warpgroups (64 packed query rows each: S = Q K^T
on wgmma m64n64k16 and O += P V on m64n128k16, P kept in two register buffers; the next tile's S
is issued with this tile's P V, whose wait follows the next softmax, and the two consumers take
turns issuing GEMMs: FlashAttention-3's intra- and inter-warpgroup overlap). The grid depends on
max_query_len and the head counts only, so launches are graph-capturable; the result is deterministic.
CudaOps picks this where `use_wgmma_prefill(device arch, dtype, head_dim, max_query_len)` holds.
"""

from __future__ import annotations

import math

from ...dtypes import DType
from ..attention_metadata import CudaAttentionMetadata
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream, current_device
from ..tensor import DeviceTensor
from . import require
from .attention import _check, _common_args
from .moe_grouped_wgmma import WGMMA_ARCH, _require_register_budget

_SOURCE = "attention_prefill_wgmma.cu"
HEAD_DIM = 128  # kHeadDim: 64 and 256 stay on the mma.sync kernel
DTYPES = (DType.bfloat16, DType.float16)
BLOCK_ROWS = 128  # kBlockRows: packed query rows (token * group + head) per block
_KEYS = 64  # kKeys: keys per K / V tile
_STAGES = 4  # kStages
_THREADS = 384  # kThreads: a producer and two consumer warpgroups
_ROW_BYTES = HEAD_DIM * 2  # a row of 16-bit elements
# Dynamic shared memory: slack to the first 1024-byte boundary (the swizzle's period), the Q
# tile and a K and a V tile per stage, then q_full and a k_full, v_full and empty barrier a stage.
SMEM_BYTES = 1024 + (BLOCK_ROWS + 2 * _STAGES * _KEYS) * _ROW_BYTES + 8 * (1 + 3 * _STAGES)


def _spec(dtype: DType) -> KernelSpec:
    return KernelSpec(_SOURCE, f"prefill_attention_wgmma_kernel<{dtype.c_type}>")


SPECS = [_spec(dtype) for dtype in DTYPES]


# Measured on an H100 (docs/benchmarks.md, session 22, tools/bench_attention_prefill.py), against
# mma.sync: one prompt of 1024 tokens 1.84x, 8 of 1024 1.23x, one of 4096 1.52x; below a
# 1024-token query it depends on the batch (one prompt of 512 1.57x, 16 of 512 0.95x, 16 of
# 128 0.68x), so the rule stops at 1024. The serving default of 2048 tokens a step is above it.
MIN_QUERY_LEN = 1024


def use_wgmma_prefill(device_arch: str, dtype: DType, head_dim: int, max_query_len: int) -> bool:
    """The host's rule for CudaOps.attention's prefill: this kernel on sm_90 for bf16 / fp16 at
    head_dim 128 once a step's longest query has MIN_QUERY_LEN tokens; `attention.prefill_attention`
    (mma.sync, or the fp32 FMA path) otherwise."""
    return device_arch == WGMMA_ARCH and dtype in DTYPES and head_dim == HEAD_DIM and max_query_len >= MIN_QUERY_LEN


def grid(max_query_len: int, group: int, num_kv_heads: int, num_seqs: int) -> tuple[int, int]:
    """(row tiles x kv heads, sequences): row tiles of BLOCK_ROWS packed rows of the longest query."""
    return math.ceil(max_query_len * group / BLOCK_ROWS) * num_kv_heads, num_seqs


def prefill_attention_wgmma(out: DeviceTensor, q: DeviceTensor, k_cache: DeviceTensor, v_cache: DeviceTensor,
                            meta: CudaAttentionMetadata, scale: float, stream: Stream | None) -> None:
    """out [T, Hq, D] = causal attention of every new token in the step, as `attention.prefill_attention`.
    The caches must already hold this step's K/V (rope_write_kv runs first)."""
    sizes = _check(out, q, k_cache, v_cache, meta)
    require(sizes.dtype in DTYPES, f"q dtype {sizes.dtype.name} is not supported by the wgmma prefill; expected "
                                   f"one of {[d.name for d in DTYPES]}")
    require(sizes.head_dim == HEAD_DIM,
            f"head_dim {sizes.head_dim} is not supported by the wgmma prefill; expected {HEAD_DIM}")
    if sizes.num_seqs == 0 or sizes.num_tokens == 0:
        return
    require(meta.max_query_len >= 1, f"meta.max_query_len must be >= 1, got {meta.max_query_len}")
    device = current_device()
    require(device.arch == WGMMA_ARCH, f"the wgmma prefill attention runs on {WGMMA_ARCH} only, "
                                       f"this device is {device.arch}")
    kernel = get_kernel(_spec(sizes.dtype))
    _require_register_budget(kernel)
    kernel.launch(grid(meta.max_query_len, sizes.group, sizes.num_kv_heads, sizes.num_seqs), _THREADS,
                  [out, *_common_args(q, k_cache, v_cache, meta, sizes, scale)], shared_mem=SMEM_BYTES, stream=stream)
