"""Admission limits: how much one request may ask for, and how many may wait.

The defaults refuse nothing beyond the engine's own ceilings except bodies over 8 MiB:
- max_waiting_requests None (an unbounded queue, as in vLLM): evaluation harnesses
  and batch jobs routinely send thousands of requests at once and expect them
  to queue. Behind a load balancer, set it so a busy replica answers 429 and the
  client goes elsewhere instead of waiting minutes. Waiting requests are counted
  as `sparkd:num_requests_waiting` counts them: one per sequence (n=4 waits as 4).
- request_timeout_s None: long generations are legitimate; a deadline is the operator's call.
  When set, a request still open that long after it arrived (queueing counts) is
  aborted, freeing its KV blocks, and answered 504 (a stream: a final error event).
  The request was valid and the client not slow, so the failure is the server's
  (5xx), and 504 is the status proxies and clients already read as a timeout;
  408 would blame the client.
- max_body_bytes 8 MiB: a 256k-token prompt is about 1 MiB as text and 2 MiB as
  JSON token ids, so this leaves room while bounding what one upload can pin.
- max_n and max_stop_strings: the engine's own ceilings (SamplingParams); a flag may lower them.
- max_stop_string_length 256 characters: far above any real stop sequence, and
  the matcher holds back up to that much streamed text while it could still match.
- max_tokens None: up to the context length. When set, an explicit larger value
  is a 400 and a request that names none gets at most this many tokens.
- log_requests False: prompts are the users' data; logs never hold them unless asked.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.sampling_params import MAX_N, MAX_STOP_STRINGS
from .errors import bad_request


@dataclass(frozen=True)
class ServerLimits:
    max_waiting_requests: int | None = None
    request_timeout_s: float | None = None
    max_body_bytes: int = 8 * 2**20
    max_n: int = MAX_N
    max_tokens: int | None = None
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_length: int = 256
    log_requests: bool = False
    max_log_len: int = 500  # characters (or token ids) of a prompt in a --log-requests line

    def __post_init__(self) -> None:
        _check_int("max_waiting_requests", self.max_waiting_requests, 1, optional=True)
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        _check_int("max_body_bytes", self.max_body_bytes, 1)
        _check_int("max_n", self.max_n, 1, MAX_N)
        _check_int("max_tokens", self.max_tokens, 1, optional=True)
        _check_int("max_stop_strings", self.max_stop_strings, 0, MAX_STOP_STRINGS)
        _check_int("max_stop_string_length", self.max_stop_string_length, 1)
        _check_int("max_log_len", self.max_log_len, 0)

    def check_sampling(self, *, n: int, max_tokens: int | None, max_tokens_field: str, min_tokens: int,
                       stop: str | list[str] | None) -> None:
        """Raise a 400 naming the field for a request over a limit (types are already checked)."""
        if n > self.max_n:
            raise bad_request(f"n must be at most {self.max_n} on this server, got {n}", "n")
        if self.max_tokens is not None:
            if max_tokens is not None and max_tokens > self.max_tokens:
                raise bad_request(f"{max_tokens_field} must be at most {self.max_tokens} on this server, "
                                  f"got {max_tokens}", max_tokens_field)
            if max_tokens is None and min_tokens > self.max_tokens:
                raise bad_request(f"min_tokens must be at most {self.max_tokens} on this server, got {min_tokens}",
                                  "min_tokens")
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > self.max_stop_strings:
            raise bad_request(f"stop may hold at most {self.max_stop_strings} strings on this server, "
                              f"got {len(stops)}", "stop")
        longest = max(map(len, stops), default=0)
        if longest > self.max_stop_string_length:
            raise bad_request(f"each stop string must be at most {self.max_stop_string_length} characters "
                              f"on this server, got one of {longest}", "stop")

    def default_max_tokens(self, prompt_len: int, max_model_len: int, min_tokens: int) -> int | None:
        """max_tokens for a request that names none: None (up to the context) without a
        limit, else the limit or the room the prompt leaves, whichever is smaller."""
        if self.max_tokens is None:
            return None
        return max(1, min_tokens, min(self.max_tokens, max_model_len - prompt_len))


def _check_int(name: str, value: int | None, low: int, high: int | None = None, *,
                    optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        rule = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
        raise ValueError(f"{name} must be {rule}, got {value!r}")
