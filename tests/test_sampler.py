"""The numpy sampler against distributions and formulas computed independently here."""

from collections import Counter

import numpy as np
import pytest

from sparkd.backend.base import SamplingTensors
from sparkd.backend.cpu.sampler import apply_penalties, sample
from sparkd.engine.request import Request
from sparkd.engine.sampling_batch import build_sampling_tensors
from sparkd.engine.sampling_params import SamplingParams


def make_params(num_rows: int, **fields) -> SamplingTensors:
    """Neutral sampling parameters for `num_rows` rows; scalars in `fields` broadcast."""
    defaults = dict(
        temperature=(1.0, np.float32), top_k=(0, np.int32), top_p=(1.0, np.float32), min_p=(0.0, np.float32),
        repetition_penalty=(1.0, np.float32), presence_penalty=(0.0, np.float32),
        frequency_penalty=(0.0, np.float32), seeds=(7, np.uint64), steps=(0, np.int64),
    )
    arrays = {name: np.broadcast_to(np.asarray(fields.pop(name, value), dtype), (num_rows,)).copy()
              for name, (value, dtype) in defaults.items()}
    ids = {name: np.asarray(fields.pop(name, np.empty((num_rows, 0))), dtype=np.int32)
           for name in ("prompt_token_ids", "output_token_ids", "banned_token_ids")}
    return SamplingTensors(**arrays, **ids, **fields)


