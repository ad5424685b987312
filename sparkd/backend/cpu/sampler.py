"""Token sampling on the host, vectorised over the batch: the reference for the CUDA sampler.

Per row, in order:
  1. repetition penalty over prompt + output ids (HF: positive logits divided,
     negative multiplied), then presence/frequency penalties over output ids
     (OpenAI: logit -= count * frequency + (count > 0) * presence);
  2. banned ids (min_tokens not reached) -> -inf;
  3. temperature 0 rows take the argmax (lowest id on ties); the others divide by
     the temperature and filter:
       top-k  keeps logits >= the k-th largest (ties at the boundary all stay),
       top-p  keeps the smallest most-likely prefix whose probability reaches
              top_p, plus any token tied with its last member (at least one),
       min-p  drops tokens with p < min_p * p_max;
  4. draw by the exponential race: token = argmax_i(p_i / E_i), E_i = -log(u_i)
     with u from Philox (seeds, steps). This draws i with probability p_i and
     depends only on the row's own (seed, step), never on the rest of the batch.

Logprobs describe the raw model distribution (log_softmax of the unprocessed logits).
"""

from __future__ import annotations

import numpy as np

from ..base import SamplerOutput, SamplingTensors
from .philox import philox_uniforms


def sample(logits: np.ndarray, params: SamplingTensors) -> SamplerOutput:
    """logits: [B, V] float32 -> one token per row, plus logprobs when
    `params.num_logprobs >= 0`."""
    raw = np.asarray(logits, dtype=np.float32)
    num_rows = raw.shape[0]
    processed = apply_penalties(raw, params)
    ban_tokens(processed, params.banned_token_ids)

    token_ids = np.empty(num_rows, dtype=np.int64)
    greedy = params.temperature == 0
    token_ids[greedy] = np.argmax(processed[greedy], axis=1)
    random_rows = np.flatnonzero(~greedy)
    if len(random_rows):
        weights = filtered_weights(
            processed[random_rows], params.temperature[random_rows], params.top_k[random_rows],
            params.top_p[random_rows], params.min_p[random_rows],
        )
        token_ids[random_rows] = exponential_race(weights, params.seeds[random_rows], params.steps[random_rows])

    if params.num_logprobs < 0:
        return SamplerOutput(token_ids=token_ids)
    return _with_logprobs(raw, token_ids, params.num_logprobs)


