"""Scheduler results -> RequestOutputs: text deltas, stop strings, logprobs, n > 1 grouping.

The engine registers each user request with its sequences (n of them, sharing a
`group_id`). After every step it passes the sequences that got new tokens to
`process`, sends the returned RequestOutputs to the requests' streams, and
finishes in the scheduler every sequence reported as stopped by a stop string.

Each RequestOutput is a snapshot of all n completions. Completions that got no
tokens in this step carry `num_new_tokens == 0` and an empty `text_delta`, so a
streaming consumer forwards only the ones with new tokens. A snapshot's token_ids
and logprobs are `PrefixView`s of lists that only grow: copying them every step
would cost O(output length) per sequence per step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from .detokenizer import Decoder, IncrementalDetokenizer
from .outputs import CompletionOutput, RequestOutput, TokenLogprob
from .request import Request, RequestStatus
from .sampling_params import SamplingParams
from .stop_strings import StopStringMatcher


class PrefixView(Sequence):
    """The first `length` items of a list that only ever grows: read-only, and fixed
    although the list goes on growing, like a copy that costs O(1) to take.
    Indexing and slicing behave as on a list; equal to a list or tuple of the same items."""

    __slots__ = ("_items", "_length")

    def __init__(self, items: list, length: int):
        self._items = items
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            positions = range(self._length)[index]  # resolved within the prefix, never past it
            if positions.step == 1:
                return self._items[positions.start : positions.stop]
            return [self._items[i] for i in positions]
        if not -self._length <= index < self._length:
            raise IndexError("PrefixView index out of range")
        return self._items[index % self._length]

    def __iter__(self):
        return itertools.islice(self._items, self._length)

    def __eq__(self, other) -> bool:
        if not isinstance(other, (list, tuple, PrefixView)):
            return NotImplemented
        return len(other) == self._length and all(a == b for a, b in zip(self, other))

    __hash__ = None  # mutable underneath, like the list it stands for

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass(eq=False)
class _SequenceState:
    """Output-side state of one sequence (one of a request's n samples)."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    stop_matcher: StopStringMatcher
    text: str = ""
    num_tokens: int = 0  # output tokens already turned into text
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def advance(self, request: Request) -> tuple[str, int, str | None]:
        """Take in this step's new tokens -> (text delta, number of new tokens,
        the stop string that ended the sequence or None)."""
        self.request = request
        new_ids = request.output_token_ids[self.num_tokens:]
        self.num_tokens += len(new_ids)
        if self.logprobs is not None:
            self.logprobs.extend(request.output_logprobs[len(self.logprobs):])
        finished = request.status.finished
        delta = self._decode(request, new_ids, finished)
        stop = None
        if self.num_tokens < request.sampling_params.min_tokens:
            delta = self.stop_matcher.feed_unchecked(delta)  # as vLLM: no stop strings before min_tokens
        else:
            delta, stop = self.stop_matcher.feed(delta)
        if stop is not None:
            self.finish_reason, self.stop_reason = RequestStatus.FINISHED_STOPPED.value, stop
        elif finished:
            delta += self.stop_matcher.flush()
            self.finish_reason, self.stop_reason = request.status.value, request.stop_reason
        self.text += delta
        return delta, len(new_ids), stop

    def _decode(self, request: Request, new_ids: list[int], finished: bool) -> str:
        """Text of the new tokens; a stop token's own text is left out unless asked for."""
        if self.detokenizer is None:
            return ""
        if finished and self._stopped_by_token(request) and not request.sampling_params.include_stop_str_in_output:
            new_ids = new_ids[:-1]
        delta = self.detokenizer.feed(new_ids)
        return delta + self.detokenizer.flush() if finished else delta

    @staticmethod
    def _stopped_by_token(request: Request) -> bool:
        if request.status is not RequestStatus.FINISHED_STOPPED or not request.output_token_ids:
            return False
        last = request.output_token_ids[-1]
        params = request.sampling_params
        return last in params.stop_token_ids or (not params.ignore_eos and last in request.eos_token_ids)

    def completion(self, index: int, delta: str = "", num_new_tokens: int = 0) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=self.text,
            token_ids=PrefixView(self.request.output_token_ids, self.num_tokens),
            logprobs=None if self.logprobs is None else PrefixView(self.logprobs, len(self.logprobs)),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            text_delta=delta,
            num_new_tokens=num_new_tokens,
        )


