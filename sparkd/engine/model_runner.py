"""Turns a scheduled batch into flat model inputs, runs the forward and samples.

Host preparation is numpy-vectorised over tokens; the only Python loop is over
the sequences of the step. On CUDA, a decode step (one new token per sequence,
every sequence sampling) replays the captured graph of its padded batch size and
context bound (`DecodeGraphRunner`); prefill and mixed steps run eagerly.

A step is `launch`ed (inputs prepared, forward and draw enqueued) and later
`collect`ed (waits for the drawn ids on the host). Between the two the host may
launch the next step: an input id that a step in flight draws (a placeholder,
see Scheduler) is copied on the device from that step's drawn ids. The engine
calls both from a worker thread (CUDA releases the GIL while the thread waits
for the stream), so the event loop never waits on the device.

The runner knows backends only through `Ops` (graphs come from
`ops.decode_graph_runner`, which is None on the CPU).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from ..backend.base import AttentionMetadata, DrawnTokens, Ops, SampledTokens, SamplerOutput
from .block_table import PersistentBlockTable
from .kv_cache_manager import slot_mapping
from .outputs import TokenLogprob
from .request import Request
from .sampling_batch import SamplingBatch

try:
    import nvtx
except ImportError:
    nvtx = None

SampledToken = tuple[int, TokenLogprob | None]


def nvtx_range(name: str):
    """An NVTX range for profilers (Nsight Systems); a no-op without the `nvtx` package."""
    return nvtx.annotate(name, domain="sparkd") if nvtx is not None else contextlib.nullcontext()


@dataclass
class StepInputs:
    """Host arrays for one step.

    token_ids, positions: [T] int32.
    sample_rows: indices into the step's sequences that draw a token (their
      prompt is fully computed after this step).
    logits_indices: [len(sample_rows)] int32, the row in T of each sampler's last token.
    pending_rows: [P] int32, the rows of token_ids (0 on the host) that a step in
      flight draws; pending_requests: their P requests.
    """

    token_ids: np.ndarray
    positions: np.ndarray
    attn: AttentionMetadata
    sample_rows: list[int]
    logits_indices: np.ndarray
    pending_rows: np.ndarray
    pending_requests: list[Request]

    @property
    def is_decode(self) -> bool:
        """One new token per sequence and every sequence samples: the shape a decode graph serves."""
        return self.attn.is_decode_only and len(self.sample_rows) == self.attn.num_seqs


def prepare_inputs(scheduled, block_table: PersistentBlockTable, block_size: int,
                   with_state_slots: bool = False) -> StepInputs:
    """Flatten `scheduled` (a list of ScheduledSequence) into StepInputs; with_state_slots (a
    hybrid model) also each sequence's state slot."""
    num_seqs = len(scheduled)
    # One pass gathers Python ints; numpy then builds each array at once (numpy's
    # per-element access costs more than the list appends).
    num_new: list[int] = []
    starts: list[int] = []
    rows: list[int] = []
    tokens: list[int] = []
    sample_rows: list[int] = []
    pending_rows: list[int] = []
    pending_requests: list[Request] = []
    max_blocks = 0
    for i, s in enumerate(scheduled):
        req: Request = s.request
        lo = s.start
        hi = lo + s.num_new_tokens
        num_new.append(s.num_new_tokens)
        starts.append(lo)
        rows.append(block_table.row(req, s.block_ids))
        max_blocks = max(max_blocks, len(s.block_ids))
        known = req.num_tokens
        if hi <= known:
            tokens += req.token_slice(lo, hi)
        else:  # the last token is the one the step in flight draws (only ever one)
            tokens += req.token_slice(lo, hi - 1)
            pending_rows.append(len(tokens))
            pending_requests.append(req)
            tokens.append(0)
        if s.draws:
            sample_rows.append(i)

    num_new_array = np.array(num_new, np.int32)
    starts_array = np.array(starts, np.int32)
    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    np.cumsum(num_new_array, out=query_start_loc[1:])
    seq_lens = starts_array + num_new_array
    num_tokens = len(tokens)
    if num_tokens == num_seqs:  # a decode step: one token per sequence, at its first uncomputed position
        seq_of_token = np.arange(num_seqs)
        positions = starts_array
    else:
        seq_of_token = np.repeat(np.arange(num_seqs), num_new_array)
        positions = (np.arange(num_tokens, dtype=np.int32) - query_start_loc[seq_of_token]
                     + starts_array[seq_of_token]).astype(np.int32)
    block_tables = block_table.table[rows, :max_blocks]
    attn = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping(block_tables, seq_of_token, positions, block_size),
        max_query_len=max(num_new),
        max_seq_len=int(seq_lens.max()),
        state_slots=np.array([s.request.state_slot for s in scheduled], np.int32) if with_state_slots else None,
        state_snapshots=np.array([(b, n, slot) for b, s in enumerate(scheduled) for n, slot in s.state_snapshots],
                                 np.int32).reshape(-1, 3) if with_state_slots else None,
    )
    logits_indices = (query_start_loc[1:][sample_rows] - 1).astype(np.int32)
    return StepInputs(np.array(tokens, np.int32), positions, attn, sample_rows, logits_indices,
                      np.array(pending_rows, np.int32), pending_requests)


