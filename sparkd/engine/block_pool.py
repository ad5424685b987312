"""The physical KV blocks: ids, ref counts, an LRU free queue and the block-hash -> block map."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass
class BlockPoolStats:
    num_blocks: int
    num_free_blocks: int  # ref count 0, cached or not
    num_cached_blocks: int  # holding a block hash, in use or free
    num_evictions: int  # cached blocks whose hash was dropped so the block could be reused


class BlockPool:
    """Owns every KV block of the cache; knows nothing about requests.

    A block is either in use (ref_cnt > 0) or free (ref_cnt 0, in the free queue).
    A free block may still hold a block hash: its K/V stay valid, and a prefix hit
    revives it (`touch`) until `allocate` hands it out again. That is the only
    place a hash is dropped (eviction), so cached blocks go only when reused.
    The free queue runs least recently freed first; `allocate` takes from the front.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # An OrderedDict is an LRU queue with O(1) pop-front, push-back and
        # removal from the middle (a cached free block revived by a prefix hit).
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (ref_cnt 1, no hash), evicting cached ones in LRU order."""
        if num_blocks > len(self._free_queue):
            raise ValueError(f"cannot allocate {num_blocks} blocks, only {len(self._free_queue)} are free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            block_hash = self.block_hash[block_id]
            if block_hash is not None:
                del self._cached[block_hash]
                self.block_hash[block_id] = None
                self.num_evictions += 1
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit or a fork); revives free ones."""
        ref_cnt = self.ref_cnt
        for block_id in block_ids:
            if ref_cnt[block_id] == 0:
                del self._free_queue[block_id]
            ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; those reaching 0 join the back of the free queue
        in the order given, keeping their hash."""
        ref_cnt = self.ref_cnt
        for block_id in block_ids:
            if ref_cnt[block_id] <= 0:
                raise ValueError(f"block {block_id} freed more often than it was taken")
            ref_cnt[block_id] -= 1
            if ref_cnt[block_id] == 0:
                self._free_queue[block_id] = None

    def lookup(self, block_hash: bytes) -> int | None:
        """The cached block holding this hash, in use or free, or None."""
        return self._cached.get(block_hash)

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Publish a full, computed block under its hash.

        When two requests computed the same content separately, the first block
        stays the cached one and the other stays a plain block.
        """
        if self.block_hash[block_id] is None and block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash

    def usage(self) -> float:
        """Fraction of blocks in use (cached free blocks count as free)."""
        return 1.0 - len(self._free_queue) / self.num_blocks

    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(self.num_blocks, len(self._free_queue), len(self._cached), self.num_evictions)

    def check_integrity(self, expected_ref_cnt: Mapping[int, int]) -> None:
        """Raise RuntimeError unless the ref counts equal `expected_ref_cnt` (block id ->
        number of block tables holding it), the free queue holds exactly the blocks
        with ref count 0, and the hash map and the per-block hashes agree. O(num_blocks)."""
        problems = []
        for block_id, ref_cnt in enumerate(self.ref_cnt):
            expected = expected_ref_cnt.get(block_id, 0)
            if ref_cnt != expected:
                problems.append(f"block {block_id} has ref_cnt {ref_cnt}, tables hold it {expected} times")
            in_free_queue = block_id in self._free_queue
            if (ref_cnt == 0) != in_free_queue:
                where = "in" if in_free_queue else "not in"
                problems.append(f"block {block_id} with ref_cnt {ref_cnt} is {where} the free queue")
        unknown = set(expected_ref_cnt) - set(range(self.num_blocks))
        if unknown:
            problems.append(f"tables hold unknown block ids {sorted(unknown)}")
        for block_hash, block_id in self._cached.items():
            if self.block_hash[block_id] != block_hash:
                problems.append(f"hash map points at block {block_id}, which holds another hash")
        num_hashed = sum(h is not None for h in self.block_hash)
        if num_hashed != len(self._cached):
            problems.append(f"{num_hashed} blocks hold a hash but the hash map has {len(self._cached)}")
        if problems:
            raise RuntimeError("KV block pool is inconsistent: " + "; ".join(problems))
