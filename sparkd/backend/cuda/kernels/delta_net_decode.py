"""Launcher of the gated delta net's fused decode tail (cukernels/delta_rule_decode.cu): the gates,
the token-by-token delta rule and the gated RMSNorm by z in one launch, the CUDA form of
`Ops.gated_delta_net` at the steps it takes (`pick_fused`; the rest run delta_net.py's three).

The kernel keeps the token-by-token rule's blocks (`delta_net.recurrent_blocks`: a block per
(sequence, value head, columns of its state)) and launches each head's blocks as one thread-block
cluster, through which they add up the norm's sum of squares over the head's dv outputs.
"""

from __future__ import annotations

import numpy as np

from ...base import DeltaNetShape
from ..attention_metadata import CudaAttentionMetadata
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream
from ..tensor import DeviceTensor
from . import ELEMENT_TYPES, i32, require, row_stride
from .delta_net import (MAX_DK, STATE_TYPES, kernel_name, pick_form, recurrent_blocks, require_gate_inputs,
                        require_rule_operands, segment_args)

_SOURCE = "delta_rule_decode.cu"
_KERNEL = "gated_delta_net_decode_kernel"
MAX_CLUSTER = 8  # the portable cluster size: the most blocks a head's columns may take
# The most sequences a step may have for the fused launch. Measured on the H200 (Qwen3-Next-80B
# shape, docs/benchmarks.md session 12): at batch 1 the fused tail took 7.1 us a layer against
# 9.1 for the three launches (forward +2.6%), but at batch 64 the forward lost 3.7%: 16384 blocks
# in clusters of 8, a cluster barrier a token, against three launches whose cost that grid
# amortises. Batches 2-4 (unmeasured) keep the grid near one wave (Qwen3-Next: 256 blocks a
# sequence, ~7 of 128 threads an SM by registers).
FUSED_MAX_SEQS = 4
SPECS = [KernelSpec(_SOURCE, kernel_name(_KERNEL, t, s, d)) for t in ELEMENT_TYPES for s in STATE_TYPES
         for d in MAX_DK]


def fused_fits(shape: DeltaNetShape, norm_dim: int) -> bool:
    """Whether the fused kernel takes these head sizes: dk at most MAX_DK[-1], the norm's groups
    the heads (norm_dim == dv), and a head's blocks one cluster (at most MAX_CLUSTER; Qwen3-Next's
    dk = dv = 128: 8 blocks of 16 columns)."""
    return shape.k_dim <= MAX_DK[-1] and norm_dim == shape.v_dim and recurrent_blocks(shape).per_head <= MAX_CLUSTER


def pick_fused(attn: CudaAttentionMetadata, shape: DeltaNetShape, norm_dim: int) -> bool:
    """Whether `Ops.gated_delta_net` runs the fused kernel at this step: at the steps of at most
    FUSED_MAX_SEQS sequences the token-by-token rule takes (`pick_form`: decode, or heads the
    chunked form does not take) where it `fused_fits`; prefill keeps the chunked rule between the
    gates' and the norm's launches, and larger decode batches the three launches."""
    return (attn.num_seqs <= FUSED_MAX_SEQS and pick_form(attn, shape) == "recurrent"
            and fused_fits(shape, norm_dim))


def gated_delta_net_decode(out: DeviceTensor, mixed_qkv: DeviceTensor, a: DeviceTensor, b: DeviceTensor,
                           a_log: DeviceTensor, dt_bias: DeviceTensor, z: DeviceTensor, norm_weight: DeviceTensor,
                           eps: float, state: DeviceTensor, attn: CudaAttentionMetadata, shape: DeltaNetShape,
                           stream: Stream) -> None:
    """out [T, Hv dv] (contiguous) = gated_rmsnorm(gated_delta_rule(mixed_qkv, g, beta, state), z,
    norm_weight, eps) with (g, beta) = delta_net_gates(a, b, a_log, dt_bias), in one launch (the
    rule's output rounded to mixed_qkv's dtype before the norm, as the three launches store it).
    mixed_qkv [T, 2 Hk dk + Hv dv], a, b [T, Hv] at one row stride, z [T, Hv dv] (the rows of
    each may be spaced, their columns contiguous), a_log, dt_bias [Hv], norm_weight [dv]: one
    dtype; state [slots, Hv, dk, dv] in one of STATE_TYPES (updated, snapshots written). Any step
    (several tokens a sequence too) of head sizes the kernel `fused_fits`."""
    hk, dk, hv, dv = shape.num_k_heads, shape.k_dim, shape.num_v_heads, shape.v_dim
    require_rule_operands(out, mixed_qkv, state, shape)
    require_gate_inputs(a, b, a_log, dt_bias)
    tokens, dtype = mixed_qkv.shape[0], mixed_qkv.dtype
    require(a.shape == (tokens, hv) and a.strides[1] == 1 and a.dtype is dtype,
            f"a and b must be [{tokens}, {hv}] {dtype.name} with contiguous columns, got {a}")
    require(z.shape == (tokens, hv * dv) and z.strides[1] == 1 and z.dtype is dtype,
            f"z must be [{tokens}, {hv * dv}] {dtype.name} with contiguous columns, got {z}")
    require(norm_weight.shape == (dv,) and norm_weight.dtype is dtype, f"norm_weight must be [{dv}] {dtype.name}")
    require(fused_fits(shape, dv), f"the fused decode tail takes dk <= {MAX_DK[-1]} and a head's blocks in one "
                                   f"cluster of at most {MAX_CLUSTER}, got dk {dk}, dv {dv}")
    segments = segment_args(attn)
    if tokens == 0:
        return
    blocks = recurrent_blocks(shape)
    get_kernel(KernelSpec(_SOURCE, kernel_name(_KERNEL, dtype, state.dtype, blocks.max_dk))).launch(
        (hv, attn.num_seqs, blocks.per_head), blocks.threads,
        [out, mixed_qkv, np.int64(row_stride(mixed_qkv)), a, b, np.int64(row_stride(a)), a_log, dt_bias, z,
         np.int64(row_stride(z)), norm_weight, np.float32(eps), state, *segments, i32(hk), i32(hv), i32(dk), i32(dv)],
        stream=stream, cluster=(1, 1, blocks.per_head))
