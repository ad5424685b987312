"""Per-step sampling inputs from the scheduled requests.

Runs every step for every row. A request's parameters and seed never change, and a
decode batch is most often the same requests as the step before, so `SamplingBatch`
keeps the parameter rows of the last batch and rebuilds per step only what moves:
the Philox steps, and the token-id rows of the requests whose penalties or
min_tokens read them.

A request's draw count includes its placeholders (async scheduling): when a
step is prepared, the request's own placeholder for this step is the last one,
so `num_output_tokens + num_output_placeholders - 1` tokens were drawn before.
Penalties read the drawn ids themselves: the engine never prepares a step for
such a request while one of its ids is still in flight (`reads_output_ids`).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from ..backend.base import SamplingTensors
from .request import Request

_SEED_MASK = (1 << 64) - 1
_INT32_MAX = np.iinfo(np.int32).max


class _FixedRows:
    """What stays the same from step to step for one batch of requests, one row each."""

    def __init__(self, requests: Sequence[Request]):
        params = [r.sampling_params for r in requests]
        self.temperature = np.array([p.temperature for p in params], dtype=np.float32)
        self.top_k = np.array([min(p.top_k, _INT32_MAX) for p in params], dtype=np.int32)
        self.top_p = np.array([p.top_p for p in params], dtype=np.float32)
        self.min_p = np.array([p.min_p for p in params], dtype=np.float32)
        self.repetition_penalty = np.array([p.repetition_penalty for p in params], dtype=np.float32)
        self.presence_penalty = np.array([p.presence_penalty for p in params], dtype=np.float32)
        self.frequency_penalty = np.array([p.frequency_penalty for p in params], dtype=np.float32)
        self.seeds = np.array([r.seed & _SEED_MASK for r in requests], dtype=np.uint64)
        self.num_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
        needs_prompt = self.repetition_penalty != 1
        self.prompt_token_ids = pad_token_rows(r.prompt_token_ids if need else ()
                                               for r, need in zip(requests, needs_prompt.tolist()))
        # Rows whose output ids a penalty reads; None when no row's does.
        needs_output = needs_prompt | (self.presence_penalty != 0) | (self.frequency_penalty != 0)
        self.needs_output: list[bool] | None = needs_output.tolist() if needs_output.any() else None
        self.has_min_tokens = any(p.min_tokens > 0 for p in params)
        self.no_token_ids = np.full((len(params), 0), -1, dtype=np.int32)


class SamplingBatch:
    """Builds each step's SamplingTensors, reusing the fixed rows while the batch is the
    same requests in the same order. The arrays it returns are shared between steps:
    read them, never write them."""

    def __init__(self) -> None:
        self._requests: list[Request] = []
        self._fixed: _FixedRows | None = None

    @property
    def reads_output_ids(self) -> bool:
        """Some request of the last batch has a penalty that reads its output ids."""
        return self._fixed is not None and self._fixed.needs_output is not None

    def tensors(self, requests: Sequence[Request]) -> SamplingTensors:
        """One row per request, in order (the order of the logits rows)."""
        # Requests compare by identity, so this is one pass over two lists of pointers.
        if self._fixed is None or requests != self._requests:
            self._requests = list(requests)
            self._fixed = _FixedRows(requests)
        fixed = self._fixed
        if fixed.needs_output is None:
            output_token_ids = fixed.no_token_ids
        else:
            output_token_ids = pad_token_rows(r.output_token_ids if need else ()
                                              for r, need in zip(requests, fixed.needs_output))
        if fixed.has_min_tokens:
            banned = pad_token_rows(banned_token_ids(r) for r in requests)
        else:
            banned = fixed.no_token_ids
        return SamplingTensors(
            temperature=fixed.temperature,
            top_k=fixed.top_k,
            top_p=fixed.top_p,
            min_p=fixed.min_p,
            repetition_penalty=fixed.repetition_penalty,
            presence_penalty=fixed.presence_penalty,
            frequency_penalty=fixed.frequency_penalty,
            prompt_token_ids=fixed.prompt_token_ids,
            output_token_ids=output_token_ids,
            banned_token_ids=banned,
            seeds=fixed.seeds,
            steps=np.array([num_drawn_before(r) for r in requests], dtype=np.int64),
            num_logprobs=fixed.num_logprobs,
        )


def build_sampling_tensors(requests: Sequence[Request]) -> SamplingTensors:
    """One step's SamplingTensors for `requests`, built from scratch."""
    return SamplingBatch().tensors(requests)


def banned_token_ids(request: Request) -> list[int]:
    """Ids that must not be drawn yet: the stop tokens, while min_tokens is not reached."""
    params = request.sampling_params
    if num_drawn_before(request) >= params.min_tokens:
        return []
    eos = [] if params.ignore_eos else sorted(request.eos_token_ids)
    return eos + params.stop_token_ids


def num_drawn_before(request: Request) -> int:
    """Tokens the request drew before the draw of the step being prepared."""
    return len(request.output_token_ids) + request.num_output_placeholders - 1


def pad_token_rows(rows: Iterable[Sequence[int]]) -> np.ndarray:
    """Ragged id lists -> [B, max_len] int32 padded with -1."""
    rows = list(rows)
    width = max((len(row) for row in rows), default=0)
    out = np.full((len(rows), width), -1, dtype=np.int32)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = row
    return out
