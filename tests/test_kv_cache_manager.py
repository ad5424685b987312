"""KVCacheManager: block tables, slot mapping, prefix caching by chained block hashes."""

import hashlib
import struct

import numpy as np
import pytest

from sparkd.engine.kv_cache_manager import KVCacheManager, hash_block, slot_mapping
from sparkd.engine.request import Request
from sparkd.engine.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, prompt: list[int], **fields) -> Request:
    return Request(request_id, list(prompt), SamplingParams(), seed=0, **fields)


def admit(kv: KVCacheManager, request: Request) -> list[int]:
    """Admit `request` the way the scheduler does, compute its whole prompt, publish full blocks."""
    computed, num_computed = kv.get_computed_blocks(request)
    table = kv.allocate_slots(request, request.num_tokens - num_computed, computed)
    assert table is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return table


def test_hash_block_is_sha256_of_parent_tokens_and_extra_keys():
    tokens = [1, 2, 70000, 4]
    root = hash_block(None, tokens)
    assert root == hashlib.sha256(struct.pack("<4q", *tokens)).digest()
    child = hash_block(root, [5, 6, 7, 8], ("lora", 3))
    assert child == hashlib.sha256(root + struct.pack("<4q", 5, 6, 7, 8) + repr(("lora", 3)).encode()).digest()
    assert hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8], ("lora", 3)) != child


def test_slot_mapping_matches_a_per_token_loop():
    rng = np.random.default_rng(0)
    block_tables = rng.permutation(64).reshape(4, 16).astype(np.int32)
    req_indices = rng.integers(0, 4, size=50)
    positions = rng.integers(0, 16 * BS, size=50)
    expected = [block_tables[r, p // BS] * BS + p % BS for r, p in zip(req_indices, positions)]
    slots = slot_mapping(block_tables, req_indices, positions, BS)
    assert slots.dtype == np.int32 and slots.tolist() == expected


def test_tables_grow_block_by_block_and_free_restores_the_pool():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", range(5))
    assert len(kv.allocate_slots(request, 5)) == 2
    request.num_computed_tokens = 5
    assert len(kv.allocate_slots(request, 3)) == 2  # positions 5..7 fit in block 2
    assert len(kv.allocate_slots(request, 4)) == 3
    assert kv.num_free_blocks == 5 and kv.usage == pytest.approx(3 / 8)
    kv.check_integrity()
    kv.free(request)
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    request = make_request("a", range(13))
    assert kv.allocate_slots(request, 13) is None
    assert kv.block_tables == {} and kv.num_free_blocks == 3 and kv.prefix_cache_queries == 0


def test_prefix_hits_are_counted_in_tokens_at_block_granularity():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    base = list(range(100, 110))  # 10 tokens: 2 full blocks
    admit(kv, make_request("a", base))
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)

    same_start = make_request("b", base[:6] + [1, 2, 3])  # shares 1 full block
    _, num_hit = kv.get_computed_blocks(same_start)
    assert num_hit == 4
    whole = make_request("c", base)
    blocks, num_hit = kv.get_computed_blocks(whole)
    assert num_hit == 8 and blocks == kv.block_tables["a"][:2]
    admit(kv, whole)
    assert kv.block_tables["c"][:2] == kv.block_tables["a"][:2]
    assert [kv.pool.ref_cnt[b] for b in kv.block_tables["a"]] == [2, 2, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)
    kv.check_integrity()


def test_a_hit_never_covers_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_request("a", range(12)))
    _, num_hit = kv.get_computed_blocks(make_request("b", range(8)))
    assert num_hit == 4  # block 2 holds token 7, whose logits are needed


def test_hashes_are_chained_so_a_matching_block_after_a_mismatch_misses():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_request("a", [1, 1, 1, 1, 2, 2, 2, 2, 0]))
    assert kv.get_computed_blocks(make_request("b", [9, 9, 9, 9, 2, 2, 2, 2, 0]))[1] == 0
    assert kv.get_computed_blocks(make_request("c", [1, 1, 1, 1, 2, 2, 2, 2, 0]))[1] == 8
    salted = make_request("d", [1, 1, 1, 1, 2, 2, 2, 2, 0], block_hash_extra_keys=("lora-1",))
    assert kv.get_computed_blocks(salted)[1] == 0


def test_blocks_hit_after_their_request_is_freed():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    first = make_request("a", range(9))
    admit(kv, first)
    kv.free(first)
    assert kv.num_free_blocks == 8
    again = make_request("b", range(9))
    blocks, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 8
    admit(kv, again)
    assert kv.block_tables["b"][:2] == blocks and kv.num_free_blocks == 5
    kv.check_integrity()


def test_generated_tokens_fill_blocks_that_get_cached_too():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", range(3))
    admit(kv, request)
    for token in (50, 51):  # decode: tokens 3 and 4 get computed
        request.output_token_ids.append(token)
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        kv.cache_full_blocks(request)
    follow_up = make_request("b", [0, 1, 2, 50, 51, 7])
    assert kv.get_computed_blocks(follow_up)[1] == 4


def test_freed_tail_is_evicted_before_the_prefix():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    first = make_request("a", range(12))
    table = list(admit(kv, first))
    kv.free(first)
    other = make_request("b", [7, 7])
    assert kv.allocate_slots(other, 2) == [table[2]]  # the tail block goes first
    assert kv.pool.num_evictions == 1
    kv.free(other)
    _, num_hit = kv.get_computed_blocks(make_request("c", range(12)))
    assert num_hit == 8


def test_reviving_free_cached_blocks_counts_against_free_space():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    first = make_request("a", range(9))
    admit(kv, first)
    kv.free(first)
    hog = make_request("hog", [5])
    kv.allocate_slots(hog, 1)  # takes the tail block; 2 cached blocks stay free
    assert kv.num_free_blocks == 3
    long_prompt = make_request("b", list(range(8)) + list(range(200, 208)))
    blocks, num_hit = kv.get_computed_blocks(long_prompt)
    assert num_hit == 8
    # 2 revived + 2 new blocks > 3 free blocks
    assert kv.allocate_slots(long_prompt, 8, blocks) is None
    assert kv.num_free_blocks == 3
    kv.check_integrity()


def test_prefix_caching_off_shares_only_through_an_explicit_sibling():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(10))
    leader = make_request("a", prompt)
    admit(kv, leader)
    sibling = make_request("b", prompt)
    assert kv.get_computed_blocks(sibling) == ([], 0)
    blocks, num_hit = kv.get_computed_blocks(sibling, share_from=leader)
    assert num_hit == 8 and blocks == kv.block_tables["a"][:2]
    table = kv.allocate_slots(sibling, 2, blocks)
    assert table[:2] == blocks and table[2] != kv.block_tables["a"][2]
    assert [kv.pool.ref_cnt[b] for b in kv.block_tables["a"]] == [2, 2, 1]
    assert kv.prefix_cache_queries == 0 and kv.pool.stats().num_cached_blocks == 0
    kv.check_integrity()
    kv.free(leader)
    kv.free(sibling)
    assert kv.num_free_blocks == 16


def test_check_integrity_catches_a_table_changed_behind_its_back():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    request = make_request("a", range(5))
    kv.allocate_slots(request, 5)
    kv.block_tables["a"].append(3)
    with pytest.raises(RuntimeError, match="block 3 has ref_cnt 0"):
        kv.check_integrity()
