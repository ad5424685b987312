import numpy as np
from sparkd.engine.request import Request
from sparkd.engine.sampling_batch import SamplingBatch, build_sampling_tensors
from sparkd.engine.sampling_params import SamplingParams


def request(seed, output=(), **params):
    req = Request(str(seed), [1, 2, 3], SamplingParams(**params), seed=seed, eos_token_ids=frozenset({9}))
    req.output_token_ids = list(output)
    req.num_output_placeholders = 1  # scheduled: the step being prepared draws its next token
    return req


def assert_same(a, b):
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        assert (np.array_equal(x, y) and x.dtype == y.dtype) if isinstance(x, np.ndarray) else x == y, name


def test_a_kept_batch_matches_a_fresh_build_every_step():
    batch = SamplingBatch()
    requests = [request(1, temperature=0.0), request(2, [4], frequency_penalty=0.5, min_tokens=3),
                request(3, repetition_penalty=1.3, top_k=5)]
    for step in range(5):
        assert_same(batch.tensors(requests), build_sampling_tensors(requests))
        for r in requests:
            r.output_token_ids.append(step)
    requests = requests[1:] + [request(4, top_p=0.5)]  # the batch changes: its rows are rebuilt
    assert_same(batch.tensors(requests), build_sampling_tensors(requests))
