"""BlockPool: ref counts, the LRU free queue, cached blocks that survive until reused."""

from collections import Counter

import pytest

from sparkd.engine.block_pool import BlockPool


def held(*tables: list[int]) -> Counter:
    return Counter(block_id for table in tables for block_id in table)


def test_allocate_and_free_restore_the_free_count():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert sorted(a + b) == list(range(8))
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0
    pool.check_integrity(held(a, b))
    pool.free(a)
    pool.free(b)
    assert pool.num_free_blocks == 8 and pool.usage() == 0.0
    pool.check_integrity({})


def test_over_allocation_and_double_free_are_errors():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.allocate(3)
    block_ids = pool.allocate(1)
    pool.free(block_ids)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free(block_ids)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_free_queue_is_least_recently_freed_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert pool.allocate(4) == [blocks[2], blocks[0], blocks[3], blocks[1]]


def test_cached_free_block_survives_until_reused_then_is_evicted():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache(blocks[0], b"h0")
    pool.free(blocks)  # queue: blocks[0], blocks[1], blocks[2]
    assert pool.lookup(b"h0") == blocks[0]
    assert pool.stats().num_cached_blocks == 1
    assert pool.allocate(1) == [blocks[0]]  # it heads the queue, so it is reused and loses its hash
    assert pool.lookup(b"h0") is None
    assert pool.stats().num_evictions == 1 and pool.stats().num_cached_blocks == 0
    assert pool.block_hash[blocks[0]] is None


def test_touch_revives_a_cached_block_from_the_middle_of_the_queue():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.cache(blocks[1], b"h1")
    pool.free(blocks)
    pool.touch([blocks[1]])
    assert pool.ref_cnt[blocks[1]] == 1 and pool.num_free_blocks == 3
    pool.check_integrity(held([blocks[1]]))
    assert pool.allocate(3) == [blocks[0], blocks[2], blocks[3]]
    assert pool.lookup(b"h1") == blocks[1]
    assert pool.num_evictions == 0


def test_touch_on_a_block_in_use_only_adds_a_reference():
    pool = BlockPool(2)
    (block_id,) = pool.allocate(1)
    pool.touch([block_id])
    assert pool.ref_cnt[block_id] == 2 and pool.num_free_blocks == 1
    pool.free([block_id])
    assert pool.num_free_blocks == 1
    pool.free([block_id])
    assert pool.num_free_blocks == 2


def test_same_content_cached_twice_keeps_the_first_block():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    pool.cache(first, b"h")
    pool.cache(second, b"h")
    assert pool.lookup(b"h") == first and pool.block_hash[second] is None
    pool.check_integrity(held([first, second]))


def test_check_integrity_reports_mismatches():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    with pytest.raises(RuntimeError, match="ref_cnt 1, tables hold it 0 times"):
        pool.check_integrity(held(blocks[:1]))
    with pytest.raises(RuntimeError, match="unknown block ids"):
        pool.check_integrity(held(blocks, [7]))
    pool.ref_cnt[blocks[0]] = 0  # corrupt: free by count, yet not in the free queue
    with pytest.raises(RuntimeError, match="not in the free queue"):
        pool.check_integrity(held(blocks[1:]))
    pool.ref_cnt[blocks[0]] = 1
    pool.cache(blocks[0], b"h")
    pool.block_hash[blocks[0]] = b"other"
    with pytest.raises(RuntimeError, match="holds another hash"):
        pool.check_integrity(held(blocks))
