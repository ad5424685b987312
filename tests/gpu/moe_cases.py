"""Routing cases and the float64 reference shared by the expert GEMM tests
(test_moe_gemm.py, test_moe_grouped_gemm.py): host copies of what the alignment kernel
makes, so those tests do not depend on it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparkd.backend.cpu.moe import group_by_expert, silu_and_mul


@dataclass
class Routing:
    """Host copies of the alignment kernel's outputs for expert_ids [T, k] over E experts."""

    expert_ids: np.ndarray  # [T, k]
    sorted_pairs: np.ndarray  # [P]
    offsets: np.ndarray  # [E + 1]
    active_experts: np.ndarray  # [min(E, P)], past num_active: padding the kernels must not read
    num_active: np.ndarray  # [1]

    @classmethod
    def of(cls, expert_ids: np.ndarray, num_experts: int) -> Routing:
        pairs, offsets = group_by_expert(expert_ids, num_experts)
        active = np.flatnonzero(np.diff(offsets)).astype(np.int32)
        slots = min(num_experts, expert_ids.size)
        idle = np.setdiff1d(np.arange(num_experts), active)
        padding = idle[0] if idle.size else 0  # an idle expert's id, whose weights are NaN
        active_experts = np.full(slots, padding, np.int32)
        active_experts[: active.size] = active
        return cls(expert_ids, pairs.astype(np.int32), offsets.astype(np.int32), active_experts,
                   np.array([active.size], np.int32))

    def upload(self, gpu):
        return [gpu.upload(a) for a in (self.sorted_pairs, self.offsets, self.active_experts, self.num_active)]

    @property
    def row_of_pair(self) -> np.ndarray:
        rows = np.empty_like(self.sorted_pairs)
        rows[self.sorted_pairs] = np.arange(self.sorted_pairs.size, dtype=np.int32)
        return rows


def random_choices(rng, num_tokens: int, top_k: int, experts: np.ndarray) -> np.ndarray:
    """[T, k] distinct experts per token, drawn from `experts`."""
    picks = np.argsort(rng.random((num_tokens, experts.size)), axis=1)[:, :top_k]
    return experts[picks].astype(np.int32)


def random_expert_weights(gpu, rng, num_experts, hidden, inter, dtype, idle):
    """gate_up [E, 2I, H] and down [E, H, I] on the device, NaN for the idle experts (never read)."""
    gate_up = rng.standard_normal((num_experts, 2 * inter, hidden), dtype=np.float32) / np.sqrt(hidden)
    down = rng.standard_normal((num_experts, hidden, inter), dtype=np.float32) / np.sqrt(inter)
    gate_up[idle], down[idle] = np.nan, np.nan
    return gpu.upload(gate_up, dtype), gpu.upload(down, dtype)


def reference(x, gate_up, down, routing: Routing):
    """(hidden [P, I], expert_out [P, H]) in float64, rows in expert order."""
    x, gate_up, down = (np.asarray(a, np.float64) for a in (x, gate_up, down))
    top_k = routing.expert_ids.shape[1]
    hidden = np.zeros((routing.sorted_pairs.size, gate_up.shape[1] // 2))
    expert_out = np.zeros((routing.sorted_pairs.size, down.shape[1]))
    for expert in routing.active_experts[: routing.num_active[0]]:
        rows = slice(routing.offsets[expert], routing.offsets[expert + 1])
        hidden[rows] = silu_and_mul(x[routing.sorted_pairs[rows] // top_k] @ gate_up[expert].T)
        expert_out[rows] = hidden[rows] @ down[expert].T
    return hidden, expert_out
