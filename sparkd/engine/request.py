"""Per-request state shared by the scheduler, the model runner and the output path."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .outputs import TokenLogprob
from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        # Identity tests: read for every sequence every step, and `.value` is slow on enums.
        return self in _FINISHED_STATUSES


_FINISHED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                      RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass(eq=False)
class Request:
    """One sequence being generated (a request with n > 1 becomes n of these).

    Tokens are `prompt_token_ids + output_token_ids`, then
    `num_output_placeholders` tokens that a step in flight is drawing and whose ids
    the host does not know yet (the next step reads them on the device). The first
    `num_computed_tokens` of all these have K/V in the cache, or will once the
    steps already enqueued have run.
    `seed` is the resolved Philox key (the user's seed, or a random one).
    `block_hashes` are the chained prefix-cache hashes of its full blocks, kept
    across preemption so a resumed request finds its own blocks again.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    # n > 1: siblings share `group_id`; sample index within the group.
    group_id: str | None = None
    sample_index: int = 0
    # Mixed into every block hash: requests that differ here never share KV (e.g. a LoRA id).
    block_hash_extra_keys: tuple = ()
    block_hashes: list[bytes] = field(default_factory=list)
    # Hybrid models: its slot in the linear-attention state pool while it runs (StateSlotPool).
    state_slot: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """num_tokens plus the placeholders: the length once the steps in flight land."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
