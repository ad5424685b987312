"""The hybrid models' `Ops` on CUDA (gated delta nets): state pool, conv, gates, delta rule,
gated norm, the sigmoid gate and column views, through `kernels/delta_net.py`; the gates, rule and
norm in one launch at decode steps through `kernels/delta_net_decode.py`.

`CudaOps` takes these methods from `DeltaNetOps`; they use its allocator and stream. A step's
state slots and snapshot requests come in its `CudaAttentionMetadata` (`prepare_attention`
uploads them with the rest; a decode graph keeps them in its static region).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from cuda.bindings import driver

from ..base import DeltaNetShape, column_ranges
from ..dtypes import DType
from ..linear_attention import LinearAttention
from .attention_metadata import CudaAttentionMetadata
from .driver import call
from .kernels import delta_net, delta_net_decode
from .moe_ops import ExpertSum
from .tensor import DeviceTensor


class DeltaNetOps(LinearAttention):
    """Mixed into CudaOps: needs self.allocator, self.stream, self.zeros and (MoeOps) self.combined."""

    def allocate_linear_attention_state(self, num_layers: int, num_slots: int, conv_dim: int, conv_width: int,
                                        num_v_heads: int, k_dim: int, v_dim: int, state_dtype: DType = DType.float32
                                        ) -> list[tuple[DeviceTensor, DeviceTensor]]:
        return [(self.zeros((num_slots, conv_dim, conv_width - 1), state_dtype),
                 self.zeros((num_slots, num_v_heads, k_dim, v_dim), state_dtype)) for _ in range(num_layers)]

    def copy_state_slots_(self, states: list[tuple[DeviceTensor, DeviceTensor]], src: np.ndarray,
                          dst: np.ndarray) -> None:
        """One device copy per (layer, tensor, pair): a hit's restore, in an eager step."""
        for tensor in (t for pair in states for t in pair):
            slot_bytes = tensor.nbytes // tensor.shape[0]
            for s, d in zip(src.tolist(), dst.tolist()):
                call(driver.cuMemcpyDtoDAsync, tensor.ptr + d * slot_bytes, tensor.ptr + s * slot_bytes, slot_bytes,
                     self.stream.handle)

    def split_columns(self, x: DeviceTensor, widths: Sequence[int]) -> list[DeviceTensor]:
        return [x.column_slice(lo, hi - lo) for lo, hi in column_ranges(x.shape[1], widths)]

    def mul_sigmoid(self, x: DeviceTensor, gate: DeviceTensor, add_to: DeviceTensor | ExpertSum | None = None
                    ) -> DeviceTensor:
        out = self.allocator.empty(x.shape, x.dtype)
        delta_net.mul_sigmoid(out, x, gate, self.stream, None if add_to is None else self.combined(add_to))
        return out

    def causal_conv1d_silu(self, x: DeviceTensor, weight: DeviceTensor, conv_state: DeviceTensor,
                           attn: CudaAttentionMetadata) -> DeviceTensor:
        out = self.allocator.empty(x.shape, x.dtype)
        delta_net.causal_conv1d_silu(out, x, weight, conv_state, attn, self.stream)
        return out

    def delta_net_gates(self, a: DeviceTensor, b: DeviceTensor, a_log: DeviceTensor,
                        dt_bias: DeviceTensor) -> tuple[DeviceTensor, DeviceTensor]:
        g, beta = (self.allocator.empty(a.shape, DType.float32) for _ in range(2))
        delta_net.delta_net_gates(g, beta, a, b, a_log, dt_bias, self.stream)
        return g, beta

    def gated_delta_rule(self, mixed_qkv: DeviceTensor, g: DeviceTensor, beta: DeviceTensor, state: DeviceTensor,
                         attn: CudaAttentionMetadata, shape: DeltaNetShape) -> DeviceTensor:
        tokens = mixed_qkv.shape[0]
        out = self.allocator.empty((tokens, shape.num_v_heads * shape.v_dim), mixed_qkv.dtype)
        form = delta_net.pick_form(attn, shape)
        workspace = (self.allocator.empty((delta_net.chunk_workspace_floats(tokens, shape),), DType.float32)
                     if form == "chunked" else None)
        delta_net.gated_delta_rule(out, mixed_qkv, g, beta, state, attn, shape, self.stream, form, workspace)
        return out

    def delta_rule_scratch_bytes(self, tokens: int, shape: DeltaNetShape) -> int:
        return 4 * delta_net.chunk_workspace_floats(tokens, shape) if delta_net.chunked_fits(shape) else 0

    def gated_rmsnorm(self, x: DeviceTensor, z: DeviceTensor, weight: DeviceTensor, eps: float) -> DeviceTensor:
        out = self.allocator.empty(x.shape, x.dtype)
        delta_net.gated_rmsnorm(out, x, z, weight, eps, self.stream)
        return out

    def gated_delta_net(self, mixed_qkv: DeviceTensor, a: DeviceTensor, b: DeviceTensor, a_log: DeviceTensor,
                        dt_bias: DeviceTensor, z: DeviceTensor, norm_weight: DeviceTensor, eps: float,
                        state: DeviceTensor, attn: CudaAttentionMetadata, shape: DeltaNetShape) -> DeviceTensor:
        """One launch where the step suits it (`delta_net_decode.pick_fused`: the token-by-token
        form's steps); elsewhere (prefill's chunked form, heads too wide for one cluster) the three."""
        if not delta_net_decode.pick_fused(attn, shape, norm_weight.shape[0]):
            return super().gated_delta_net(mixed_qkv, a, b, a_log, dt_bias, z, norm_weight, eps, state, attn, shape)
        out = self.allocator.empty((mixed_qkv.shape[0], shape.num_v_heads * shape.v_dim), mixed_qkv.dtype)
        delta_net_decode.gated_delta_net_decode(out, mixed_qkv, a, b, a_log, dt_bias, z, norm_weight, eps, state, attn,
                                                shape, self.stream)
        return out
