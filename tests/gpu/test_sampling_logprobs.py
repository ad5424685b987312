"""Logprobs, ranks and top ids of device sampling vs the numpy sampler's (_with_logprobs):
logprobs by relative error <= 1e-5, ranks and top ids exactly, rows of NaN logprobs included."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cuda.kernels import sampling

from .sampling_cases import llm_like_logits, pick, sample_both, sample_on_device, sampling_tensors

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("vocab", [1, 7, 1000, 5003])
@pytest.mark.parametrize("num_logprobs", [0, 1, 5, 20])
@pytest.mark.parametrize("split", [True, False])
def test_logprobs_ranks_and_top_ids_match_the_reference(gpu, split, rel_error, vocab, num_logprobs):
    rng = np.random.default_rng(vocab * 100 + num_logprobs)
    rows = 12
    logits = llm_like_logits(rng, rows, vocab)
    params = sampling_tensors(rng, rows, temperature=pick(rng, [0.0, 1.0], rows, np.float32),
                              repetition_penalty=pick(rng, [1.0, 1.5], rows, np.float32),
                              output_token_ids=rng.integers(0, vocab, size=(rows, 4)).astype(np.int32),
                              num_logprobs=num_logprobs)
    got, expected = sample_both(gpu, logits, params, split)
    np.testing.assert_array_equal(got.token_ids, expected.token_ids)
    assert rel_error(got.logprobs, expected.logprobs) <= 1e-5
    np.testing.assert_array_equal(got.ranks, expected.ranks)
    np.testing.assert_array_equal(got.top_ids, expected.top_ids)
    assert rel_error(got.top_logprobs, expected.top_logprobs) <= 1e-5


@pytest.mark.parametrize("vocab", [7, 5003, 151936])
@pytest.mark.parametrize("path", ["greedy", "split", "row"])
def test_rows_of_nan_logprobs_give_their_lowest_ids(gpu, rel_error, path, vocab):
    """A row of -inf logits, or one holding a NaN logit, has NaN logprobs: its top ids are its
    lowest and its rank 1, as the reference's. Such rows once left the top-id slots unwritten and
    read whatever shared memory held there as ids (an illegal address, seen on an H100)."""
    rng = np.random.default_rng(vocab)
    rows = 6
    logits = llm_like_logits(rng, rows, vocab)
    logits[1] = -np.inf
    logits[4, vocab // 2] = np.nan
    penalty = np.ones(rows, np.float32)
    if path != "greedy":
        penalty[0] = 1.5  # a row to process: the sampling kernels, not the greedy one
    params = sampling_tensors(rng, rows, temperature=np.zeros(rows, np.float32), repetition_penalty=penalty,
                              output_token_ids=rng.integers(0, vocab, size=(rows, 2)).astype(np.int32),
                              num_logprobs=5)
    assert sampling.is_plain_greedy(params) == (path == "greedy")
    got, expected = sample_both(gpu, logits, params, split=path != "row")
    np.testing.assert_array_equal(got.top_ids, expected.top_ids)
    np.testing.assert_array_equal(got.ranks, expected.ranks)
    nan = np.isnan(expected.top_logprobs)
    assert nan[[1, 4]].all() and not nan[[0, 2, 3, 5]].any()
    np.testing.assert_array_equal(np.isnan(got.top_logprobs), nan)
    assert rel_error(got.top_logprobs[~nan], expected.top_logprobs[~nan]) <= 1e-5
    no_nan_logit = [0, 1, 2, 3, 5]  # argmax over a NaN: numpy's is the NaN's id, the kernels' another
    np.testing.assert_array_equal(got.token_ids[no_nan_logit], expected.token_ids[no_nan_logit])


def test_top_logprob_ties_prefer_lower_ids(gpu):
    """Ties straddling the K-th place: the lower ids win (as the reference's _top_ids; compared
    with a stable sort here, independently of it)."""
    rng = np.random.default_rng(5)
    rows, vocab, k = 4, 3000, 20
    logits = np.round(rng.standard_normal((rows, vocab))).astype(np.float32)
    params = sampling_tensors(rng, rows, temperature=np.zeros(rows, np.float32), num_logprobs=k)
    device_logits = gpu.upload(logits)
    got = sample_on_device(gpu, device_logits, params)
    shifted = logits - logits.max(axis=1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    np.testing.assert_array_equal(got.top_ids, np.argsort(-logprobs, axis=1, kind="stable")[:, :k])


def test_rejects_too_many_logprobs(gpu):
    rng = np.random.default_rng(6)
    params = sampling_tensors(rng, 1, num_logprobs=sampling.MAX_TOP_LOGPROBS + 1)
    with pytest.raises(ValueError, match="num_logprobs must be at most"):
        sample_on_device(gpu, gpu.upload(np.zeros((1, 100), np.float32)), params)
