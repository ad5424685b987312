"""Scheduler: token budget, chunked prefill, preemption, prefix hits, n > 1 sharing, stops.

A fake model stands in for the forward: its "K/V" for a position is the token
id itself, written to the slot the block table names. Before sampling it reads
the whole context back through the block table, so a block shared, reused or
evicted at the wrong time shows up as a wrong context. Its next token is a
function of that context, so runs under any budget, pool size or caching
setting must produce the same tokens.
"""

import hashlib
from collections import Counter

import pytest

from sparkd.engine.request import Request, RequestStatus
from sparkd.engine.sampling_params import SamplingParams
from sparkd.engine.scheduler import Scheduler

BS = 4
EOS = 2


class FakeModel:
    """Runs steps on a token-id "KV cache", as a device would: a placeholder's id is
    the one this model drew for that request in the step before (`drawn`)."""

    def __init__(self, scheduler: Scheduler, script: dict[str, list[int]] | None = None):
        self.scheduler = scheduler
        self.kv_cache = [None] * (scheduler.kv.pool.num_blocks * BS)
        self.script = script or {}  # request id -> tokens to emit instead of the context function
        self.drawn: dict[str, int] = {}  # request id -> the id it drew in the last step

    def sample(self, output) -> list:
        sampled = []
        drawn = {}
        ref_cnt = self.scheduler.kv.pool.ref_cnt
        for seq in output.scheduled:
            request = seq.request
            tokens = request.all_token_ids
            start, end = seq.start, seq.start + seq.num_new_tokens
            if end > len(tokens):
                tokens = tokens + [self.drawn[request.request_id]]
            for pos in range(start, end):
                block_id = seq.block_ids[pos // BS]
                assert ref_cnt[block_id] == 1, "a shared block must never be written"
                self.kv_cache[block_id * BS + pos % BS] = tokens[pos]
            if not seq.draws:
                sampled.append(None)
                continue
            context = [self.kv_cache[seq.block_ids[pos // BS] * BS + pos % BS] for pos in range(end)]
            assert context == tokens, f"{request.request_id} read a corrupted context"
            script = self.script.get(request.request_id)
            token = script[len(tokens) - request.num_prompt_tokens] if script else next_token(context)
            drawn[request.request_id] = token
            sampled.append((token, None))
        self.drawn = drawn
        return sampled


def next_token(context: list[int]) -> int:
    digest = hashlib.sha256(repr(context).encode()).digest()
    return 10 + int.from_bytes(digest[:4], "little") % 1000  # never EOS


def make_request(request_id: str, prompt, eos=(EOS,), **params) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(request_id, list(prompt), SamplingParams(**params), seed=0, eos_token_ids=frozenset(eos))


def make_scheduler(num_blocks=64, budget=64, max_num_seqs=8, max_model_len=256, caching=True) -> Scheduler:
    return Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                     num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)


def run_step(scheduler: Scheduler, model: FakeModel):
    output = scheduler.schedule()
    assert output.num_batched_tokens == sum(s.num_new_tokens for s in output.scheduled)
    assert output.num_batched_tokens <= scheduler.max_num_batched_tokens
    assert len(output.scheduled) <= scheduler.max_num_seqs
    updated = scheduler.update(output, model.sample(output))
    scheduler.check_integrity()
    return output, updated


def run_to_completion(scheduler: Scheduler, requests: list[Request], model: FakeModel | None = None,
                      max_steps: int = 1000, pipelined: bool = False) -> list:
    """pipelined: async scheduling, step N+1 is scheduled and run before step N's update."""
    model = model or FakeModel(scheduler)
    for request in requests:
        scheduler.add_request(request)
    outputs = []
    in_flight = None
    while scheduler.has_unfinished_requests() or in_flight is not None:
        if not pipelined:
            outputs.append(run_step(scheduler, model)[0])
        else:
            output = scheduler.schedule()
            launched = (output, model.sample(output)) if output.scheduled else None
            if in_flight is not None:
                scheduler.update(*in_flight)
                scheduler.check_integrity()
            in_flight = launched
            outputs.append(output)
        assert len(outputs) < max_steps
    assert in_flight is None
    assert scheduler.kv.num_free_blocks == scheduler.kv.pool.num_blocks
    return outputs


def workload() -> list[Request]:
    shared = list(range(100, 130))
    prompts = [shared + [1, 2, 3], list(range(300, 305)), shared + [7], list(range(400, 490)), shared[:13],
               list(range(500, 520))]
    return [make_request(f"r{i}", p, max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)]


def generated(requests: list[Request]) -> dict[str, list[int]]:
    return {r.request_id: r.output_token_ids for r in requests}


@pytest.fixture(scope="module")
def reference_tokens() -> dict[str, list[int]]:
    requests = workload()
    run_to_completion(make_scheduler(num_blocks=256, budget=4096, caching=False), requests)
    return generated(requests)


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("caching", [True, False])
def test_chunked_prefill_gives_the_same_tokens(reference_tokens, caching, pipelined):
    requests = workload()
    outputs = run_to_completion(make_scheduler(budget=16, caching=caching), requests, pipelined=pipelined)
    assert generated(requests) == reference_tokens
    # the 90-token prompt took several chunks, and chunks shared steps with decodes
    long_chunks = [s.num_new_tokens for out in outputs for s in out.scheduled if s.request.request_id == "r3"]
    assert sum(n > 1 for n in long_chunks) >= 6
    assert any(len({s.num_new_tokens for s in out.scheduled}) > 1 for out in outputs)


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("caching", [True, False])
def test_a_tiny_pool_preempts_and_still_gives_the_same_tokens(reference_tokens, caching, pipelined):
    requests = workload()
    scheduler = make_scheduler(num_blocks=26, budget=32, caching=caching)
    outputs = run_to_completion(scheduler, requests, pipelined=pipelined)
    assert generated(requests) == reference_tokens
    assert any(out.preempted for out in outputs)
    assert sum(r.num_preemptions for r in requests) > 0


def test_prefix_hits_from_shared_prompts_and_their_accounting(reference_tokens):
    requests = workload()
    scheduler = make_scheduler(budget=4096)
    model = FakeModel(scheduler)
    run_to_completion(scheduler, requests[:1], model)  # r0 computes the shared 30-token prefix
    run_to_completion(scheduler, requests[1:], model)
    assert generated(requests) == reference_tokens
    # r2 and r4 hit r0's full blocks: r2 the 28 tokens of 7 full shared blocks, r4 the 12 of 3
    assert requests[2].num_cached_tokens == 28 and requests[4].num_cached_tokens == 12
    assert scheduler.prefix_cache_hits == 40
    assert scheduler.prefix_cache_queries == sum(r.num_prompt_tokens for r in requests)


def test_budget_is_split_between_decodes_and_prompt_chunks():
    scheduler = make_scheduler(budget=10)
    model = FakeModel(scheduler)
    scheduler.add_request(make_request("short", range(3), max_tokens=20))
    scheduler.add_request(make_request("long", range(100, 125)))
    chunks = []
    for _ in range(5):
        output, _ = run_step(scheduler, model)
        chunks.append([(s.request.request_id, s.num_new_tokens) for s in output.scheduled])
    assert chunks == [
        [("short", 3), ("long", 7)],
        [("short", 1), ("long", 9)],
        [("short", 1), ("long", 9)],  # 7 + 9 + 9 = 25: the prompt is done, so both decode
        [("short", 1), ("long", 1)],
        [("short", 1), ("long", 1)],
    ]
    assert scheduler.requests["long"].num_output_tokens == 3


def test_max_num_seqs_limits_the_running_set_first_come_first_served():
    scheduler = make_scheduler(max_num_seqs=2)
    model = FakeModel(scheduler)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", range(10 * i, 10 * i + 5), max_tokens=2))
    output, _ = run_step(scheduler, model)
    assert [s.request.request_id for s in output.scheduled] == ["r0", "r1"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 2)
    output, _ = run_step(scheduler, model)  # r0, r1 finish their second token
    output, _ = run_step(scheduler, model)
    assert [s.request.request_id for s in output.scheduled] == ["r2", "r3"]


def test_preemption_takes_the_latest_arrival_and_resumes_it_first():
    scheduler = make_scheduler(num_blocks=5, budget=64)
    model = FakeModel(scheduler)
    early = make_request("early", range(8), max_tokens=12, ignore_eos=True)
    late = make_request("late", range(50, 58), max_tokens=12, ignore_eos=True)
    queued = make_request("queued", range(90, 98), max_tokens=1)
    for request in (early, late, queued):
        scheduler.add_request(request)
    run_step(scheduler, model)  # both prompts: 2 + 2 blocks; "queued" does not fit in the last one
    preempted_step = None
    for step in range(12):
        output, _ = run_step(scheduler, model)
        if output.preempted:
            preempted_step = output
            break
    assert preempted_step is not None and preempted_step.preempted == [late]
    assert late.status is RequestStatus.PREEMPTED and late.num_computed_tokens == 0
    assert late.num_preemptions == 1 and "late" not in scheduler.kv.block_tables
    assert list(scheduler.waiting) == [late, queued]
    assert [s.request for s in preempted_step.scheduled] == [early]
    while scheduler.has_unfinished_requests():
        run_step(scheduler, model)
    assert scheduler.kv.num_free_blocks == 5
    reference = make_scheduler(num_blocks=64)
    copies = [make_request(r.request_id, r.prompt_token_ids, max_tokens=r.sampling_params.max_tokens,
                           ignore_eos=True) for r in (early, late, queued)]
    run_to_completion(reference, copies)
    assert generated([early, late, queued]) == generated(copies)


def test_prompts_that_can_never_run_fail_alone_with_both_lengths_named():
    scheduler = make_scheduler(num_blocks=8, max_model_len=20)
    with pytest.raises(ValueError, match=r"21 tokens, more than max_model_len \(20\)"):
        scheduler.add_request(make_request("long", range(21)))
    small_pool = make_scheduler(num_blocks=4, max_model_len=100)
    with pytest.raises(ValueError, match=r"17 tokens, more than the whole KV cache holds \(16 tokens"):
        small_pool.add_request(make_request("huge", range(17)))
    with pytest.raises(ValueError, match="at least one token"):
        scheduler.add_request(make_request("empty", []))
    fine = make_request("fine", range(20))
    scheduler.add_request(fine)
    with pytest.raises(ValueError, match="request_id 'fine' is already in use"):
        scheduler.add_request(make_request("fine", range(3)))
    run_to_completion(scheduler, [])
    assert fine.status is RequestStatus.FINISHED_LENGTH and fine.num_output_tokens == 1


def test_sequences_stop_at_max_model_len_and_at_the_pool_size():
    scheduler = make_scheduler(max_model_len=12)
    request = make_request("a", range(8), max_tokens=50, min_tokens=10)
    run_to_completion(scheduler, [request])
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_tokens == 12
    scheduler = make_scheduler(num_blocks=3, max_model_len=100)
    request = make_request("b", range(8), max_tokens=50)
    run_to_completion(scheduler, [request])
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_tokens == 12


@pytest.mark.parametrize("caching", [True, False])
def test_n_siblings_wait_for_the_prompt_then_share_its_full_blocks(caching):
    scheduler = make_scheduler(budget=8, caching=caching)
    model = FakeModel(scheduler)
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks
    group = [make_request(f"g{i}", prompt, max_tokens=4, ignore_eos=True) for i in range(3)]
    for i, request in enumerate(group):
        request.group_id, request.sample_index = "g", i
    other = make_request("other", range(5), max_tokens=3)
    for request in group + [other]:
        scheduler.add_request(request)
    first, _ = run_step(scheduler, model)
    assert [(s.request.request_id, s.num_new_tokens) for s in first.scheduled] == [("g0", 8)]
    second, _ = run_step(scheduler, model)
    # siblings are skipped while g0's prompt is unfinished; "other" behind them is not
    assert [(s.request.request_id, s.num_new_tokens) for s in second.scheduled] == [("g0", 6), ("other", 2)]
    third, _ = run_step(scheduler, model)
    assert [(s.request.request_id, s.num_new_tokens) for s in third.scheduled] == [
        ("g0", 1), ("other", 3), ("g1", 2), ("g2", 2)]
    shared = scheduler.kv.block_tables["g0"][:3]
    for sibling in group[1:]:
        assert scheduler.kv.block_tables[sibling.request_id][:3] == shared
    assert [scheduler.kv.pool.ref_cnt[b] for b in shared] == [3, 3, 3]
    while scheduler.has_unfinished_requests():
        run_step(scheduler, model)
    assert scheduler.kv.num_free_blocks == scheduler.kv.pool.num_blocks


def run_scripted(script: list[int], pipelined: bool = False, **params) -> Request:
    scheduler = make_scheduler()
    request = make_request("a", range(5), **params)
    run_to_completion(scheduler, [request], FakeModel(scheduler, {"a": script}), pipelined=pipelined)
    return request


@pytest.mark.parametrize("params, emitted, status, stop_reason", [
    ({}, [20, EOS], RequestStatus.FINISHED_STOPPED, None),
    ({"ignore_eos": True}, [20, EOS, 21, 22, 23, 24, 25, 26], RequestStatus.FINISHED_LENGTH, None),
    ({"min_tokens": 3}, [EOS, EOS, EOS], RequestStatus.FINISHED_STOPPED, None),
    ({"stop_token_ids": [30]}, [20, 30], RequestStatus.FINISHED_STOPPED, 30),
    ({"stop_token_ids": [30], "min_tokens": 2}, [30, 30], RequestStatus.FINISHED_STOPPED, 30),
    ({"stop_token_ids": [EOS], "ignore_eos": True}, [20, EOS], RequestStatus.FINISHED_STOPPED, EOS),
    ({"max_tokens": 3}, [20, 21, 22], RequestStatus.FINISHED_LENGTH, None),
    ({"max_tokens": 2, "min_tokens": 2}, [20, EOS], RequestStatus.FINISHED_STOPPED, None),
])
@pytest.mark.parametrize("pipelined", [False, True])
def test_stop_conditions(params, emitted, status, stop_reason, pipelined):
    request = run_scripted(emitted + [40] * 8, pipelined, **params)
    assert request.output_token_ids == emitted
    assert request.status is status and request.stop_reason == stop_reason


def test_finish_request_frees_blocks_and_ignores_unknown_ids():
    scheduler = make_scheduler(max_num_seqs=1)
    model = FakeModel(scheduler)
    running = make_request("running", range(9), max_tokens=20)
    waiting = make_request("waiting", range(9), max_tokens=20)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_step(scheduler, model)
    assert scheduler.kv_cache_usage == 3 / 64  # the 9-token prompt; "waiting" holds nothing
    scheduler.finish_request("waiting", RequestStatus.FINISHED_ABORTED)
    output = scheduler.schedule()
    sampled = model.sample(output)
    scheduler.finish_request("running", RequestStatus.FINISHED_ABORTED)  # aborted during the forward
    assert scheduler.update(output, sampled) == []
    assert running.status is waiting.status is RequestStatus.FINISHED_ABORTED
    assert not scheduler.has_unfinished_requests() and scheduler.kv.num_free_blocks == 64
    assert scheduler.kv_cache_usage == 0.0
    scheduler.finish_request("nobody", RequestStatus.FINISHED_ABORTED)
    with pytest.raises(ValueError, match="status must be a finished status"):
        scheduler.finish_request("running", RequestStatus.RUNNING)
    scheduler.check_integrity()


def test_update_rejects_a_sampled_list_of_the_wrong_length():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(3)))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="sampled has 0 entries for 1 scheduled"):
        scheduler.update(output, [])


def test_constructor_names_the_bad_parameter():
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer"):
        Scheduler(max_num_seqs=1, max_num_batched_tokens=0, max_model_len=8, num_blocks=4, block_size=4)


def test_no_block_leaks_under_random_aborts_and_preemption():
    scheduler = make_scheduler(num_blocks=20, budget=12, max_num_seqs=6)
    model = FakeModel(scheduler)
    requests = [make_request(f"r{i}", range(i, i + 3 + 5 * (i % 4)), max_tokens=6 + i % 5) for i in range(24)]
    for request in requests[:12]:
        scheduler.add_request(request)
    step = 0
    while scheduler.has_unfinished_requests():
        run_step(scheduler, model)
        step += 1
        if step % 3 == 0:
            scheduler.finish_request(f"r{step}", RequestStatus.FINISHED_ABORTED)
        if step == 5:
            for request in requests[12:]:
                scheduler.add_request(request)
        assert step < 500
    assert scheduler.kv.num_free_blocks == 20
    statuses = Counter(r.status for r in requests)
    assert statuses[RequestStatus.FINISHED_ABORTED] > 0 and sum(r.num_preemptions for r in requests) > 0