def token_counts(token_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """token_ids: [B, L] int padded with -1 -> [B, V] int64 occurrences per id."""
    num_rows = token_ids.shape[0]
    # Padding (-1) lands in an extra column V that is dropped.
    columns = np.where(token_ids < 0, vocab_size, token_ids).astype(np.int64)
    flat = (np.arange(num_rows, dtype=np.int64)[:, None] * (vocab_size + 1) + columns).ravel()
    counts = np.bincount(flat, minlength=num_rows * (vocab_size + 1))
    return counts.reshape(num_rows, vocab_size + 1)[:, :vocab_size]


def apply_penalties(logits: np.ndarray, params: SamplingTensors) -> np.ndarray:
    """[B, V] -> penalised copy [B, V] float32."""
    out = logits.copy()
    vocab_size = logits.shape[1]
    repetition = params.repetition_penalty.astype(np.float32)[:, None]
    if np.any(repetition != 1):
        seen = (token_counts(params.prompt_token_ids, vocab_size) > 0) | (
            token_counts(params.output_token_ids, vocab_size) > 0)
        penalised = np.where(out > 0, out / repetition, out * repetition)
        out = np.where(seen, penalised, out)
    presence = params.presence_penalty.astype(np.float32)[:, None]
    frequency = params.frequency_penalty.astype(np.float32)[:, None]
    if np.any(presence != 0) or np.any(frequency != 0):
        counts = token_counts(params.output_token_ids, vocab_size)
        out -= counts.astype(np.float32) * frequency + (counts > 0) * presence
    return out


def ban_tokens(logits: np.ndarray, banned_token_ids: np.ndarray) -> None:
    """Set logits [B, V] to -inf in place at banned_token_ids [B, S] (padded with -1)."""
    if banned_token_ids.size:
        logits[token_counts(banned_token_ids, logits.shape[1]) > 0] = -np.inf


def filtered_weights(
    logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray
) -> np.ndarray:
    """Temperature, top-k, top-p and min-p on penalised logits [R, V] (R rows, all
    temperature > 0) -> [R, V] float32 unnormalised probabilities, 0 where filtered."""
    vocab_size = logits.shape[1]
    scaled = logits / temperature.astype(np.float32)[:, None]
    sorted_rows = np.flatnonzero(((top_k > 0) & (top_k < vocab_size)) | (top_p < 1))
    if len(sorted_rows):
        threshold = _top_k_top_p_threshold(scaled[sorted_rows], top_k[sorted_rows], top_p[sorted_rows])
        part = scaled[sorted_rows]
        scaled[sorted_rows] = np.where(part >= threshold[:, None], part, -np.inf)
    weights = _exp_from_max(scaled)  # max weight of a row is 1, so p / p_max = weight
    if np.any(min_p > 0):
        weights[weights < min_p.astype(np.float32)[:, None]] = 0
    return weights


def _top_k_top_p_threshold(scaled: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """scaled [R, V] -> [R] smallest logit kept by top-k then top-p."""
    num_rows, vocab_size = scaled.shape
    rows = np.arange(num_rows)
    descending = -np.sort(-scaled, axis=1)
    k = np.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    kth = descending[rows, k - 1]
    descending = np.where(descending >= kth[:, None], descending, -np.inf)
    # top-p works on the distribution top-k left; float64 keeps the running sum honest.
    probs = _exp_from_max(descending).astype(np.float64)
    probs /= np.maximum(probs.sum(axis=1, keepdims=True), np.finfo(np.float64).tiny)
    mass_before = np.cumsum(probs, axis=1) - probs
    inside = (mass_before < top_p.astype(np.float64)[:, None]) & np.isfinite(descending)
    num_inside = np.maximum(inside.sum(axis=1), 1)
    top_p_cut = descending[rows, num_inside - 1]
    return np.where(top_p < 1, np.maximum(top_p_cut, kth), kth)


def _exp_from_max(x: np.ndarray) -> np.ndarray:
    """exp(x - rowmax) for x [R, V]; an all -inf row gives zeros instead of NaN."""
    row_max = x.max(axis=1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0)
    return np.exp(x - row_max)


def exponential_race(weights: np.ndarray, seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """weights [R, V] >= 0 (any scale) -> [R] int64 ids drawn with probability
    weight / sum(weights), by argmax(weight / -log(u))."""
    arrival = -np.log(philox_uniforms(seeds, steps, weights.shape[1]))
    return np.argmax(weights / arrival, axis=1).astype(np.int64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[B, V] -> [B, V] float32 log-probabilities; NaN throughout a row of -inf or NaN logits."""
    with np.errstate(invalid="ignore"):
        shifted = logits - logits.max(axis=1, keepdims=True)
    return (shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))).astype(np.float32)


def _with_logprobs(raw: np.ndarray, token_ids: np.ndarray, num_top: int) -> SamplerOutput:
    logprobs = log_softmax(raw)
    rows = np.arange(len(token_ids))
    chosen = logprobs[rows, token_ids]
    ranks = (logprobs > chosen[:, None]).sum(axis=1).astype(np.int64) + 1
    top_ids = _top_ids(logprobs, min(num_top, raw.shape[1]))
    return SamplerOutput(
        token_ids=token_ids, logprobs=chosen, ranks=ranks,
        top_ids=top_ids, top_logprobs=np.take_along_axis(logprobs, top_ids, axis=1),
    )


def _top_ids(logprobs: np.ndarray, num_top: int) -> np.ndarray:
    """[B, V] -> [B, num_top] int64 ids by descending logprob, lower id first on ties (at the
    num_top-th value too). A NaN logprob (a row of -inf or NaN logits) counts as -inf, so such a
    row's top ids are its lowest, as on the device."""
    if num_top == 0:
        return np.empty((logprobs.shape[0], 0), dtype=np.int64)
    order = np.where(np.isnan(logprobs), -np.inf, logprobs)
    kth = -np.partition(-order, num_top - 1, axis=1)[:, num_top - 1:num_top]
    above = order > kth
    ties = order == kth
    # Every id above the cut, then the lowest tied ids up to num_top: exactly num_top a row.
    keep = above | (ties & (np.cumsum(ties, axis=1) <= num_top - above.sum(axis=1, keepdims=True)))
    ids = np.nonzero(keep)[1].reshape(-1, num_top)  # each row's kept ids, ascending
    by_value = np.argsort(-np.take_along_axis(order, ids, axis=1), axis=1, kind="stable")
    return np.take_along_axis(ids, by_value, axis=1).astype(np.int64)
