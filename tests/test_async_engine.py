"""AsyncEngine: many concurrent requests, aborts, per-request failures."""

from __future__ import annotations

import asyncio

import pytest

from sparkd import LLM, SamplingParams
from sparkd.engine.args import EngineArgs
from sparkd.engine.async_engine import AsyncEngine, RequestError
from tests.oracle import make_tiny_checkpoint, make_tiny_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_checkpoint(path, "Qwen3ForCausalLM")
    make_tiny_tokenizer(path)
    return path


@pytest.fixture
async def engine(model_dir):
    engine = AsyncEngine.from_args(EngineArgs(model=str(model_dir), device="cpu", max_num_seqs=32,
                                              max_num_batched_tokens=256, num_gpu_blocks_override=256))
    await engine.start()
    yield engine
    await engine.shutdown()


def assert_idle(engine: AsyncEngine) -> None:
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    engine.core.scheduler.check_integrity()


async def collect(stream):
    outputs = [out async for out in stream]
    assert outputs[-1].finished
    return outputs


def mixed_params(i: int) -> SamplingParams:
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9, seed=i),
        dict(temperature=1.0, top_k=5, min_p=0.05, seed=i, n=2),
        dict(temperature=0.7, logprobs=3, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
        dict(temperature=0.0, stop=["e"], min_tokens=2),
    ]
    return SamplingParams(max_tokens=4 + i % 7, ignore_eos=True, **kinds[i % len(kinds)])


async def test_64_concurrent_requests_with_mixed_params_complete(engine):
    prompts = [f"request {i}: the quick brown fox" if i % 2 else list(range(3, 3 + i % 40 + 1)) for i in range(64)]
    params = [mixed_params(i) for i in range(64)]
    streams = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for sp, outputs in zip(params, results):
        final = outputs[-1]
        assert final.error is None and len(final.outputs) == sp.n
        for completion in final.outputs:
            if sp.stop:
                assert completion.finish_reason in ("stop", "length")
                assert "e" not in completion.text
            else:
                assert completion.finish_reason == "length"
                assert len(completion.token_ids) == sp.max_tokens
            if sp.logprobs is not None:
                assert len(completion.logprobs) == len(completion.token_ids)
                assert all(len(lp.top) == 3 for lp in completion.logprobs)
        # Streamed deltas add up to the final text.
        for index, completion in enumerate(final.outputs):
            assert "".join(o.outputs[index].text_delta for o in outputs) == completion.text
    assert_idle(engine)


async def test_seeded_request_is_reproducible_alongside_other_traffic(engine):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = (await collect(engine.add_request("hello there", params)))[-1].outputs[0].token_ids
    noise = [engine.add_request(f"noise {i}", SamplingParams(temperature=1.0, max_tokens=8)) for i in range(6)]
    crowded = (await collect(engine.add_request("hello there", params)))[-1].outputs[0].token_ids
    await asyncio.gather(*(collect(s) for s in noise))
    assert alone == crowded


async def test_abort_mid_generation_frees_blocks(engine):
    stream = engine.add_request(list(range(3, 100)), SamplingParams(max_tokens=200, ignore_eos=True))
    got = 0
    async for out in stream:
        got += out.outputs[0].num_new_tokens
        if got >= 3:
            break
    assert engine.stats().kv_cache_usage > 0
    await stream.aclose()
    await asyncio.sleep(0.05)  # an abort that lands during a step applies right after it
    assert_idle(engine)


async def test_bad_requests_fail_alone_with_clear_errors(engine):
    with pytest.raises(RequestError, match="maximum context length is 512"):
        engine.add_request([7] * 600, SamplingParams())
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request([5, 10**6], SamplingParams())
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], SamplingParams())
    ok = await collect(engine.add_request("still serving", SamplingParams(max_tokens=3, ignore_eos=True)))
    assert ok[-1].outputs[0].finish_reason == "length"
    assert_idle(engine)


async def test_output_failure_ends_only_that_request(engine, monkeypatch):
    good = engine.add_request("good request", SamplingParams(max_tokens=6, ignore_eos=True))
    bad = engine.add_request("bad request", SamplingParams(max_tokens=6, ignore_eos=True), request_id="bad")
    state = engine.core.output_processor._requests["bad"]

    def explode(_ids):
        raise UnicodeError("injected")

    monkeypatch.setattr(state.sequences[0].detokenizer, "feed", explode)
    bad_out, good_out = await asyncio.gather(collect(bad), collect(good))
    assert bad_out[-1].error and "injected" in bad_out[-1].error
    assert bad_out[-1].outputs[0].finish_reason == "error"
    assert good_out[-1].outputs[0].finish_reason == "length"
    assert_idle(engine)


def pipelining_workload() -> tuple[list, list[SamplingParams]]:
    """Greedy, seeded draws, penalties (which make the loop wait for each step), min_tokens,
    logprobs, n > 1, and stops on eos and stop ids, so requests end while a step is in flight."""
    kinds = [
        dict(temperature=0.0, logprobs=2),
        dict(temperature=0.9, top_p=0.9),
        dict(temperature=1.0, top_k=8, n=2),
        dict(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.4),
        dict(temperature=1.0, min_tokens=3, stop_token_ids=[5, 7, 11, 13, 17, 19, 23, 29]),
        dict(temperature=1.2, stop_token_ids=list(range(40, 120))),
    ]
    prompts, params = [], []
    for i in range(30):
        prompts.append(list(range(3 + i, 3 + i + 5 + (7 * i) % 37)))
        params.append(SamplingParams(max_tokens=3 + i % 9, seed=1000 + i, **kinds[i % len(kinds)]))
    return prompts, params


async def test_pipelined_steps_give_the_tokens_of_sequential_steps(model_dir):
    """The engine loop schedules step N+1 before step N's tokens reach the host; it must
    produce exactly what one step at a time produces, also under preemption."""
    prompts, params = pipelining_workload()
    sequential = LLM(str(model_dir), device="cpu", num_gpu_blocks_override=256)
    expected = [[c.token_ids for c in out.outputs] for out in sequential.generate(prompts, params)]

    engine = AsyncEngine.from_args(EngineArgs(model=str(model_dir), device="cpu", max_num_seqs=32,
                                              num_gpu_blocks_override=14))
    launches_behind_a_step = []
    launch = engine.core.launch
    engine.core.launch = lambda output, previous: (launches_behind_a_step.append(previous is not None),
                                                   launch(output, previous))[1]
    await engine.start()
    try:
        results = await asyncio.gather(*(collect(engine.add_request(p, sp)) for p, sp in zip(prompts, params)))
        got = [[c.token_ids for c in outputs[-1].outputs] for outputs in results]
        assert got == expected
        # Steps overlapped, except while a penalty request ran (its sampling reads its last id).
        assert sum(launches_behind_a_step) >= len(launches_behind_a_step) // 4
        assert engine.core.scheduler.num_preemptions_total > 0
        assert_idle(engine)
    finally:
        await engine.shutdown()
