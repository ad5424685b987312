"""The gated delta net's sequence mixing in numpy (Qwen3-Next's linear-attention layers), float32.

Each sequence of a step is a segment of the flattened tokens with a state slot: its conv
window (the last W - 1 inputs of the causal conv) and its recurrent state S [Hv, dk, dv].
A segment with no cached tokens starts from zeros, whatever its slot holds; every segment
leaves its slot holding the state after its last token, so the next chunk or decode step
of that sequence continues from it.

The delta rule, per value head, with q and k L2-normalised and q scaled by dk^-0.5:
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T,    o_t = S_t^T q_t
`recurrent_delta_rule` runs it token by token (decode, and the reference); `chunked_delta_rule`
runs it 64 tokens at a time in the WY form (prefill), as flash-linear-attention and
transformers' torch fallback do. They agree to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..base import DeltaNetShape
from ..dtypes import DType, decode, encode

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6  # transformers' and flash-linear-attention's l2norm eps


@dataclass(frozen=True)
class StateSegment:
    """One sequence of a step: tokens [start, stop) of T, `num_cached` tokens before them, state
    `slot`; snapshots: (n, slot) pairs, the state after its first n tokens copied to that slot too."""

    start: int
    stop: int
    num_cached: int
    slot: int
    snapshots: tuple[tuple[int, int], ...] = ()


# A state pool's host arrays: float32, float16, or bf16 as uint16 bits (what `encode` gives).
_STATE_TYPES = {np.dtype(np.float32): DType.float32, np.dtype(np.float16): DType.float16,
                np.dtype(np.uint16): DType.bfloat16}


def read_state(held: np.ndarray) -> np.ndarray:
    """A slot of a state pool as float32."""
    return decode(held, _STATE_TYPES[held.dtype]).astype(np.float32, copy=False)


def to_state(value: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """float32 `value` as `pool` holds it (rounded to nearest even)."""
    return encode(value, _STATE_TYPES[pool.dtype])


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) = inf for x << 0 gives the right limit, 0
        return 1.0 / (1.0 + np.exp(-x))


def causal_conv1d_silu(x: np.ndarray, weight: np.ndarray, conv_state: np.ndarray,
                       segments: list[StateSegment]) -> np.ndarray:
    """silu(depthwise causal conv of each segment's channels over its window and new tokens).

    x [T, C] (rows may be strided), weight [C, W], conv_state [slots, C, W - 1] (updated in
    place: the last W - 1 inputs of each segment, older ones from the window when the
    segment is shorter; float32, float16 or bf16 bits: read_state) -> [T, C] float32."""
    width = weight.shape[1]
    out = np.empty(x.shape, np.float32)
    for seg in segments:
        window = read_state(conv_state[seg.slot]) if seg.num_cached else np.zeros(conv_state.shape[1:], np.float32)
        inputs = np.concatenate([window, x[seg.start:seg.stop].T.astype(np.float32)], axis=1)  # [C, W - 1 + L]
        length = seg.stop - seg.start
        conv = sum(weight[:, j : j + 1] * inputs[:, j : j + length] for j in range(width))  # [C, L]
        out[seg.start:seg.stop] = conv.T
        conv_state[seg.slot] = to_state(inputs[:, -(width - 1):], conv_state)
        for offset, slot in seg.snapshots:  # the window after `offset` tokens
            conv_state[slot] = to_state(inputs[:, offset : offset + width - 1], conv_state)
    return out * sigmoid(out)


def l2norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(L2NORM_EPS))


def gated_delta_rule(mixed_qkv: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray,
                     segments: list[StateSegment], shape: DeltaNetShape) -> np.ndarray:
    """The delta rule over each segment, from its slot's state (zeros with no cached tokens).

    mixed_qkv [T, C] = [q (Hk dk) | k (Hk dk) | v (Hv dv)] (the conv's output), g, beta [T, Hv]
    float32, state [slots, Hv, dk, dv] as read_state reads it (updated in place, rounded to its
    type where stored; a segment runs on in float32 past its snapshots) -> o [T, Hv dv] float32.
    Segments of one token run the recurrent form, longer ones the chunked form."""
    hk, dk, hv, dv = shape.num_k_heads, shape.k_dim, shape.num_v_heads, shape.v_dim
    tokens = mixed_qkv.shape[0]
    q = mixed_qkv[:, : hk * dk].reshape(tokens, hk, dk).astype(np.float32)
    k = mixed_qkv[:, hk * dk : 2 * hk * dk].reshape(tokens, hk, dk).astype(np.float32)
    v = mixed_qkv[:, 2 * hk * dk :].reshape(tokens, hv, dv).astype(np.float32)
    # Each q/k head serves Hv / Hk consecutive value heads.
    q = np.repeat(l2norm(q), hv // hk, axis=1) * np.float32(dk**-0.5)
    k = np.repeat(l2norm(k), hv // hk, axis=1)
    out = np.empty((tokens, hv, dv), np.float32)
    for seg in segments:
        current = read_state(state[seg.slot]) if seg.num_cached else np.zeros((hv, dk, dv), np.float32)
        # The segment in pieces that end at its snapshot points, each continuing from the last.
        ends = sorted({seg.stop, *(seg.start + offset for offset, _ in seg.snapshots)})
        for lo, hi in zip([seg.start, *ends[:-1]], ends):
            if hi > lo:
                run = recurrent_delta_rule if hi - lo == 1 else chunked_delta_rule
                out[lo:hi], current = run(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], current)
            for offset, slot in seg.snapshots:
                if seg.start + offset == hi:
                    state[slot] = to_state(current, state)
        state[seg.slot] = to_state(current, state)
    return out.reshape(tokens, hv * dv)


def recurrent_delta_rule(q, k, v, g, beta, state) -> tuple[np.ndarray, np.ndarray]:
    """Token by token. q, k [L, Hv, dk] (normed, q scaled), v [L, Hv, dv], g, beta [L, Hv],
    state [Hv, dk, dv] -> (o [L, Hv, dv], the state after the last token)."""
    state = state.copy()
    out = np.empty(v.shape, np.float32)
    for t in range(q.shape[0]):
        state *= np.exp(g[t])[:, None, None]
        predicted = np.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - predicted) * beta[t][:, None]
        state += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", q[t], state)
    return out, state


def chunked_delta_rule(q, k, v, g, beta, state, chunk_size: int = CHUNK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """The same recurrence CHUNK_SIZE tokens at a time (WY form). Within a chunk, with G the
    cumulative sum of g and D[i, j] = exp(G_i - G_j) for j <= i (else 0):
        T = (I + strictly_lower((beta k) k^T * D))^-1
        u = T (beta v),   w = T (beta k exp(G))        (the chunk's values and decayed keys)
        v' = u - w S,     o = (q exp(G)) S + ((q k^T) * D) v'
        S  = exp(G_last) S + (k exp(G_last - G))^T v'
    Arguments and result as `recurrent_delta_rule`."""
    length = q.shape[0]
    state = state.copy()
    out = np.empty(v.shape, np.float32)
    for start in range(0, length, chunk_size):
        rows = slice(start, min(start + chunk_size, length))
        qc, kc, vc = (x[rows].transpose(1, 0, 2) for x in (q, k, v))  # [Hv, C, d]
        gc, bc = g[rows].T, beta[rows].T  # [Hv, C]
        size = qc.shape[1]
        cum = np.cumsum(gc, axis=1)  # [Hv, C]
        lower = np.tril(np.ones((size, size), bool))
        decay = np.where(lower, np.exp(np.where(lower, cum[:, :, None] - cum[:, None, :], 0.0)), 0.0)
        k_beta = kc * bc[:, :, None]
        system = np.eye(size, dtype=np.float32) + np.tril((k_beta @ kc.transpose(0, 2, 1)) * decay, -1)
        u = np.linalg.solve(system, vc * bc[:, :, None])
        w = np.linalg.solve(system, k_beta * np.exp(cum)[:, :, None])
        v_new = u - w @ state
        intra = (qc @ kc.transpose(0, 2, 1)) * decay
        out[rows] = ((qc * np.exp(cum)[:, :, None]) @ state + intra @ v_new).transpose(1, 0, 2)
        last = cum[:, -1]
        state = (np.exp(last)[:, None, None] * state
                 + (kc * np.exp(last[:, None] - cum)[:, :, None]).transpose(0, 2, 1) @ v_new).astype(np.float32)
    return out, state


def gated_rmsnorm(x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """rmsnorm(x) * weight * silu(z) over groups of D = len(weight) columns: x, z [T, N] (N a
    multiple of D; z's rows may be strided) -> [T, N] float32."""
    tokens, width = x.shape
    dim = weight.shape[0]
    groups = x.reshape(tokens, width // dim, dim).astype(np.float32)
    normed = groups / np.sqrt(np.mean(groups * groups, axis=-1, keepdims=True) + np.float32(eps)) * weight
    gate = np.ascontiguousarray(z, np.float32).reshape(tokens, width // dim, dim)
    return (normed * gate * sigmoid(gate)).reshape(tokens, width)
