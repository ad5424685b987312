"""`Ops.beside` without streams (`side_branch.in_order`, NumpyOps) and the MoE block that uses it:
the side work runs at the fork, its result is readable only after the join, and the block enqueues
its shared expert as side work, beside the routed experts, with the bits of the sequential order."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

from moe_blocks import sequential_forward, shared_expert_block
from sparkd.backend.cpu.ops import NumpyOps
from sparkd.backend.side_branch import in_order


def test_in_order_runs_the_work_at_the_fork_and_hands_its_result_over_at_the_join():
    log = []
    with in_order(lambda: log.append("work") or "result") as branch:
        log.append("block")
        with pytest.raises(RuntimeError, match="after its with-block"):
            branch.result
    assert log == ["work", "block"] and branch.result == "result"


LOGGED = ("add_rmsnorm_for_router", "linear_silu_and_mul", "linear", "sparse_moe", "mul_sigmoid")


class ScheduleOps(NumpyOps):
    """NumpyOps that logs the ops the block calls (and those they call), marking side work's."""

    def __init__(self):
        self.calls, self.on_side = [], False

    def __getattribute__(self, name):
        if name in LOGGED:
            self.calls.append(("side " if self.on_side else "") + name)
        return super().__getattribute__(name)

    @contextmanager
    def beside(self, work):
        def side_work():
            self.on_side = True
            try:
                return work()
            finally:
                self.on_side = False

        with in_order(side_work) as branch:
            yield branch
        self.calls.append("join")


def test_the_moe_block_runs_its_shared_expert_beside_the_routed_experts():
    """All the shared expert's ops are side work enqueued right after the norm, the routed experts
    are not, and the gated sum comes after the join; the output is the sequential order's, bit for bit."""
    rng = np.random.default_rng(0)
    ops = ScheduleOps()
    block = shared_expert_block(ops, rng)
    x, residual = rng.standard_normal((2, 5, 64), dtype=np.float32)
    norm_weight = 1 + 0.1 * rng.standard_normal(64, dtype=np.float32)
    ops.calls.clear()
    out, residual_out = block.forward(x, residual, norm_weight)
    side = [call for call in ops.calls if call.startswith("side ")]
    assert set(side) == {"side linear_silu_and_mul", "side linear"}
    assert ops.calls[:len(side) + 2] == ["add_rmsnorm_for_router", *side, "sparse_moe"]
    assert ops.calls[-2:] == ["join", "mul_sigmoid"]
    expected_out, expected_residual = sequential_forward(block, x, residual, norm_weight)
    np.testing.assert_array_equal(out, expected_out)
    np.testing.assert_array_equal(residual_out, expected_residual)