def reference_distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """The processed distribution, one token at a time in float64, as the docs define it."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = np.ones(len(z), dtype=bool)
    if 0 < top_k < len(z):
        keep &= z >= z[order[top_k - 1]]

    def normalised():
        p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        return p / p.sum()

    if top_p < 1:
        probs, mass = normalised(), 0.0
        for i in order:  # the smallest most-likely set reaching top_p
            if keep[i]:
                mass += probs[i]
                if mass >= top_p:
                    break
        keep &= z >= z[i]
    if min_p > 0:
        probs = normalised()
        keep &= probs >= min_p * probs.max()
    return normalised()


def chi_square_ok(counts: np.ndarray, expected_probs: np.ndarray) -> bool:
    """Pearson chi-square at p = 1e-6 (Wilson-Hilferty quantile), cells with an
    expected count below 5 pooled."""
    n = counts.sum()
    expected = expected_probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(exp) - 1
    z = 4.75  # one-sided normal quantile of 1e-6
    critical = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return stat < critical


LOGITS = np.random.default_rng(0).normal(0, 1.5, size=16).astype(np.float32)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.3, 4, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.8, 6, 0.9, 0.05),
])
def test_draws_follow_the_processed_distribution(temperature, top_k, top_p, min_p):
    num_draws = 20000
    params = make_params(num_draws, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                         seeds=12345, steps=np.arange(num_draws))
    tokens = sample(np.tile(LOGITS, (num_draws, 1)), params).token_ids
    counts = np.bincount(tokens, minlength=len(LOGITS))
    expected = reference_distribution(LOGITS, temperature, top_k, top_p, min_p)
    assert counts[expected == 0].sum() == 0, "a filtered token was drawn"
    assert chi_square_ok(counts, expected)


def test_filters_keep_at_least_one_token():
    # top_p smaller than the top probability keeps only the top token; so does min_p = 1.
    logits = np.tile(LOGITS, (200, 1))
    best = int(np.argmax(LOGITS))
    for fields in (dict(top_p=1e-3), dict(min_p=1.0), dict(top_k=1)):
        tokens = sample(logits, make_params(200, steps=np.arange(200), **fields)).token_ids
        assert set(tokens.tolist()) == {best}, fields


def test_greedy_takes_the_argmax_and_the_lowest_id_on_ties():
    logits = np.array([[0.1, 3.0, 3.0, -1.0], [5.0, 4.0, 5.0, 5.0], [-np.inf, -2.0, -np.inf, -3.0]], np.float32)
    out = sample(logits, make_params(3, temperature=0.0, seeds=np.arange(3)))
    assert out.token_ids.tolist() == [1, 0, 1]
    assert out.logprobs is None and out.ranks is None and out.top_ids is None


def test_penalties_match_reference_formulas():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, size=(3, 12)).astype(np.float32)
    prompt = [[0, 1, 1, 5], [2, 3], [11, 4, 4, 4, 0]]
    output = [[5, 6, 6, 6], [3, 7, 7], []]
    repetition, presence, frequency = [1.3, 1.0, 0.7], [0.5, -0.4, 1.0], [0.25, 0.8, -0.5]
    params = make_params(
        3, repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
        prompt_token_ids=pad(prompt), output_token_ids=pad(output))
    got = apply_penalties(logits, params)
    for row in range(3):
        expected = logits[row].astype(np.float64)
        for t in set(prompt[row]) | set(output[row]):  # HF RepetitionPenaltyLogitsProcessor
            expected[t] = expected[t] / repetition[row] if expected[t] > 0 else expected[t] * repetition[row]
        for t, count in Counter(output[row]).items():  # OpenAI presence / frequency
            expected[t] -= count * frequency[row] + presence[row]
        np.testing.assert_allclose(got[row], expected, rtol=1e-6, atol=1e-6)


def test_penalties_and_bans_steer_sampling():
    logits = np.array([[4.0, 3.0, 0.0, -1.0]] * 2, np.float32)
    presence = make_params(2, temperature=0.0, presence_penalty=2.0, output_token_ids=pad([[0], []]))
    assert sample(logits, presence).token_ids.tolist() == [1, 0]
    banned = pad([[0, 1], [0, 1]])
    for temperature in (0.0, 1.0):
        params = make_params(2, temperature=temperature, steps=[0, 1], banned_token_ids=banned)
        assert set(sample(logits, params).token_ids.tolist()) <= {2, 3}


def test_minus_infinity_logits_are_never_drawn():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(500, 40)).astype(np.float32)
    logits[:, ::2] = -np.inf
    tokens = sample(logits, make_params(500, steps=np.arange(500), top_p=0.95)).token_ids
    assert np.all(tokens % 2 == 1)
    only_one = np.full((2, 8), -np.inf, np.float32)
    only_one[:, 5] = 0.0
    assert sample(only_one, make_params(2, temperature=[0.0, 1.0])).token_ids.tolist() == [5, 5]


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    rng = np.random.default_rng(3)
    vocab = 64
    target_logits = rng.normal(size=(4, vocab)).astype(np.float32)
    target = dict(temperature=[0.9, 1.0, 0.6, 1.2], top_k=[0, 10, 0, 5], top_p=[1.0, 0.9, 0.8, 1.0],
                  seeds=[11, 2**63 + 5, 11, 99], steps=[0, 3, 1, 2**33])
    alone = [sample(target_logits[i:i + 1], make_params(1, **{k: v[i] for k, v in target.items()})).token_ids[0]
             for i in range(4)]
    for trial in range(5):
        noise = rng.normal(size=(6, vocab)).astype(np.float32)
        logits = np.concatenate([noise, target_logits])
        fields = {k: np.concatenate([rng.integers(0, 3, 6), v]) for k, v in target.items() if k != "seeds"}
        fields["seeds"] = np.array(rng.integers(0, 3, 6).tolist() + target["seeds"], dtype=np.uint64)
        fields["temperature"] = np.concatenate([rng.choice([0.0, 0.5, 2.0], 6), target["temperature"]])
        fields["top_p"] = np.concatenate([rng.uniform(0.5, 1.0, 6), target["top_p"]])
        perm = rng.permutation(10)
        out = sample(logits[perm], make_params(10, **{k: v[perm] for k, v in fields.items()})).token_ids
        mixed = out[np.argsort(perm)][6:]
        assert mixed.tolist() == alone, trial


def test_different_seeds_draw_different_sequences():
    logits = np.zeros((50, 1000), np.float32)
    first = sample(logits, make_params(50, seeds=1, steps=np.arange(50))).token_ids
    second = sample(logits, make_params(50, seeds=2, steps=np.arange(50))).token_ids
    again = sample(logits, make_params(50, seeds=1, steps=np.arange(50))).token_ids
    assert first.tolist() == again.tolist()
    assert (first != second).sum() > 40


def test_logprobs_ranks_and_top_ids_describe_the_raw_distribution():
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 3, size=(4, 50)).astype(np.float32)
    params = make_params(4, temperature=[0.0, 0.5, 1.0, 2.0], repetition_penalty=1.5,
                         output_token_ids=pad([[1, 2], [3], [], [4]]), steps=np.arange(4), num_logprobs=5)
    out = sample(logits, params)
    raw = logits.astype(np.float64)
    reference = raw - raw.max(1, keepdims=True)
    reference -= np.log(np.exp(reference).sum(1, keepdims=True))
    rows = np.arange(4)
    np.testing.assert_allclose(out.logprobs, reference[rows, out.token_ids], atol=1e-5)
    expected_ranks = 1 + (reference > reference[rows, out.token_ids][:, None]).sum(1)
    assert out.ranks.tolist() == expected_ranks.tolist()
    expected_top = np.argsort(-reference, axis=1, kind="stable")[:, :5]
    assert out.top_ids.tolist() == expected_top.tolist()
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(reference, expected_top, 1), atol=1e-5)

    none_top = sample(logits, make_params(4, num_logprobs=0))
    assert none_top.top_ids.shape == (4, 0) and none_top.ranks.shape == (4,)


def test_top_ids_break_ties_at_the_cut_by_lower_id_and_order_nan_rows_by_id():
    """Ties at the num_top-th logprob go to the lowest ids (the device's rule); a row whose logprobs
    are NaN (all -inf logits, or a NaN logit) gives its lowest ids, rank 1 and NaN logprobs."""
    logits = np.zeros((3, 4000), np.float32)
    logits[0, [3000, 3500]] = 1.0  # then 3998 ties for the last three places
    logits[1] = -np.inf
    logits[2, 7] = np.nan
    out = sample(logits, make_params(3, temperature=0.0, num_logprobs=5))
    assert out.top_ids.tolist() == [[3000, 3500, 0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert out.ranks.tolist()[1:] == [1, 1]
    assert np.isnan(out.logprobs[1:]).all() and np.isnan(out.top_logprobs[1:]).all()
    assert np.isfinite(out.top_logprobs[0]).all()


def pad(rows):
    width = max((len(r) for r in rows), default=0)
    return np.array([list(r) + [-1] * (width - len(r)) for r in rows], dtype=np.int32).reshape(len(rows), width)


def request(seed=0, prompt=(1, 2, 3), output=(), eos=frozenset({9}), **params) -> Request:
    req = Request(request_id=str(seed), prompt_token_ids=list(prompt), sampling_params=SamplingParams(**params),
                  seed=seed, eos_token_ids=eos)
    req.output_token_ids = list(output)
    req.num_output_placeholders = 1  # scheduled: the step being prepared draws its next token
    return req


def test_a_token_in_flight_counts_as_drawn():
    """Async scheduling: the step in flight draws one more token before this one's draw."""
    req = request(seed=1, output=[5], min_tokens=3)
    req.num_output_placeholders = 2
    t = build_sampling_tensors([req])
    assert t.steps.tolist() == [2] and t.banned_token_ids.tolist() == [[9]]
    req.output_token_ids.append(6)
    t = build_sampling_tensors([req])
    assert t.steps.tolist() == [3] and t.banned_token_ids.shape == (1, 0)


def test_build_sampling_tensors():
    requests = [
        request(seed=5, temperature=0.0, logprobs=2),
        request(seed=2**64 - 1, output=[4, 4], repetition_penalty=1.2, top_k=7, top_p=0.5, min_p=0.1),
        request(seed=6, output=[8], prompt=[1], min_tokens=3, stop_token_ids=[3], presence_penalty=0.5),
        request(seed=7, min_tokens=2, ignore_eos=True, stop_token_ids=[4], logprobs=5),
        request(seed=8, output=[1, 1, 1], min_tokens=3),
    ]
    t = build_sampling_tensors(requests)
    assert t.temperature.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert t.top_k.tolist() == [0, 7, 0, 0, 0] and t.top_k.dtype == np.int32
    np.testing.assert_allclose(t.top_p, [1, 0.5, 1, 1, 1])
    np.testing.assert_allclose(t.min_p, [0, 0.1, 0, 0, 0])
    # Ids are filled only where a penalty reads them: prompt for repetition, output for all three.
    assert t.prompt_token_ids.tolist() == [[-1] * 3, [1, 2, 3], [-1] * 3, [-1] * 3, [-1] * 3]
    assert t.output_token_ids.tolist() == [[-1, -1], [4, 4], [8, -1], [-1, -1], [-1, -1]]
    assert t.banned_token_ids.tolist() == [[-1, -1], [-1, -1], [9, 3], [4, -1], [-1, -1]]
    assert t.seeds.dtype == np.uint64 and t.seeds.tolist() == [5, 2**64 - 1, 6, 7, 8]
    assert t.steps.tolist() == [0, 2, 1, 0, 3]
    assert t.num_logprobs == 5
    assert build_sampling_tensors([request()]).num_logprobs == -1
