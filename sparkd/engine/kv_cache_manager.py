"""Block tables per request on top of the BlockPool, with prefix caching by chained block hashes."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .block_pool import BlockPool
from .request import Request


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """Chained hash of one full block: through `parent_hash` it names the whole prefix.

    sha256 rather than Python's hash(): a collision would silently serve another
    prompt's K/V, and crafted prompts must not be able to cause one.
    """
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


def slot_mapping(block_tables: np.ndarray, req_indices: np.ndarray, positions: np.ndarray,
                 block_size: int) -> np.ndarray:
    """Flat cache slot of each new token: block_id * block_size + offset in the block.

    block_tables: [B, max_blocks] int32; req_indices: [T] row of each token in
    block_tables; positions: [T] position of each token in its sequence.
    Returns [T] int32.
    """
    block_ids = block_tables[req_indices, positions // block_size]
    return (block_ids * block_size + positions % block_size).astype(np.int32)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups at admission, in tokens, as vLLM counts them: `queries` adds
    a request's length, `hits` the tokens served from the cache. Requests resumed after
    preemption are counted apart so that recompute does not inflate the hit rate."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class KVCacheManager:
    """Which blocks each request holds, and which computed blocks it may reuse.

    Contract: a request gets a table at its first successful `allocate_slots` and
    loses it at `free`. The table list returned by `allocate_slots` is live: it
    grows in place on later calls, so read it before the next one.
    `get_computed_blocks` takes no references; `allocate_slots` does.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}  # request id -> block ids, in token order
        self._num_cached_blocks: dict[str, int] = {}  # request id -> leading blocks already published
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage()

    @property
    def prefix_cache_queries(self) -> int:
        return self.prefix_cache_stats.queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.prefix_cache_stats.hits

    def get_computed_blocks(self, request: Request, share_from: Request | None = None) -> tuple[list[int], int]:
        """The longest computed prefix `request` can reuse: (block ids, number of tokens).

        With prefix caching, the cached blocks matching its chained block hashes.
        Without, the leading full prompt blocks of `share_from` (an n > 1 sibling
        whose prompt is computed), shared by ref count. Either way the last token
        is left to compute, so that its logits exist.
        """
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.enable_prefix_caching:
            block_ids = []
            lookup = self.pool.lookup
            for block_hash in self.block_hashes(request, max_blocks)[:max_blocks]:
                block_id = lookup(block_hash)
                if block_id is None:
                    break
                block_ids.append(block_id)
        elif share_from is not None and share_from.request_id in self.block_tables \
                and share_from.prompt_token_ids == request.prompt_token_ids:
            num_prompt_computed = min(share_from.num_computed_tokens, request.num_prompt_tokens)
            num_shared = min(max_blocks, num_prompt_computed // self.block_size)
            block_ids = self.block_tables[share_from.request_id][:num_shared]
        else:
            block_ids = []
        return block_ids, len(block_ids) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_block_ids: Sequence[int] = ()) -> list[int] | None:
        """Grow `request`'s table to cover its computed tokens, then `computed_block_ids`
        (from `get_computed_blocks`, only at admission), then `num_new_tokens` more.

        Returns the whole table, or None, changing nothing, when too few blocks are free.
        """
        request_id = request.request_id
        table = self.block_tables.get(request_id)
        num_tokens = request.num_computed_tokens + len(computed_block_ids) * self.block_size + num_new_tokens
        if table is not None and not computed_block_ids and num_tokens <= len(table) * self.block_size:
            return table  # a decode step, most of the time
        num_held = len(computed_block_ids) + (len(table) if table is not None else 0)
        num_needed = -(-num_tokens // self.block_size) - num_held
        ref_cnt = self.pool.ref_cnt
        # A hit on a free cached block takes it out of the free queue too.
        num_revived = sum(1 for block_id in computed_block_ids if ref_cnt[block_id] == 0)
        if max(num_needed, 0) + num_revived > self.pool.num_free_blocks:
            return None
        if table is None:
            table = self.block_tables[request_id] = []
            self._num_cached_blocks[request_id] = len(computed_block_ids)
            if self.enable_prefix_caching:
                num_hits = len(computed_block_ids) * self.block_size
                self.prefix_cache_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)
        self.pool.touch(computed_block_ids)
        table.extend(computed_block_ids)
        if num_needed > 0:
            table.extend(self.pool.allocate(num_needed))
        return table

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the full blocks among `request`'s computed tokens whose ids are known
        (not placeholders) in the prefix cache. A block whose K/V a step in flight still
        writes may be published: whoever reads it runs later on the same stream."""
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        num_cached = self._num_cached_blocks[request_id]
        if num_full <= num_cached:
            return
        hashes = self.block_hashes(request, num_full)
        table = self.block_tables[request_id]
        for i in range(num_cached, num_full):
            self.pool.cache(table[i], hashes[i])
        self._num_cached_blocks[request_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block of `request` (no-op if it holds none). Blocks keep their hash."""
        table = self.block_tables.pop(request.request_id, None)
        if table is None:
            return
        del self._num_cached_blocks[request.request_id]
        # Tail first: it joins the free queue ahead of the prefix, so it is evicted
        # first and the prefix, the part other prompts share, lives longest.
        self.pool.free(reversed(table))

    def check_integrity(self) -> None:
        """Raise RuntimeError if ref counts, free queue or hash map disagree with the tables."""
        for request_id, table in self.block_tables.items():
            if len(set(table)) != len(table):
                raise RuntimeError(f"request {request_id!r} holds a block twice: {table}")
        held = Counter(block_id for table in self.block_tables.values() for block_id in table)
        self.pool.check_integrity(held)

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """request.block_hashes, extended to cover at least its first `num_blocks` full blocks."""
        hashes = request.block_hashes
        if len(hashes) >= num_blocks:
            return hashes
        block_size = self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = hash_block(parent, request.token_slice(i * block_size, (i + 1) * block_size),
                                request.block_hash_extra_keys)
            hashes.append(parent)
        return hashes

