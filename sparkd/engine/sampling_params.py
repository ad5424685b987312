"""Per-request sampling parameters, named and validated as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

# Hard limits that keep one request from exhausting the server.
MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOP_STRINGS = 16


@dataclass
class SamplingParams:
    """How to draw tokens for one request.

    temperature 0 is greedy. top_k 0 (or -1) disables top-k. seed=None draws a
    fresh seed per request; with a seed, output depends only on the request.
    logprobs=None returns none; logprobs=k returns the sampled token's logprob
    and the k most likely alternatives (k may be 0).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""

        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")

        check(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"an integer in [1, {MAX_N}]")
        check(is_num(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature", "a number in [0, 100]")
        check(is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "a number in (0, 1]")
        check(is_int(self.top_k) and self.top_k >= 0, "top_k", "-1, 0 or a positive integer")
        check(is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "a number in [0, 1]")
        check(self.seed is None or is_int(self.seed), "seed", "an integer")
        check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens", "a positive integer")
        check(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "a non-negative integer")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens", "at most max_tokens")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings")
        check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings")
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "a list of token ids")
        check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
              "logprobs", f"an integer in [0, {MAX_LOGPROBS}]")
        check(is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
              "repetition_penalty", "a number in (0, 10]")
        check(is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "a number in [-2, 2]")
        check(is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "a number in [-2, 2]")
