"""The slots of a hybrid model's linear-attention state pool: which running request owns which.

A gated delta net layer keeps, per sequence, a conv window and a recurrent state instead of
K/V blocks; the backend holds them in fixed arrays with one slot per sequence that can run
at once (`Ops.allocate_linear_attention_state`). This pool is only integers: a request takes
a slot when it is admitted and gives it back when it finishes, is aborted or is preempted.
A freed slot needs no clearing: a sequence with no cached tokens starts from a zero state
whatever its slot holds, so the next owner overwrites it.
"""

from __future__ import annotations

from collections import deque

from .request import Request


class StateSlotPool:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"the state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._owners: dict[int, Request] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, request: Request) -> int:
        """Give `request` a free slot (recorded as request.state_slot); RuntimeError when none is free."""
        if request.state_slot is not None:
            raise RuntimeError(f"request {request.request_id!r} already holds state slot {request.state_slot}")
        if not self._free:
            raise RuntimeError("no free state slot: admission must check num_free first")
        slot = self._free.popleft()
        self._owners[slot] = request
        request.state_slot = slot
        return slot

    def free(self, request: Request) -> None:
        """Return the request's slot, if it holds one."""
        slot = request.state_slot
        if slot is None:
            return
        if self._owners.get(slot) is not request:
            raise RuntimeError(f"request {request.request_id!r} names state slot {slot}, which it does not own")
        del self._owners[slot]
        self._free.append(slot)
        request.state_slot = None

    def check_integrity(self, running: list[Request]) -> None:
        """RuntimeError unless exactly the running requests own slots, each its own, and the rest are free."""
        problems = []
        if set(self._owners.values()) != set(running) or len(self._owners) != len(running):
            problems.append("state slots are held by other requests than the running ones")
        if any(request.state_slot != slot for slot, request in self._owners.items()):
            problems.append("a request's state_slot disagrees with the pool")
        if sorted([*self._free, *self._owners]) != list(range(self.num_slots)):
            problems.append("the free and owned state slots do not partition the pool")
        if problems:
            raise RuntimeError("state pool is inconsistent: " + "; ".join(problems))
