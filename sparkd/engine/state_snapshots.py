"""Prefix caching for hybrid models: snapshots of the linear-attention state at block boundaries.

A prefix-cache hit restores K/V blocks; a hybrid model also needs its delta nets' state at the
end of the hit. While a prompt is prefilled, the state after certain full blocks is copied
into snapshot slots of the backend's state pool (`Ops.gated_delta_rule` and
`Ops.causal_conv1d_silu` write them mid-step), keyed by the chained hash of the block it
follows. A later request that hits those blocks keeps the longest prefix whose last block has
a snapshot and starts from a copy of it.

Which boundaries (`boundaries_to_snapshot`): every `interval` blocks of the prompt, and the
prompt's last full block, so that a prompt shorter than the interval still hits when it is
sent again, resumed after preemption, or extended by the next turn of a chat.

A snapshot is the state after exactly that prefix, so it stays right while its hash names
it, whether or not the K/V blocks are still cached (a hit needs both). Snapshots are
evicted least recently used, and a hit refreshes the one it uses. An entry is made when a
step that will write it is scheduled, and dropped if that step fails (`discard`), so every
entry names a state that is, or will be once the steps in flight have run, in its slot.
Only integers here.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_INTERVAL_BLOCKS = 4


def boundaries_to_snapshot(num_prompt_tokens: int, block_size: int, interval_blocks: int) -> list[int]:
    """Token counts after which a prompt's state is snapshotted: every interval_blocks blocks,
    and its last full block, ascending."""
    last_full = num_prompt_tokens // block_size
    blocks = set(range(interval_blocks, last_full + 1, interval_blocks))
    if last_full:
        blocks.add(last_full)
    return [b * block_size for b in sorted(blocks)]


class StateSnapshots:
    """Block hash -> the state pool slot holding the state after that block, for slots
    [first_slot, first_slot + num_slots) of the pool (after the running requests' slots)."""

    def __init__(self, first_slot: int, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a snapshot cache needs at least one slot, got {num_slots}")
        self.first_slot = first_slot
        self.num_slots = num_slots
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))

    def __len__(self) -> int:
        return len(self._slot_of)

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot of the state after the block `block_hash` names, refreshed as just used; or None."""
        slot = self._slot_of.get(block_hash)
        if slot is not None:
            self._slot_of.move_to_end(block_hash)
        return slot

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot for a new snapshot after `block_hash`, evicting the least recently used one
        when all are taken; None when that snapshot exists already (nothing to write)."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return None
        slot = self._free.pop() if self._free else self._slot_of.popitem(last=False)[1]
        self._slot_of[block_hash] = slot
        return slot

    def discard(self, slot: int) -> None:
        """Forget the snapshot in `slot`, if any (its step failed, so it may never have been written)."""
        block_hash = next((h for h, s in self._slot_of.items() if s == slot), None)
        if block_hash is not None:
            del self._slot_of[block_hash]
            self._free.append(slot)

    def check_integrity(self) -> None:
        """RuntimeError unless the used and free slots partition the snapshot range."""
        slots = sorted([*self._slot_of.values(), *self._free])
        if slots != list(range(self.first_slot, self.first_slot + self.num_slots)):
            raise RuntimeError("state snapshots are inconsistent: used and free slots do not partition their range")
