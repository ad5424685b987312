"""Device sampling vs the numpy sampler (sparkd/backend/cpu/sampler.py).

The two share the processing order and the Philox draws, so on fp32 logits the
chosen ids must be identical (random logits make float near-ties vanishingly
rare). Logprobs compare by relative error max |gpu - ref| / max |ref| <= 1e-5;
ranks and top ids exactly. Tests that take `split` run both kernels: rows
spread over many blocks (where `plan_split` allows it at that shape) and one
block per row. Both draw top-k / top-p rows from a sorted candidate list when
it fits and by radix descents over the row when not; the random rows here
take both paths (flat rows and large k overflow the list). Logprobs: test_sampling_logprobs.py;
the parameter-free greedy kernel: test_sampling_greedy.py."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cpu.sampler import sample as reference_sample
from sparkd.backend.cuda.kernels import sampling

from .sampling_cases import (
    device_buffers,
    llm_like_logits,
    pick,
    sample_both,
    sample_on_device,
    sampling_tensors,
)

pytestmark = pytest.mark.gpu
VOCABS = [1, 7, 1000, 32000, 151936]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("split", [True, False])
def test_greedy_takes_the_lowest_id_among_ties(gpu, split, vocab):
    rng = np.random.default_rng(vocab)
    rows = 6
    logits = llm_like_logits(rng, rows, vocab)
    for row in logits[::2]:
        row[rng.integers(0, vocab, size=3)] = row.max() + 1  # a tie at the top
    params = sampling_tensors(rng, rows, temperature=np.zeros(rows, np.float32))
    got, expected = sample_both(gpu, logits, params, split)
    np.testing.assert_array_equal(got.token_ids, expected.token_ids)
    np.testing.assert_array_equal(got.token_ids, np.argmax(logits, axis=1))


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("split", [True, False])
def test_filtered_draws_match_the_reference(gpu, split, vocab):
    rng = np.random.default_rng(vocab + 1)
    rows = 8 if vocab > 50000 else 32
    logits = llm_like_logits(rng, rows, vocab)
    params = sampling_tensors(
        rng, rows,
        temperature=pick(rng, [0.3, 0.7, 1.0, 1.6], rows, np.float32),
        top_k=pick(rng, [0, 1, 3, 50, vocab, vocab + 5], rows, np.int32),
        top_p=pick(rng, [1.0, 0.95, 0.6, 0.1], rows, np.float32),
        min_p=pick(rng, [0.0, 0.0, 0.05, 0.3], rows, np.float32))
    for step in range(3):  # fresh uniforms each step
        params.steps = params.steps + 1
        got, expected = sample_both(gpu, logits, params, split)
        np.testing.assert_array_equal(got.token_ids, expected.token_ids, err_msg=f"step {step}")


@pytest.mark.parametrize("split", [True, False])
def test_tied_logits_keep_whole_tie_groups(gpu, split):
    """Coarse logits (many exact ties): top-k and top-p keep every token tied at the cut."""
    rng = np.random.default_rng(3)
    rows, vocab = 32, 4000
    logits = np.round(2 * rng.standard_normal((rows, vocab))).astype(np.float32)
    params = sampling_tensors(rng, rows, top_k=pick(rng, [0, 2, 40, 700], rows, np.int32),
                              top_p=pick(rng, [1.0, 0.5, 0.9], rows, np.float32))
    got, expected = sample_both(gpu, logits, params, split)
    np.testing.assert_array_equal(got.token_ids, expected.token_ids)


@pytest.mark.parametrize("vocab", [1000, 50000])
@pytest.mark.parametrize("split", [True, False])
def test_penalties_and_bans_match_the_reference(gpu, split, vocab):
    rng = np.random.default_rng(vocab + 2)
    rows = 24
    logits = llm_like_logits(rng, rows, vocab)
    prompt = np.full((rows, 40), -1, np.int32)
    output = np.full((rows, 30), -1, np.int32)
    banned = np.full((rows, 3), -1, np.int32)
    for row in range(rows):
        favourites = np.argsort(-logits[row])[:10]  # penalise ids that would otherwise win
        n_prompt, n_output = rng.integers(0, 41), rng.integers(0, 31)
        prompt[row, :n_prompt] = rng.choice(np.r_[favourites, rng.integers(0, vocab, 30)], size=n_prompt)
        output[row, :n_output] = rng.choice(favourites[:4], size=n_output)  # repeats: counts > 1
        if row % 3 == 0:
            banned[row, :2] = favourites[:2]
    params = sampling_tensors(
        rng, rows,
        temperature=pick(rng, [0.0, 0.8, 1.0], rows, np.float32),
        top_k=pick(rng, [0, 20], rows, np.int32), top_p=pick(rng, [1.0, 0.9], rows, np.float32),
        repetition_penalty=pick(rng, [1.0, 1.3, 0.7], rows, np.float32),
        presence_penalty=pick(rng, [0.0, 0.5, -0.4], rows, np.float32),
        frequency_penalty=pick(rng, [0.0, 0.3, -0.2], rows, np.float32),
        prompt_token_ids=prompt, output_token_ids=output, banned_token_ids=banned)
    got, expected = sample_both(gpu, logits, params, split)
    np.testing.assert_array_equal(got.token_ids, expected.token_ids)
    assert not np.any(got.token_ids[::3, None] == banned[::3, :2])


@pytest.mark.parametrize("split", [True, False])
def test_candidate_capacity_edges_match_the_reference(gpu, split):
    """top-k right at and past the candidate lists' capacity (the longer ones fall back to
    radix descents), and top-p cuts from narrow to flat, in one launch."""
    rng = np.random.default_rng(9)
    rows, vocab = 8, 151936
    capacity = sampling.ROW_CANDIDATES if not split else sampling.SPLIT_CANDIDATES
    logits = llm_like_logits(rng, rows, vocab)
    params = sampling_tensors(
        rng, rows, temperature=np.array([1, 1, 1, 1, 0.8, 0.8, 1.3, 2.0], np.float32),
        top_k=np.array([capacity - 1, capacity, capacity + 1, 3 * capacity, 0, 0, 0, 0], np.int32),
        top_p=np.array([1, 1, 1, 0.9, 0.9, 0.3, 0.95, 0.5], np.float32))
    for _ in range(2):
        params.steps = params.steps + 1
        got, expected = sample_both(gpu, logits, params, split)
        np.testing.assert_array_equal(got.token_ids, expected.token_ids)


@pytest.mark.parametrize("rows", [64, 160])
def test_large_batches_match_the_reference(gpu, rows):
    """The benchmark's large-batch shapes (one block per row): every mode of
    tools/bench_sampling.py, penalties over a prompt with repeated ids included."""
    rng = np.random.default_rng(rows)
    vocab = 151936
    assert sampling.device_split_plan(rows, vocab) is None
    logits = llm_like_logits(rng, rows, vocab)
    prompt = rng.integers(0, vocab, size=(rows, 300)).astype(np.int32)
    prompt[:, :20] = np.argsort(-logits, axis=1)[:, :20]  # penalise ids that would otherwise win, twice
    prompt[:, 20:40] = prompt[:, :20]
    params = sampling_tensors(
        rng, rows, temperature=pick(rng, [0.0, 0.8, 0.8, 1.0], rows, np.float32),
        top_k=pick(rng, [0, 0, 50], rows, np.int32), top_p=pick(rng, [1.0, 0.9, 0.9], rows, np.float32),
        min_p=pick(rng, [0.0, 0.05], rows, np.float32), repetition_penalty=pick(rng, [1.0, 1.1], rows, np.float32),
        presence_penalty=pick(rng, [0.0, 0.3], rows, np.float32), prompt_token_ids=prompt,
        output_token_ids=prompt[:, :64].copy())
    got, expected = sample_both(gpu, logits, params)
    np.testing.assert_array_equal(got.token_ids, expected.token_ids)


def test_all_banned_row_draws_id_zero_like_the_reference(gpu):
    rng = np.random.default_rng(4)
    logits = llm_like_logits(rng, 2, 5)
    banned = np.tile(np.arange(5, dtype=np.int32), (2, 1))
    params = sampling_tensors(rng, 2, temperature=np.array([0, 1], np.float32), banned_token_ids=banned)
    got, expected = sample_both(gpu, logits, params)
    np.testing.assert_array_equal(got.token_ids, expected.token_ids)
    np.testing.assert_array_equal(got.token_ids, [0, 0])


def test_plan_split_spreads_small_batches_within_one_resident_wave():
    assert sampling.plan_split(1, 151936, 132, 660) == sampling.SplitPlan(splits=132, chunk=1152)
    assert sampling.plan_split(8, 151936, 132, 660) == sampling.SplitPlan(splits=38, chunk=4000)
    assert sampling.plan_split(2, 1000, 132, 660) == sampling.SplitPlan(splits=2, chunk=500)
    assert sampling.plan_split(1, 7, 132, 660) is None  # one chunk
    assert sampling.plan_split(64, 151936, 132, 660) is None  # 64 x 38 blocks are not resident at once
    assert sampling.plan_split(sampling.MAX_SPLIT_ROWS + 1, 1000, 132, 10**6) is None
    for rows in (1, 3, 8, 17):
        for vocab in (5003, 32000, 128256, 151936):
            plan = sampling.plan_split(rows, vocab, 132, 660)
            if plan is not None:
                assert plan.chunk % 4 == 0 and sampling.MIN_CHUNK // 2 <= plan.chunk <= sampling.MAX_CHUNK
                assert (plan.splits - 1) * plan.chunk < vocab <= plan.splits * plan.chunk
                assert rows * plan.splits <= 660


def test_the_parity_shapes_split_on_this_device(gpu):
    """The `split=True` cases above really run the split kernel."""
    for rows, vocab in ((6, 151936), (8, 151936), (32, 1000), (32, 32000), (24, 50000), (12, 5003), (1, 151936)):
        assert sampling.device_split_plan(rows, vocab) is not None, (rows, vocab)
    assert sampling.device_split_plan(256, 32000) is None


FULL_VOCAB_CASES = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top-k": {"temperature": 0.8, "top_k": 50},
    "top-p": {"temperature": 1.0, "top_p": 0.9},
    "top-k + top-p + min-p": {"temperature": 0.7, "top_k": 200, "top_p": 0.8, "min_p": 0.05},
    "wide top-p": {"temperature": 1.5, "top_p": 0.99},
}


@pytest.mark.parametrize("case", FULL_VOCAB_CASES)
def test_batch_one_at_full_vocab_matches_the_reference_step_after_step(gpu, case):
    """The benchmark's shape (one row over the whole GPU), penalties on, eight steps."""
    rng = np.random.default_rng(len(case))
    vocab = 151936
    logits = llm_like_logits(rng, 1, vocab)
    fields = {name: np.array([value], np.int32 if name == "top_k" else np.float32)
              for name, value in FULL_VOCAB_CASES[case].items()}
    favourites = np.argsort(-logits[0])[:8].astype(np.int32)
    params = sampling_tensors(rng, 1, repetition_penalty=np.array([1.2], np.float32),
                              presence_penalty=np.array([0.5], np.float32),
                              prompt_token_ids=favourites[None, :4], output_token_ids=favourites[None, 2:6], **fields)
    device_logits = gpu.upload(logits)
    for step in range(8):
        params.steps = params.steps + 1
        got = sample_on_device(gpu, device_logits, params)
        np.testing.assert_array_equal(got.token_ids, reference_sample(logits, params).token_ids, err_msg=f"step {step}")


