"""The plain greedy kernel (cukernels/sampling_greedy.cu): steps whose every row is greedy with
nothing to process draw each row's argmax with no parameters uploaded, as the numpy sampler."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cuda.kernels import sampling
from sparkd.backend.dtypes import DType

from .sampling_cases import llm_like_logits, sample_both, sampling_tensors

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows, vocab", [(1, 1), (1, 7), (1, 151936), (3, 1000), (64, 32000), (65, 5003),
                                         (300, 2048)])
def test_plain_greedy_steps_draw_argmax_with_no_parameters_uploaded(gpu, rel_error, monkeypatch, rows, vocab):
    """A step whose every row is greedy with nothing to process takes the greedy kernel, which
    reads no parameters: ties go to the lowest id, an all -inf row to id 0, as the reference."""
    rng = np.random.default_rng(rows * vocab)
    logits = llm_like_logits(rng, rows, vocab)
    for row in logits[::2]:
        row[rng.integers(0, vocab, size=3)] = row.max() + 1  # a tie at the top
    if rows > 2:
        logits[-1] = -np.inf
    params = sampling_tensors(rng, rows, temperature=np.zeros(rows, np.float32), num_logprobs=2)
    assert sampling.is_plain_greedy(params)
    uploads = []
    monkeypatch.setattr(gpu.staging, "upload", lambda *args, **kwargs: uploads.append(args))
    got, expected = sample_both(gpu, logits, params)
    assert not uploads
    np.testing.assert_array_equal(got.token_ids, expected.token_ids)
    np.testing.assert_array_equal(got.token_ids, np.argmax(logits, axis=1))
    finite = np.isfinite(expected.logprobs)
    assert rel_error(got.logprobs[finite], expected.logprobs[finite]) <= 1e-5
    np.testing.assert_array_equal(got.ranks, expected.ranks)
    # Every row's, the all -inf one's too (NaN logprobs: its lowest ids); ties go to the lower ids.
    np.testing.assert_array_equal(got.top_ids, expected.top_ids)
    in_order = np.argsort(-logits, axis=1, kind="stable")[:, : got.top_ids.shape[1]]
    np.testing.assert_array_equal(got.top_ids[finite], in_order[finite])


def test_only_unprocessed_all_greedy_steps_are_plain_greedy():
    rng = np.random.default_rng(10)
    zeros = np.zeros(3, np.float32)
    assert sampling.is_plain_greedy(sampling_tensors(rng, 3, temperature=zeros, top_k=np.full(3, 5, np.int32)))
    assert not sampling.is_plain_greedy(sampling_tensors(rng, 3, temperature=np.array([0, 0, 0.5], np.float32)))
    assert not sampling.is_plain_greedy(sampling_tensors(rng, 3, temperature=zeros,
                                                         presence_penalty=np.array([0, 0.1, 0], np.float32)))
    assert not sampling.is_plain_greedy(sampling_tensors(rng, 3, temperature=zeros,
                                                         banned_token_ids=np.array([[-1], [4], [-1]], np.int32)))
    rows = sampling.MAX_GREEDY_ROWS + 1
    assert not sampling.is_plain_greedy(sampling_tensors(rng, rows, temperature=np.zeros(rows, np.float32)))


def test_greedy_launch_replays_from_a_graph(gpu):
    """The row state the greedy kernel leaves behind is clean: every replay draws the new logits' argmax."""
    from sparkd.backend.cuda.graphs import capture
    from sparkd.backend.cuda.transfer import copy_to_device

    rng = np.random.default_rng(11)
    rows, vocab = 2, 151936
    logits = gpu.empty((rows, vocab), DType.float32)
    out = sampling.SamplerBuffers.allocate(gpu.allocator, rows, -1)
    sampling.launch_greedy(out, gpu.upload(np.zeros((rows, vocab), np.float32)), gpu.stream)  # loads the kernel
    graph, _ = capture(gpu.stream, lambda: sampling.launch_greedy(out, logits, gpu.stream))
    try:
        for _ in range(3):
            host = llm_like_logits(rng, rows, vocab)
            copy_to_device(logits, host, gpu.stream)
            graph.replay(gpu.stream)
            gpu.stream.synchronize()
            np.testing.assert_array_equal(gpu.download(out.token_ids), np.argmax(host, axis=1))
    finally:
        graph.destroy()
