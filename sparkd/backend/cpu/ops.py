"""`NumpyOps`: the numpy backend, computing in float32.

It is the reference every CUDA kernel is checked against and the default where no
GPU exists. Tensors are plain `np.ndarray`s; each op works on the whole flattened
step at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..base import (AttentionMetadata, DrawnTokens, RopeConfig, SampledTokens, SamplerOutput, SamplingTensors,
                    column_ranges, pre_norm)
from ..dtypes import DType
from ..linear_attention import LinearAttention
from ..side_branch import in_order
from . import gdn
from .attention import AttentionPlan, paged_attention, plan_attention, write_kv
from .moe import moe_experts, moe_route, route_with_shared_expert, silu_and_mul
from .sampler import sample


class NumpyOps(LinearAttention):  # its gated_delta_net: LinearAttention's composition, the reference
    name = "cpu"
    dtype = np.dtype(np.float32)

    # ---- memory ----
    def upload(self, array: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
        """A private, contiguous copy (cast to `dtype` if given)."""
        return np.array(array, dtype=dtype, order="C", copy=True)

    def download(self, x: np.ndarray) -> np.ndarray:
        return np.array(x, copy=True)

    def empty(self, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
        return np.empty(tuple(shape), dtype=dtype)

    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        return [(np.zeros(shape, self.dtype), np.zeros(shape, self.dtype)) for _ in range(num_layers)]

    def allocate_linear_attention_state(self, num_layers: int, num_slots: int, conv_dim: int, conv_width: int,
                                        num_v_heads: int, k_dim: int, v_dim: int,
                                        state_dtype: DType = DType.float32) -> list[tuple[np.ndarray, np.ndarray]]:
        """Host arrays of state_dtype (bf16 as its uint16 bits): gdn reads them as float32 and
        rounds what it stores to their type."""
        return [(np.zeros((num_slots, conv_dim, conv_width - 1), state_dtype.host),
                 np.zeros((num_slots, num_v_heads, k_dim, v_dim), state_dtype.host)) for _ in range(num_layers)]

    def bind_thread(self) -> None:
        """numpy needs no per-thread setup."""

    def decode_graph_runner(self, max_batch_size: int, max_blocks_per_seq: int, max_seq_len: int,
                            padding_state_slot: int | None = None) -> None:
        return None  # no graphs: every step runs eagerly

    def prepare_attention(self, meta: AttentionMetadata) -> AttentionPlan:
        return plan_attention(meta)

    def beside(self, work):
        """One op at a time: work, then the with-block (`side_branch.in_order`)."""
        return in_order(work)

    # ---- compute ----
    def embedding(self, token_ids: np.ndarray, table: np.ndarray) -> np.ndarray:
        return table[token_ids]

    def rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        variance = np.mean(np.square(x), axis=-1, keepdims=True)
        return x / np.sqrt(variance + np.float32(eps)) * weight

    def add_rmsnorm(
        self, x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float
    ) -> tuple[np.ndarray, np.ndarray]:
        residual = x + residual
        return self.rmsnorm(residual, weight, eps), residual

    def add_rmsnorm_linear(self, x: np.ndarray, residual: np.ndarray | None, norm_weight: np.ndarray, eps: float,
                           weight: np.ndarray, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        y, residual = pre_norm(self, x, residual, norm_weight, eps)
        return self.linear(y, weight, bias), residual

    def add_rmsnorm_linear_silu_and_mul(self, x: np.ndarray, residual: np.ndarray | None, norm_weight: np.ndarray,
                                        eps: float, weight: np.ndarray,
                                        bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        y, residual = pre_norm(self, x, residual, norm_weight, eps)
        return self.linear_silu_and_mul(y, weight, bias), residual

    def add_rmsnorm_for_router(
        self, x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        y, residual = self.add_rmsnorm(x, residual, weight, eps)
        return y, y, residual  # float32 already

    def router_weight(self, router: np.ndarray, shared_gate: np.ndarray | None = None) -> np.ndarray:
        if shared_gate is not None:
            router = np.concatenate([router, shared_gate])
        return router.astype(np.float32, copy=False)

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None,
               out_dtype=None) -> np.ndarray:  # float32 already
        y = x @ weight.T
        if bias is not None:
            y += bias
        return y

    def linear_silu_and_mul(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        return self.silu_and_mul(self.linear(x, weight, bias))

    def split_heads(
        self, qkv: np.ndarray, num_q_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        num_tokens = qkv.shape[0]
        q_end = num_q_heads * head_dim
        k_end = q_end + num_kv_heads * head_dim
        q = qkv[:, :q_end].reshape(num_tokens, num_q_heads, head_dim)
        k = qkv[:, q_end:k_end].reshape(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, k_end:].reshape(num_tokens, num_kv_heads, head_dim)
        return q, k, v

    def rope_write_kv(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, rope: RopeConfig,
        k_cache: np.ndarray, v_cache: np.ndarray, attn: AttentionPlan,
        qk_norm: tuple[np.ndarray, np.ndarray, float] | None = None,
    ) -> np.ndarray:
        if qk_norm is not None:
            q_norm, k_norm, eps = qk_norm
            q, k = self.rmsnorm(q, q_norm, eps), self.rmsnorm(k, k_norm, eps)
        cos, sin = _rope_cos_sin(positions, rope)
        write_kv(_rotate(k, cos, sin), v, k_cache, v_cache, attn)
        return _rotate(q, cos, sin)

    def attention(
        self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, attn: AttentionPlan, scale: float
    ) -> np.ndarray:
        return paged_attention(q, k_cache, v_cache, attn, scale)

    def rope_attention(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, rope: RopeConfig,
        k_cache: np.ndarray, v_cache: np.ndarray, attn: AttentionPlan, scale: float,
        qk_norm: tuple[np.ndarray, np.ndarray, float] | None = None,
    ) -> np.ndarray:
        q = self.rope_write_kv(q, k, v, positions, rope, k_cache, v_cache, attn, qk_norm)
        return self.attention(q, k_cache, v_cache, attn, scale)

    def copy_state_slots_(self, states: list[tuple[np.ndarray, np.ndarray]], src: np.ndarray,
                          dst: np.ndarray) -> None:
        for conv_state, recurrent_state in states:
            conv_state[dst] = conv_state[src]
            recurrent_state[dst] = recurrent_state[src]

    def split_columns(self, x: np.ndarray, widths: Sequence[int]) -> list[np.ndarray]:
        return [x[:, lo:hi] for lo, hi in column_ranges(x.shape[1], widths)]

    def mul_sigmoid(self, x: np.ndarray, gate: np.ndarray, add_to: np.ndarray | None = None) -> np.ndarray:
        product = x * gdn.sigmoid(gate)
        return product if add_to is None else add_to + product

    def causal_conv1d_silu(self, x: np.ndarray, weight: np.ndarray, conv_state: np.ndarray,
                           attn: AttentionPlan) -> np.ndarray:
        return gdn.causal_conv1d_silu(x, weight, conv_state, attn.state_segments)

    def delta_net_gates(self, a: np.ndarray, b: np.ndarray, a_log: np.ndarray,
                        dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shifted = a + dt_bias
        softplus = np.where(shifted > 20.0, shifted, np.log1p(np.exp(np.minimum(shifted, 20.0))))  # torch's threshold
        return (-np.exp(a_log) * softplus).astype(np.float32), gdn.sigmoid(b).astype(np.float32)

    def gated_delta_rule(self, mixed_qkv: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray,
                         attn: AttentionPlan, shape: gdn.DeltaNetShape) -> np.ndarray:
        return gdn.gated_delta_rule(mixed_qkv, g, beta, state, attn.state_segments, shape)

    def gated_rmsnorm(self, x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        return gdn.gated_rmsnorm(x, z, weight, eps)

    def silu_and_mul(self, x: np.ndarray) -> np.ndarray:
        return silu_and_mul(x)

    def moe_route(self, router_logits: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
        return moe_route(router_logits, top_k, renormalize)

    def moe_experts(self, x: np.ndarray, gate_up: np.ndarray, down: np.ndarray, weights: np.ndarray,
                    expert_ids: np.ndarray) -> np.ndarray:
        return moe_experts(x, gate_up, down, weights, expert_ids)

    def sparse_moe(self, x: np.ndarray, router_input: np.ndarray, router: np.ndarray, gate_up: np.ndarray,
                   down: np.ndarray, top_k: int, renormalize: bool, shared_expert: bool = False) -> np.ndarray:
        route = route_with_shared_expert if shared_expert else moe_route
        weights, expert_ids = route(self.linear(router_input, router), top_k, renormalize)
        return self.moe_experts(x, gate_up, down, weights, expert_ids)

    def shared_expert_among_routed(self, num_tokens: int, top_k: int, num_experts: int) -> bool:
        return True

    def add(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return x + y

    def reshape(self, x: np.ndarray, shape: Sequence[int]) -> np.ndarray:
        return x.reshape(tuple(shape))

    def logits(
        self, hidden: np.ndarray, indices: np.ndarray, norm_weight: np.ndarray, eps: float, lm_head: np.ndarray
    ) -> np.ndarray:
        normed = self.rmsnorm(hidden[indices], norm_weight, eps)
        return (normed @ lm_head.T).astype(np.float32, copy=False)

    def check_weights_fit(self, weight_bytes: int, gpu_memory_utilization: float) -> None:
        pass  # host memory: the OS decides

    def load_kernels(self, progress=None) -> None:
        pass  # numpy has nothing to compile

    def sample(self, logits: np.ndarray, params: SamplingTensors) -> SamplerOutput:
        return sample(logits, params)

    def sample_async(self, logits: np.ndarray, params: SamplingTensors) -> SampledTokens:
        out = sample(logits, params)
        return SampledTokens(out.token_ids.astype(np.int32), lambda: out)

    def copy_drawn_tokens_(self, token_ids: np.ndarray, drawn: DrawnTokens) -> None:
        token_ids[drawn.rows] = drawn.ids[drawn.drawn_rows]


def _rope_cos_sin(positions: np.ndarray, rope: RopeConfig) -> tuple[np.ndarray, np.ndarray]:
    """-> cos, sin [T, 1, rotary_dim // 2] float32 (broadcast over heads)."""
    angles = positions.astype(np.float64)[:, None] * rope.inv_freq[None, :]
    cos = (np.cos(angles) * rope.attention_scaling).astype(np.float32)
    sin = (np.sin(angles) * rope.attention_scaling).astype(np.float32)
    return cos[:, None, :], sin[:, None, :]


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Neox rotary on the first rotary_dim dims of x [T, H, D]; the rest pass through."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half : 2 * half] = x2 * cos + x1 * sin
    return out