def test_mixed_rows_share_a_split_launch(gpu):
    """Greedy rows (no barrier), filtered rows and plain temperature rows in one launch."""
    rng = np.random.default_rng(7)
    rows, vocab = 5, 128256
    logits = llm_like_logits(rng, rows, vocab)
    params = sampling_tensors(rng, rows, temperature=np.array([0, 1, 0.5, 0, 1.2], np.float32),
                              top_k=np.array([0, 40, 0, 5, 0], np.int32),
                              top_p=np.array([1, 0.9, 0.5, 1, 1], np.float32),
                              min_p=np.array([0, 0, 0.1, 0, 0], np.float32))
    for _ in range(4):
        params.steps = params.steps + 1
        got, expected = sample_both(gpu, logits, params)
        np.testing.assert_array_equal(got.token_ids, expected.token_ids)


def test_split_launch_replays_from_a_graph(gpu):
    """The row state the split kernel leaves behind is clean: replays draw what eager launches draw."""
    from sparkd.backend.cuda.graphs import capture

    rng = np.random.default_rng(8)
    rows, vocab = 2, 151936
    logits = gpu.upload(llm_like_logits(rng, rows, vocab))
    params = sampling_tensors(rng, rows, temperature=np.array([0.9, 0], np.float32),
                              top_k=np.array([30, 0], np.int32), top_p=np.array([0.95, 1], np.float32))
    expected = reference_sample(gpu.download(logits), params).token_ids
    inputs, out, workspace = device_buffers(gpu, logits, params)
    assert workspace is None and sampling.device_split_plan(rows, vocab) is not None
    sampling.launch_sample(out, logits, inputs, workspace, gpu.stream)  # eager first: loads the kernels
    gpu.stream.synchronize()
    np.testing.assert_array_equal(gpu.download(out.token_ids), expected)
    graph, _ = capture(gpu.stream, lambda: sampling.launch_sample(out, logits, inputs, workspace, gpu.stream))
    try:
        for _ in range(3):
            graph.replay(gpu.stream)
            gpu.stream.synchronize()
            np.testing.assert_array_equal(gpu.download(out.token_ids), expected)
    finally:
        graph.destroy()
