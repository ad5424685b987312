"""Per-step sampling inputs from the scheduled requests.

Runs every step for every row, so it does plain list work and fills token-id
arrays only for rows whose penalties or min_tokens actually need them.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from ..backend.base import SamplingTensors
from .request import Request

_SEED_MASK = (1 << 64) - 1
_INT32_MAX = np.iinfo(np.int32).max


def build_sampling_tensors(requests: Sequence[Request]) -> SamplingTensors:
    """One row per request, in order (the order of the logits rows)."""
    params = [r.sampling_params for r in requests]
    repetition = np.array([p.repetition_penalty for p in params], dtype=np.float32)
    presence = np.array([p.presence_penalty for p in params], dtype=np.float32)
    frequency = np.array([p.frequency_penalty for p in params], dtype=np.float32)
    needs_prompt = (repetition != 1).tolist()
    needs_output = ((repetition != 1) | (presence != 0) | (frequency != 0)).tolist()
    return SamplingTensors(
        temperature=np.array([p.temperature for p in params], dtype=np.float32),
        top_k=np.array([min(p.top_k, _INT32_MAX) for p in params], dtype=np.int32),
        top_p=np.array([p.top_p for p in params], dtype=np.float32),
        min_p=np.array([p.min_p for p in params], dtype=np.float32),
        repetition_penalty=repetition,
        presence_penalty=presence,
        frequency_penalty=frequency,
        prompt_token_ids=pad_token_rows(r.prompt_token_ids if need else () for r, need in zip(requests, needs_prompt)),
        output_token_ids=pad_token_rows(r.output_token_ids if need else () for r, need in zip(requests, needs_output)),
        banned_token_ids=pad_token_rows(banned_token_ids(r) for r in requests),
        seeds=np.array([r.seed & _SEED_MASK for r in requests], dtype=np.uint64),
        steps=np.array([r.num_output_tokens for r in requests], dtype=np.int64),
        num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
    )


def banned_token_ids(request: Request) -> list[int]:
    """Ids that must not be drawn yet: the stop tokens, while min_tokens is not reached."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    eos = [] if params.ignore_eos else sorted(request.eos_token_ids)
    return eos + params.stop_token_ids


def pad_token_rows(rows: Iterable[Sequence[int]]) -> np.ndarray:
    """Ragged id lists -> [B, max_len] int32 padded with -1."""
    rows = list(rows)
    width = max((len(row) for row in rows), default=0)
    out = np.full((len(rows), width), -1, dtype=np.int32)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = row
    return out

