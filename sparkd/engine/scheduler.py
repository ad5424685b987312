"""Continuous batching in the vLLM v1 style: no prefill or decode phases.

Every request has `num_scheduled_tokens` (prompt + output + placeholders) of
which `num_computed_tokens` have K/V in the cache or in a step already enqueued.
Each step gives every scheduled request as many of its missing tokens as fit in
the token budget, so a decode is 1 token, a prompt is a chunk, and one step
mixes both.

`schedule()` counts the step's tokens as computed at once, and a request whose
chunk reaches its end gets a placeholder for the token the step will draw. So
the next step can be scheduled before this one's tokens are known (async
scheduling: the runner reads the placeholder's id on the device); `update()`
swaps the placeholder for the drawn token. A request that then stops has run
one wasted token in the step already scheduled: harmless, its blocks are freed
only after that step on the same stream. Running requests go first, then waiting ones
(minus their prefix-cache hit). When blocks run out, the most recently arrived
running request is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager, PrefixCacheStats
from .outputs import TokenLogprob
from .request import Request, RequestStatus
from .state_pool import StateSlotPool
from .state_snapshots import DEFAULT_INTERVAL_BLOCKS, StateSnapshots, boundaries_to_snapshot


@dataclass(slots=True)
class ScheduledSequence:
    """One request's share of a step: tokens [start, start + num_new_tokens) are
    computed. block_ids is its whole (live) block table. draws: the chunk reaches
    the end of the request, so the step draws its next token."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    start: int
    draws: bool
    # Hybrid prefix caching: (n, slot) copies the state after the chunk's first n tokens to a snapshot slot.
    state_snapshots: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    num_batched_tokens: int
    preempted: list[Request]  # lost their blocks this step; the runner drops their state
    # Hybrid prefix-cache hits: (snapshot slot, request slot) state copies to run before the step.
    state_restores: list[tuple[int, int]] = field(default_factory=list)


def _arrival_time(request: Request) -> float:
    return request.arrival_time


