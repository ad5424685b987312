"""Mixture of experts in numpy: routing (softmax, top-k, renormalisation) and the routed
SiLU expert MLPs with their weighted combine.

`moe_experts` takes the steps the GPU kernels take: sort the T*k (token, expert)
pairs by expert, run each expert's two GEMMs on its rows only, then sum each
token's k rows back in token order. Only experts some token chose are touched.
"""

from __future__ import annotations

import numpy as np


def silu_and_mul(x: np.ndarray) -> np.ndarray:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]. Shared with the dense MLP."""
    gate, up = np.split(x, 2, axis=-1)
    with np.errstate(over="ignore"):  # exp(-gate) = inf for gate << 0 gives the right limit, 0
        return gate / (1.0 + np.exp(-gate)) * up


def moe_route(router_logits: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """router_logits [T, E] -> (weights [T, k] float32, expert_ids [T, k] int32): the
    softmax's k largest probabilities per row, descending, ties to the lower expert id;
    divided by their sum when `renormalize`."""
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be between 1 and the number of experts ({num_experts}), got {top_k}")
    logits = router_logits.astype(np.float32)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    # A stable sort keeps equal probabilities in expert order, so ties go to the lower id.
    expert_ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, expert_ids, axis=-1)
    if renormalize:
        weights /= weights.sum(axis=-1, keepdims=True)
    return weights, expert_ids.astype(np.int32)


def group_by_expert(expert_ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Sort the (token, expert) pairs of expert_ids [T, k] by expert.

    Returns (pairs [T*k], offsets [E+1]): pairs[offsets[e]:offsets[e+1]] are the flat
    indices p into expert_ids of the pairs routed to expert e (token p // k, slot p % k),
    in token order."""
    flat = expert_ids.reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"expert_ids must lie in [0, {num_experts}), got [{flat.min()}, {flat.max()}]")
    pairs = np.argsort(flat, kind="stable")
    offsets = np.zeros(num_experts + 1, dtype=np.int64)
    np.cumsum(np.bincount(flat, minlength=num_experts), out=offsets[1:])
    return pairs, offsets


def route_with_shared_expert(router_logits: np.ndarray, top_k: int,
                             renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """router_logits [T, E + 1], the last column a shared expert's gate -> (weights, expert_ids)
    [T, k + 1]: `moe_route` of the first E, then expert E, weighted sigmoid(its logit)."""
    routed = router_logits.shape[-1] - 1
    weights, expert_ids = moe_route(router_logits[:, :routed], top_k, renormalize)
    gate = router_logits[:, routed:].astype(np.float32)
    shared_weight = (np.float32(1) / (np.float32(1) + np.exp(-gate))).astype(np.float32)
    return (np.concatenate([weights, shared_weight], axis=1),
            np.concatenate([expert_ids, np.full_like(expert_ids[:, :1], routed)], axis=1))


def moe_experts(
    x: np.ndarray, gate_up: np.ndarray, down: np.ndarray, weights: np.ndarray, expert_ids: np.ndarray
) -> np.ndarray:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], weights [T, k], expert_ids [T, k]
    -> sum_j weights[t, j] * expert_{expert_ids[t, j]}(x[t]), [T, H] in x's dtype. Each expert's
    output row is rounded to x's dtype (as a GPU stores it) before the fp32 weighted sum."""
    if weights.shape != expert_ids.shape or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"weights {weights.shape} and expert_ids {expert_ids.shape} must both be [T={x.shape[0]}, k]")
    num_tokens, top_k = expert_ids.shape
    pairs, offsets = group_by_expert(expert_ids, gate_up.shape[0])
    pair_out = np.empty((num_tokens * top_k, x.shape[1]), dtype=np.float32)  # one row per (token, slot)
    for expert in np.flatnonzero(np.diff(offsets)):
        rows = pairs[offsets[expert] : offsets[expert + 1]]
        hidden = silu_and_mul(x[rows // top_k] @ gate_up[expert].T)  # [n, I]
        pair_out[rows] = (hidden @ down[expert].T).astype(x.dtype, copy=False)
    pair_out *= weights.reshape(-1, 1)
    return pair_out.reshape(num_tokens, top_k, -1).sum(axis=1).astype(x.dtype, copy=False)