@dataclass(eq=False)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_SequenceState] = field(default_factory=list)  # by sample_index
    error: str | None = None

    def snapshot(self, deltas: dict[int, tuple[str, int]]) -> RequestOutput:
        """deltas: sample_index -> (text delta, new tokens) of this step."""
        outputs = [seq.completion(i, *deltas.get(i, ("", 0))) for i, seq in enumerate(self.sequences)]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=all(out.finish_reason is not None for out in outputs),
            num_cached_tokens=self.sequences[0].request.num_cached_tokens,
            error=self.error,
        )


class OutputProcessor:
    """Turns per-sequence progress into per-request outputs. `tokenizer` is None
    for checkpoints without one: text then stays empty."""

    def __init__(self, tokenizer: Decoder | None) -> None:
        self._tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._sequence_owner: dict[str, tuple[_RequestState, int]] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
        params: SamplingParams, sequences: Sequence[Request],
    ) -> None:
        """Register a request and its sequences (ordered by sample_index)."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.stop and self._tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none; use stop_token_ids")
        state = _RequestState(request_id, prompt, prompt_token_ids)
        for index, request in enumerate(sequences):
            detokenizer = None
            if self._tokenizer is not None:
                detokenizer = IncrementalDetokenizer(self._tokenizer, params.skip_special_tokens)
            state.sequences.append(_SequenceState(
                request=request,
                detokenizer=detokenizer,
                stop_matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output),
                logprobs=None if params.logprobs is None else [],
            ))
            self._sequence_owner[request.request_id] = (state, index)
        self._requests[request_id] = state

    def process(self, updated: Sequence[Request]) -> tuple[list[RequestOutput], list[tuple[str, str]], list[str]]:
        """Sequences that got tokens this step (finished ones included) ->
        (one RequestOutput per affected request,
         [(sequence request_id, stop string)] for sequences a stop string ended,
         [sequence request_id] of requests that failed here, ended with an error output).
        The scheduler must finish the sequences of the last two lists."""
        deltas: dict[_RequestState, dict[int, tuple[str, int]]] = {}
        stopped: list[tuple[str, str]] = []
        failed: list[_RequestState] = []
        for request in updated:
            owner = self._sequence_owner.get(request.request_id)
            if owner is None:
                continue  # aborted or failed meanwhile
            state, index = owner
            seq = state.sequences[index]
            if seq.finish_reason is not None:
                continue  # a stop string ended it; the scheduler has not caught up yet
            try:
                delta, num_new_tokens, stop = seq.advance(request)
            except Exception as exc:  # one request's output failing must not stop the others
                failed.append(state)
                deltas.pop(state, None)
                self._end(state.request_id, "error", f"output processing failed: {type(exc).__name__}: {exc}")
                continue
            deltas.setdefault(state, {})[index] = (delta, num_new_tokens)
            if stop is not None:
                stopped.append((request.request_id, stop))
        outputs = []
        for state, step_deltas in deltas.items():
            output = state.snapshot(step_deltas)
            outputs.append(output)
            if output.finished:
                self._forget(state)
        outputs += [state.snapshot({}) for state in failed]
        failed_ids = [seq.request.request_id for state in failed for seq in state.sequences]
        return outputs, stopped, failed_ids

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now -> its final output ("abort"), or None if it is
        unknown or already finished."""
        return self._end(request_id, "abort", None)

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """End a request with an error -> its final output ("error", `message`),
        or None if it is unknown or already finished."""
        return self._end(request_id, "error", message)

    def _end(self, request_id: str, finish_reason: str, error: str | None) -> RequestOutput | None:
        state = self._requests.get(request_id)
        if state is None:
            return None
        state.error = error
        for seq in state.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = finish_reason
        self._forget(state)
        return state.snapshot({})

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def _forget(self, state: _RequestState) -> None:
        del self._requests[state.request_id]
        for seq in state.sequences:
            self._sequence_owner.pop(seq.request.request_id, None)