class Scheduler:
    """Picks each step's batch and applies its sampled tokens.

    Call order: `schedule()`, then the forward on its output, then `update()` with
    that output and its sampled tokens. At most one step may be between schedule()
    and update() when the next schedule() runs (async scheduling).
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_state_slots: int = 0,
                 num_state_snapshots: int = 0, snapshot_interval_blocks: int = DEFAULT_INTERVAL_BLOCKS):
        """num_state_slots: a hybrid model's linear-attention state pool (0: none); each running
        request then holds one of its first num_state_slots slots. A prefix-cache hit also needs
        the state at its end: with prefix caching, the num_state_snapshots slots after those hold
        snapshots (StateSnapshots, taken every snapshot_interval_blocks blocks of a prompt and at
        its last full block), and a hit keeps the longest prefix that has one; without, a hybrid
        request never starts from blocks it did not compute (n > 1 siblings compute their own)."""
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len), ("num_blocks", num_blocks),
                            ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.state_slots = StateSlotPool(num_state_slots) if num_state_slots else None
        self.state_snapshots = (StateSnapshots(num_state_slots, num_state_snapshots)
                                if num_state_slots and num_state_snapshots and enable_prefix_caching else None)
        self.snapshot_interval_blocks = snapshot_interval_blocks
        # A sequence stops at the pool's size too, so one alone always fits and
        # preemption can never livelock.
        self._max_sequence_len = min(max_model_len, num_blocks * block_size)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept in arrival order: preemption takes the last
        self._group_leaders: dict[str, Request] = {}  # n > 1: group id -> its first sibling
        self.num_preemptions_total = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv.prefix_cache_hits

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.kv.prefix_cache_stats

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError (and nothing queued) if it can never run."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError("the prompt must contain at least one token")
        if num_prompt > self.max_model_len:
            raise ValueError(f"the prompt has {num_prompt} tokens, more than max_model_len "
                             f"({self.max_model_len})")
        capacity = self.kv.pool.num_blocks * self.kv.block_size
        if num_prompt > capacity:
            raise ValueError(f"the prompt has {num_prompt} tokens, more than the whole KV cache holds "
                             f"({capacity} tokens: {self.kv.pool.num_blocks} blocks of {self.kv.block_size})")
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.group_id is not None:
            self._group_leaders.setdefault(request.group_id, request)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch: running requests first, in arrival order, then waiting ones."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Request] = []
        restores: list[tuple[int, int]] = []
        kv = self.kv
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = min(request.num_scheduled_tokens - request.num_computed_tokens, budget)
            if num_new <= 0 or self._stops_by_length(request):
                i += 1  # its placeholder ends it: no token to compute
                continue
            block_ids = kv.allocate_slots(request, num_new)
            while block_ids is None:
                # The victim is always at index >= i (running is in arrival order),
                # so nothing already scheduled this step loses its blocks.
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                block_ids = kv.allocate_slots(request, num_new)
            if block_ids is None:
                break
            scheduled.append(self._schedule(request, num_new, block_ids))
            budget -= num_new
            i += 1
        # As in vLLM: a step that had to preempt admits nobody new.
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, restores)
        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, preempted, restores)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSequence], restores: list[tuple[int, int]]) -> int:
        """Move waiting requests to running, first come first served, while budget,
        seats and blocks last (and state slots, for a hybrid model, whose hits add their
        state copies to `restores`). Returns the budget left."""
        skipped: list[Request] = []
        state_slots = self.state_slots
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and (state_slots is None or state_slots.num_free)):
            request = self.waiting.popleft()
            leader = self._group_leaders.get(request.group_id) if request.group_id is not None else None
            if leader is request:
                leader = None
            if request.num_output_placeholders or (leader is not None and not leader.output_token_ids):
                # Wait for the token a step in flight draws for it (it was preempted meanwhile),
                # or for the first sibling's prompt, whose blocks it then shares.
                skipped.append(request)
                continue
            snapshot = None
            if state_slots is None:
                computed_block_ids, num_computed = self.kv.get_computed_blocks(request, share_from=leader)
            else:
                computed_block_ids, snapshot = self._snapshot_hit(request)
                num_computed = len(computed_block_ids) * self.kv.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            block_ids = self.kv.allocate_slots(request, num_new, computed_block_ids)
            if block_ids is None:
                self.waiting.appendleft(request)
                break
            if state_slots is not None:
                state_slots.allocate(request)
                if snapshot is not None:
                    restores.append((snapshot, request.state_slot))
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_computed
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_arrival_time)
            scheduled.append(self._schedule(request, num_new, block_ids))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _snapshot_hit(self, request: Request) -> tuple[list[int], int | None]:
        """A hybrid request's hit: the longest run of its cached prompt blocks whose last block
        has a state snapshot, and that snapshot's slot; ([], None) when there is none."""
        if self.state_snapshots is None:
            return [], None
        block_ids, _ = self.kv.get_computed_blocks(request)
        hashes = request.block_hashes
        for num_blocks in range(len(block_ids), 0, -1):
            slot = self.state_snapshots.lookup(hashes[num_blocks - 1])
            if slot is not None:
                return block_ids[:num_blocks], slot
        return [], None

    def _schedule(self, request: Request, num_new: int, block_ids: list[int]) -> ScheduledSequence:
        """Count the tokens as computed; a chunk that reaches the end draws a token."""
        start = request.num_computed_tokens
        request.num_computed_tokens = start + num_new
        draws = request.num_computed_tokens == request.num_scheduled_tokens
        if draws:
            request.num_output_placeholders += 1
        snapshots = self._plan_snapshots(request, start, num_new) if self.state_snapshots is not None else ()
        return ScheduledSequence(request, num_new, block_ids, start, draws, snapshots)

    def _plan_snapshots(self, request: Request, start: int, num_new: int) -> tuple[tuple[int, int], ...]:
        """The snapshots a prompt chunk [start, start + num_new) writes: (tokens into the chunk, slot)."""
        if start >= request.num_prompt_tokens:
            return ()  # a decode step: snapshots are of prompts only
        block_size = self.kv.block_size
        boundaries = [b for b in boundaries_to_snapshot(request.num_prompt_tokens, block_size,
                                                        self.snapshot_interval_blocks) if start < b <= start + num_new]
        if not boundaries:
            return ()
        hashes = self.kv.block_hashes(request, boundaries[-1] // block_size)
        planned = ((b - start, self.state_snapshots.reserve(hashes[b // block_size - 1])) for b in boundaries)
        return tuple((offset, slot) for offset, slot in planned if slot is not None)

    def discard_snapshots(self, output: SchedulerOutput) -> None:
        """Forget the state snapshots a failed step was to write."""
        if self.state_snapshots is not None:
            for seq in output.scheduled:
                for _, slot in seq.state_snapshots:
                    self.state_snapshots.discard(slot)

    def _stops_by_length(self, request: Request) -> bool:
        """Its tokens in flight reach max_tokens or the longest sequence: it ends when they land."""
        if not request.num_output_placeholders:
            return False
        max_tokens = request.sampling_params.max_tokens
        return ((max_tokens is not None and request.num_output_tokens + request.num_output_placeholders >= max_tokens)
                or request.num_scheduled_tokens >= self._max_sequence_len)

    def _preempt(self, request: Request) -> None:
        """Recompute later: free its blocks and put it at the front of the queue."""
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def update(self, output: SchedulerOutput,
               sampled: list[tuple[int, TokenLogprob | None] | None]) -> list[Request]:
        """Apply a step: swap placeholders for the sampled tokens, publish full blocks and
        check stops. sampled[i] belongs to output.scheduled[i] and is None for a prompt
        chunk that did not reach the end. Returns the requests that got a token (finished
        ones included); those finished here have freed their blocks. A request preempted
        since schedule() still gets its token."""
        if len(sampled) != len(output.scheduled):
            raise ValueError(f"sampled has {len(sampled)} entries for "
                             f"{len(output.scheduled)} scheduled sequences")
        updated = []
        num_finished = 0
        kv = self.kv
        running_status = RequestStatus.RUNNING
        for seq, sample in zip(output.scheduled, sampled):
            request = seq.request
            if request.status.finished:
                continue  # aborted since schedule()
            if sample is not None:
                token_id, logprob = sample
                request.num_output_placeholders -= 1
                request.output_token_ids.append(token_id)
                if logprob is not None:
                    request.output_logprobs.append(logprob)
            if request.status is running_status:
                kv.cache_full_blocks(request)
            if sample is None:
                continue
            status = self._stop_status(request, token_id)
            if status is not None:
                if request.status is running_status:
                    num_finished += 1
                else:
                    self.waiting.remove(request)
                self._finish(request, status)
            updated.append(request)
        if num_finished:
            self.running = [r for r in self.running if r.status is running_status]
        return updated

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        """Why `request` stops after sampling `token_id`, or None. eos and stop tokens
        wait for min_tokens; the length limits cannot."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if (params.max_tokens is not None and request.num_output_tokens >= params.max_tokens) \
                or request.num_tokens >= self._max_sequence_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request from outside (abort, stop string, error) and free its blocks at
        once. Unknown or already finished ids are ignored."""
        if not status.finished:
            raise ValueError(f"status must be a finished status, got {status}")
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)

    def _release(self, request: Request) -> None:
        """Free the request's blocks and its state slot."""
        self.kv.free(request)
        if self.state_slots is not None:
            self.state_slots.free(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._release(request)
        del self.requests[request.request_id]
        if request.group_id is not None and self._group_leaders.get(request.group_id) is request:
            del self._group_leaders[request.group_id]

    def check_integrity(self) -> None:
        """Raise RuntimeError unless queues, statuses, block tables and the block pool agree."""
        problems = []
        queued = self.running + list(self.waiting)
        if {r.request_id for r in queued} != set(self.requests) or len(queued) != len(self.requests):
            problems.append("running + waiting differ from the unfinished requests")
        if len(self.running) > self.max_num_seqs:
            problems.append(f"{len(self.running)} running, above max_num_seqs {self.max_num_seqs}")
        if set(self.kv.block_tables) != {r.request_id for r in self.running}:
            problems.append("block tables are held by other requests than the running ones")
        block_size = self.kv.block_size
        for request in self.running:
            table = self.kv.block_tables.get(request.request_id, [])
            if request.status is not RequestStatus.RUNNING:
                problems.append(f"running request {request.request_id!r} has status {request.status}")
            min_blocks = -(-request.num_computed_tokens // block_size)
            max_blocks = -(-request.num_scheduled_tokens // block_size)
            if not min_blocks <= len(table) <= max_blocks:
                problems.append(f"request {request.request_id!r} holds {len(table)} blocks for "
                                f"{request.num_computed_tokens}/{request.num_tokens} computed tokens")
        for request in self.waiting:
            if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                problems.append(f"waiting request {request.request_id!r} has status {request.status}")
        if problems:
            raise RuntimeError("scheduler is inconsistent: " + "; ".join(problems))
        self.kv.check_integrity()
        if self.state_slots is not None:
            self.state_slots.check_integrity(self.running)
        if self.state_snapshots is not None:
            self.state_snapshots.check_integrity()
