"""The linear-attention state slots (StateSlotPool), their prefix-cache snapshots (StateSnapshots)
and the scheduler that hands them out: every running request of a hybrid model holds exactly
one slot, admission waits for a free one, and finish, abort and preemption give it back; prompt
chunks plan their snapshots and hits restore one. Pure Python, no model."""

import pytest

from sparkd.engine.request import Request, RequestStatus
from sparkd.engine.sampling_params import SamplingParams
from sparkd.engine.scheduler import Scheduler
from sparkd.engine.state_pool import StateSlotPool
from sparkd.engine.state_snapshots import StateSnapshots, boundaries_to_snapshot

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def request(name: str, length: int = 6) -> Request:
    return Request(name, list(range(3, 3 + length)), PARAMS, seed=0)


def test_slots_are_taken_and_given_back():
    pool = StateSlotPool(2)
    a, b, c = request("a"), request("b"), request("c")
    assert (pool.allocate(a), pool.allocate(b)) == (0, 1) and pool.num_free == 0
    with pytest.raises(RuntimeError, match="no free state slot"):
        pool.allocate(c)
    pool.free(a)
    assert a.state_slot is None and pool.allocate(c) == 0
    pool.check_integrity([b, c])
    with pytest.raises(RuntimeError, match="other requests than the running"):
        pool.check_integrity([b])
    pool.free(a)  # holds none: nothing to do
    b.state_slot = 0
    with pytest.raises(RuntimeError, match="does not own"):
        pool.free(b)


def test_a_request_cannot_hold_two_slots():
    pool = StateSlotPool(3)
    a = request("a")
    pool.allocate(a)
    with pytest.raises(RuntimeError, match="already holds"):
        pool.allocate(a)


def scheduler(num_slots: int, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64, num_blocks=num_blocks,
                     block_size=4, enable_prefix_caching=False, num_state_slots=num_slots)


def test_admission_waits_for_a_free_slot():
    sched = scheduler(num_slots=2)
    for name in "abc":
        sched.add_request(request(name))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"] and sched.num_waiting == 1
    assert sorted(s.request.state_slot for s in out.scheduled) == [0, 1]
    sched.check_integrity()
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    sched.update(out, [(5, None), (5, None)])
    out = sched.schedule()
    assert "c" in [s.request.request_id for s in out.scheduled]
    assert sched.requests["c"].state_slot == 0  # a's slot
    sched.check_integrity()


def test_preemption_gives_the_slot_back():
    # 4 blocks of 4 tokens: two 6-token prompts fit, then decoding needs a block one cannot get.
    sched = scheduler(num_slots=2, num_blocks=4)
    for name in "ab":
        sched.add_request(request(name))
    out = sched.schedule()
    sched.update(out, [(5, None), (5, None)])
    for _ in range(4):
        out = sched.schedule()
        if out.preempted:
            break
        sched.update(out, [(5, None)] * len(out.scheduled))
    assert out.preempted, "the pool should have run out of blocks"
    victim = out.preempted[0]
    assert victim.status is RequestStatus.PREEMPTED and victim.state_slot is None
    assert sched.state_slots.num_free == 1
    sched.check_integrity()


def test_hybrid_requests_never_start_from_blocks_they_did_not_compute():
    """n > 1 siblings share their prompt's blocks through a fork, but the state at that point
    is not kept: a hybrid model's sibling computes its own prompt."""
    sched = scheduler(num_slots=4)
    first, second = request("s0", length=9), request("s1", length=9)
    first.group_id = second.group_id = "group"
    sched.add_request(first)
    sched.add_request(second)
    out = sched.schedule()
    sched.update(out, [(5, None)] * len(out.scheduled))
    out = sched.schedule()
    sibling = next(s for s in out.scheduled if s.request is second)
    assert sibling.start == 0 and sibling.num_new_tokens == 9


# ---- prefix caching for hybrid models: state snapshots ----

@pytest.mark.parametrize("prompt_len,boundaries", [(15, []), (16, [16]), (20, [16]), (64, [64]), (90, [64, 80]),
                                                   (130, [64, 128])])
def test_snapshots_every_interval_and_at_the_last_full_block(prompt_len, boundaries):
    assert boundaries_to_snapshot(prompt_len, block_size=16, interval_blocks=4) == boundaries


def test_snapshots_are_evicted_least_recently_used():
    snapshots = StateSnapshots(first_slot=8, num_slots=2)
    assert (snapshots.reserve(b"a"), snapshots.reserve(b"b")) == (8, 9)
    assert snapshots.reserve(b"a") is None  # exists already: nothing to write
    assert snapshots.lookup(b"b") == 9  # b is now the most recently used
    assert snapshots.reserve(b"c") == 8  # evicts a
    assert snapshots.lookup(b"a") is None and snapshots.lookup(b"c") == 8
    snapshots.check_integrity()


def test_a_prompt_chunk_plans_its_snapshots_and_a_hit_restores_one():
    """A 40-token prompt (blocks of 4, a snapshot every 4 blocks) snapshots after 16, 32 and 40
    tokens. The same prompt again hits 8 blocks (a hit stops short of the last token: 9 blocks
    at most, and block 9 has no snapshot) and restores the state after 32 tokens into its slot."""
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=64, block_size=4,
                      enable_prefix_caching=True, num_state_slots=4, num_state_snapshots=8)
    first = request("a", length=40)
    sched.add_request(first)
    out = sched.schedule()
    (seq,) = out.scheduled
    assert [offset for offset, _ in seq.state_snapshots] == [16, 32, 40] and not out.state_restores
    sched.update(out, [(5, None)])
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    snapshot_after_32 = seq.state_snapshots[1][1]
    sched.add_request(request("b", length=40))
    out = sched.schedule()
    (seq,) = out.scheduled
    assert (seq.start, seq.num_new_tokens) == (32, 8)
    assert out.state_restores == [(snapshot_after_32, seq.request.state_slot)]
    assert [offset for offset, _ in seq.state_snapshots] == []  # 40 is snapshotted already
    sched.check_integrity()


def test_a_failed_step_forgets_the_snapshots_it_was_to_write():
    """Its entries could name states never written: after discard_snapshots the same prompt finds
    no hit and takes the snapshots afresh."""
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=64, block_size=4,
                      enable_prefix_caching=True, num_state_slots=4, num_state_snapshots=8)
    sched.add_request(request("a", length=40))
    failed = sched.schedule()
    sched.discard_snapshots(failed)
    sched.finish_request("a", RequestStatus.FINISHED_ERROR)
    assert len(sched.state_snapshots) == 0
    sched.add_request(request("b", length=40))
    out = sched.schedule()
    assert not out.state_restores and [o for o, _ in out.scheduled[0].state_snapshots] == [16, 32, 40]
    sched.check_integrity()