@dataclass
class LaunchedStep:
    """A step whose forward and draw are enqueued.

    samplers: the requests that draw, in the order of the drawn rows.
    drawn: the draw (None when no request draws), ids readable on the device at once.
    reads_output_ids: some sampler's penalties read its earlier output ids, so the
      next step must wait for this one's ids on the host before it is prepared."""

    num_scheduled: int
    sample_rows: list[int]
    samplers: list[Request]
    drawn: SampledTokens | None
    reads_output_ids: bool


class ModelRunner:
    """Owns the model, its KV caches and the backend for the engine."""

    def __init__(self, model, ops: Ops, kv_caches, block_size: int, max_num_seqs: int, max_model_len: int,
                 padding_state_slot: int | None = None):
        """kv_caches: per layer, its (k_cache, v_cache), or a linear-attention layer's state
        (then every step passes each sequence's state slot, and padding_state_slot is the spare
        slot a decode graph's padding rows write)."""
        self.model = model
        self.ops = ops
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.uses_state_slots = bool(model.config.linear_attention_layers)
        self.states = [kv_caches[i] for i in model.config.linear_attention_layers]
        max_blocks_per_seq = -(-max_model_len // block_size)
        # Finished requests release their rows lazily, so allow some slack over max_num_seqs.
        self.block_table = PersistentBlockTable(2 * max_num_seqs, max_blocks_per_seq)
        self.decode_graphs = ops.decode_graph_runner(max_num_seqs, max_blocks_per_seq, max_model_len,
                                                     padding_state_slot)
        self.sampling_batch = SamplingBatch()

    def launch(self, output, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueue one step of a SchedulerOutput. `previous`: the step in flight, whose
        drawn ids this step's placeholders take.

        On CUDA, raises GraphCaptureError when this step's decode graph failed to
        capture (the step yields no tokens; its batch size runs eagerly from now on),
        and DeviceLostError when the device is unusable."""
        self.ops.bind_thread()
        scheduled = output.scheduled
        with nvtx_range("prepare"):
            for request in output.preempted:
                self.block_table.release(request)
            inputs = prepare_inputs(scheduled, self.block_table, self.block_size, self.uses_state_slots)
            samplers = [scheduled[i].request for i in inputs.sample_rows]
            sampling = self.sampling_batch.tensors(samplers) if samplers else None
            drawn = self._drawn_tokens(inputs, previous)
        with nvtx_range("forward"):
            if output.state_restores:  # hybrid prefix-cache hits start from their snapshots
                src, dst = np.array(output.state_restores, np.int32).T
                self.ops.copy_state_slots_(self.states, src, dst)
            logits = self._forward(inputs, drawn)
        sampled = None
        if logits is not None:
            with nvtx_range("sample"):
                sampled = self.ops.sample_async(logits, sampling)
        return LaunchedStep(len(scheduled), inputs.sample_rows, samplers, sampled,
                            self.sampling_batch.reads_output_ids)

    def collect(self, step: LaunchedStep) -> list[SampledToken | None]:
        """Wait for a launched step's draw; result i belongs to output.scheduled[i]
        (None: a prompt chunk that produced no token)."""
        results: list[SampledToken | None] = [None] * step.num_scheduled
        if step.drawn is None:
            return results
        self.ops.bind_thread()
        sampled = step.drawn.result()
        token_ids = sampled.token_ids.tolist()
        for j, row in enumerate(step.sample_rows):
            logprob = None if sampled.logprobs is None else _token_logprob(sampled, j, step.samplers[j])
            results[row] = (token_ids[j], logprob)
        return results

    def execute(self, output) -> list[SampledToken | None]:
        """Launch and collect one step, with nothing in flight."""
        return self.collect(self.launch(output))

    def _drawn_tokens(self, inputs: StepInputs, previous: LaunchedStep | None) -> DrawnTokens | None:
        """Where the step's placeholder ids come from (`previous` draws them), or None
        when the step has no placeholder."""
        if not inputs.pending_requests:
            return None
        if previous is None or previous.drawn is None:
            raise RuntimeError("a step has placeholder tokens but no step in flight draws them")
        row_of = {request: j for j, request in enumerate(previous.samplers)}
        drawn_rows = np.array([row_of[request] for request in inputs.pending_requests], np.int32)
        return DrawnTokens(inputs.pending_rows, previous.drawn.token_ids, drawn_rows)

    def _forward(self, inputs: StepInputs, drawn: DrawnTokens | None):
        """Logits [len(sample_rows), V] float32, or None when no sequence samples."""
        snapshots = inputs.attn.state_snapshots
        if self.decode_graphs is not None and inputs.is_decode and (snapshots is None or not len(snapshots)):
            return self.decode_graphs.run(self.decode_forward, inputs.token_ids, inputs.positions, inputs.attn, drawn)
        ops = self.ops
        attn = ops.prepare_attention(inputs.attn)
        token_ids = ops.upload(inputs.token_ids)
        if drawn is not None:
            ops.copy_drawn_tokens_(token_ids, drawn)
        hidden = self.model.forward(token_ids, ops.upload(inputs.positions), attn, self.kv_caches)
        if not inputs.sample_rows:
            return None
        return self.model.compute_logits(hidden, ops.upload(inputs.logits_indices))

    def decode_forward(self, inputs):
        """A decode step on device inputs (DecodeInputs), the work a decode graph captures."""
        hidden = self.model.forward(inputs.token_ids, inputs.positions, inputs.attn, self.kv_caches)
        return self.model.compute_logits(hidden, inputs.logits_indices)

    def capture_graphs(self) -> None:
        """Capture the decode graph of every batch-size bucket now (no-op without graphs)."""
        if self.decode_graphs is not None:
            self.ops.bind_thread()
            self.decode_graphs.capture_all(self.decode_forward)

    def close(self) -> None:
        """Destroy the decode graphs (their memory pool goes with them)."""
        if self.decode_graphs is not None:
            self.decode_graphs.close()
            self.decode_graphs = None


def _token_logprob(out: SamplerOutput, j: int, req: Request) -> TokenLogprob | None:
    wanted = req.sampling_params.logprobs
    if wanted is None or out.logprobs is None:
        return None
    top = {}
    if wanted > 0:
        top = {int(t): float(lp) for t, lp in zip(out.top_ids[j, :wanted], out.top_logprobs[j, :wanted])}
    return TokenLogprob(int(out.token_ids[j]), float(out.logprobs[j]), int(out.ranks[j]), top)
