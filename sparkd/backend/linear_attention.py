"""The `Ops` of the hybrid models' linear-attention layers (Qwen3-Next's gated delta nets): the
state pool, the conv, the gates, the delta rule, the gated norm, and the three after the conv as
one op. `Ops` takes them from `LinearAttention`; a backend that subclasses it (NumpyOps, CUDA's
DeltaNetOps) inherits the defaults here, the reference compositions.

Shapes: T tokens, C = 2 Hk dk + Hv dv conv channels, W the conv width, Hk / Hv key / value heads
of dk / dv (`DeltaNetShape`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .dtypes import DType

Tensor = Any


@dataclass(frozen=True)
class DeltaNetShape:
    """Head counts and sizes of a gated delta net: Hk key heads of dk, Hv value heads of dv (Hv % Hk == 0)."""

    num_k_heads: int
    k_dim: int
    num_v_heads: int
    v_dim: int

    @property
    def conv_dim(self) -> int:
        """Channels of the conv over [q | k | v]."""
        return 2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim


class LinearAttention(Protocol):
    """Part of `Ops` (see its conventions). Where a method has a body, that is its default."""

    def allocate_linear_attention_state(self, num_layers: int, num_slots: int, conv_dim: int, conv_width: int,
                                        num_v_heads: int, k_dim: int, v_dim: int,
                                        state_dtype: DType = DType.float32) -> list[tuple[Tensor, Tensor]]:
        """Per linear-attention layer (conv_state [slots, C, W - 1], recurrent_state [slots, Hv, dk, dv]),
        zeroed: the state pool of a hybrid model, one slot per running sequence. state_dtype
        (float32, bfloat16 or float16) is what the state is held in; the ops compute in float32
        and round to it where they store."""

    def copy_state_slots_(self, states: list[tuple[Tensor, Tensor]], src: np.ndarray, dst: np.ndarray) -> None:
        """In every linear-attention layer's (conv_state, recurrent_state), slot dst[i] = slot src[i]
        (int32 host arrays, dst distinct): a prefix-cache hit's restore, a rollback."""

    def causal_conv1d_silu(self, x: Tensor, weight: Tensor, conv_state: Tensor, attn: Any) -> Tensor:
        """silu of a depthwise causal conv along each sequence: x [T, C] (rows may be strided),
        weight [C, W], conv_state [slots, C, W - 1] float32 (the window before each sequence's new
        tokens, at its `state_slots` entry; zeros for a sequence with no cached tokens) -> [T, C]
        in x's dtype. Leaves each slot holding the last W - 1 inputs of its sequence."""

    def delta_net_gates(self, a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
        """A gated delta net's per-token decay and write strength: a, b [T, Hv] (rows may be
        strided), a_log, dt_bias [Hv] -> (g = -exp(a_log) * softplus(a + dt_bias),
        beta = sigmoid(b)), both [T, Hv] float32."""

    def gated_delta_rule(self, mixed_qkv: Tensor, g: Tensor, beta: Tensor, state: Tensor, attn: Any,
                         shape: DeltaNetShape) -> Tensor:
        """The gated delta rule along each sequence (`backend.cpu.gdn` states it): mixed_qkv
        [T, 2 Hk dk + Hv dv] = [q | k | v] (the conv's output), g, beta [T, Hv] float32, state
        [slots, Hv, dk, dv] float32 (read at each sequence's slot unless it has no cached
        tokens, and left holding its state after its last token; attn's state_snapshots copy it
        to other slots mid-sequence), shape a `DeltaNetShape` -> o [T, Hv dv] in mixed_qkv's
        dtype. q and k are L2-normalised inside, q scaled by dk^-0.5."""

    def delta_rule_scratch_bytes(self, tokens: int, shape: DeltaNetShape) -> int:
        """Scratch memory gated_delta_rule takes for a step of `tokens` rows beyond its output
        (the activation reserve counts it); the numpy form takes none worth counting."""
        return 0

    def gated_rmsnorm(self, x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
        """rmsnorm(x) * weight * silu(z) over each group of D = len(weight) columns (a head):
        x, z [T, N] (z's rows may be strided) -> [T, N] in x's dtype."""

    def gated_delta_net(self, mixed_qkv: Tensor, a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor, z: Tensor,
                        norm_weight: Tensor, eps: float, state: Tensor, attn: Any, shape: DeltaNetShape) -> Tensor:
        """A gated delta net's tail after its conv: `delta_net_gates`, then `gated_delta_rule` with
        those gates, then `gated_rmsnorm` of its output by z (the output rounded to mixed_qkv's
        dtype between the two, as the op returns it). mixed_qkv [T, 2 Hk dk + Hv dv], a, b [T, Hv],
        z [T, Hv dv] (rows may be strided), a_log, dt_bias [Hv], norm_weight [D], state and attn as
        gated_delta_rule's -> [T, Hv dv] in mixed_qkv's dtype. This composition is the reference
        (NumpyOps); a GPU runs the three in one launch at decode steps."""
        g, beta = self.delta_net_gates(a, b, a_log, dt_bias)
        core = self.gated_delta_rule(mixed_qkv, g, beta, state, attn, shape)
        return self.gated_rmsnorm(core, z, norm_weight, eps)
