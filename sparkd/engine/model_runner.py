"""Turns a scheduled batch into flat model inputs, runs the forward and samples.

Host preparation is numpy-vectorised over tokens; the only Python loop is over
the sequences of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend.base import AttentionMetadata, Ops, SamplerOutput
from .outputs import TokenLogprob
from .block_table import PersistentBlockTable
from .kv_cache_manager import slot_mapping
from .request import Request
from .sampling_batch import build_sampling_tensors

SampledToken = tuple[int, TokenLogprob | None]


@dataclass
class StepInputs:
    """Host arrays for one step.

    token_ids, positions: [T] int32.
    sample_rows: indices into the step's sequences that draw a token (their
      prompt is fully computed after this step).
    logits_indices: [len(sample_rows)] int32, the row in T of each sampler's last token.
    """

    token_ids: np.ndarray
    positions: np.ndarray
    attn: AttentionMetadata
    sample_rows: list[int]
    logits_indices: np.ndarray


def prepare_inputs(scheduled, block_table: PersistentBlockTable, block_size: int) -> StepInputs:
    """Flatten `scheduled` (a list of ScheduledSequence) into StepInputs."""
    num_seqs = len(scheduled)
    num_new = np.empty(num_seqs, np.int32)
    starts = np.empty(num_seqs, np.int32)
    rows = np.empty(num_seqs, np.int64)
    tokens: list[int] = []
    sample_rows = []
    for i, s in enumerate(scheduled):
        req: Request = s.request
        lo = req.num_computed_tokens
        hi = lo + s.num_new_tokens
        num_new[i], starts[i] = s.num_new_tokens, lo
        rows[i] = block_table.row(req, s.block_ids)
        tokens += req.token_slice(lo, hi)
        if hi == req.num_tokens:
            sample_rows.append(i)

    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    np.cumsum(num_new, out=query_start_loc[1:])
    seq_lens = starts + num_new
    num_tokens = int(query_start_loc[-1])
    max_blocks = int(block_table.lengths[rows].max())
    block_tables = block_table.table[rows, :max_blocks]
    seq_of_token = np.repeat(np.arange(num_seqs), num_new)
    positions = (np.arange(num_tokens, dtype=np.int32) - query_start_loc[seq_of_token] + starts[seq_of_token]).astype(np.int32)
    attn = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping(block_tables, seq_of_token, positions, block_size),
        max_query_len=int(num_new.max()),
        max_seq_len=int(seq_lens.max()),
    )
    logits_indices = (query_start_loc[1:][sample_rows] - 1).astype(np.int32)
    return StepInputs(np.array(tokens, np.int32), positions, attn, sample_rows, logits_indices)


class ModelRunner:
    """Owns the model, its KV caches and the backend for the engine."""

    def __init__(self, model, ops: Ops, kv_caches, block_size: int, max_num_seqs: int, max_model_len: int):
        self.model = model
        self.ops = ops
        self.kv_caches = kv_caches
        self.block_size = block_size
        # Finished requests release their rows lazily, so allow some slack over max_num_seqs.
        self.block_table = PersistentBlockTable(2 * max_num_seqs, -(-max_model_len // block_size))

    def execute(self, output) -> list[SampledToken | None]:
        """Run one step of a SchedulerOutput; result i belongs to output.scheduled[i]
        (None: a prompt chunk that produced no token)."""
        for request in output.preempted:
            self.block_table.release(request)
        scheduled = output.scheduled
        inputs = prepare_inputs(scheduled, self.block_table, self.block_size)
        ops = self.ops
        attn = ops.prepare_attention(inputs.attn)
        hidden = self.model.forward(ops.upload(inputs.token_ids), ops.upload(inputs.positions), attn, self.kv_caches)
        results: list[SampledToken | None] = [None] * len(scheduled)
        if not inputs.sample_rows:
            return results
        logits = self.model.compute_logits(hidden, ops.upload(inputs.logits_indices))
        samplers = [scheduled[i].request for i in inputs.sample_rows]
        sampled = ops.sample(logits, build_sampling_tensors(samplers))
        for j, row in enumerate(inputs.sample_rows):
            results[row] = (int(sampled.token_ids[j]), _token_logprob(sampled, j, samplers[j]))
        return results


def _token_logprob(out: SamplerOutput, j: int, req: Request) -> TokenLogprob | None:
    wanted = req.sampling_params.logprobs
    if wanted is None or out.logprobs is None:
        return None
    top = {}
    if wanted > 0:
        top = {int(t): float(lp) for t, lp in zip(out.top_ids[j, :wanted], out.top_logprobs[j, :wanted])}
    return TokenLogprob(int(out.token_ids[j]), float(out.logprobs[j]), int(out.ranks[j]), top)
