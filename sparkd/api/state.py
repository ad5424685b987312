"""What every route needs: the engine, the metrics, the names the model answers to,
the admission limits, and whether the server is draining for shutdown."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..engine.async_engine import AsyncEngine
from .errors import APIError, engine_dead, queue_full, shutting_down
from .limits import ServerLimits
from .metrics import ServerMetrics


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_names: list[str]
    metrics: ServerMetrics
    limits: ServerLimits = field(default_factory=ServerLimits)
    started: int = field(default_factory=lambda: int(time.time()))
    # Set on SIGTERM: requests in flight finish, new ones get 503 and /health fails.
    draining: bool = False

    def admit(self) -> None:
        """Raise the error a new generation request gets now, if any: 503 while draining
        or once the engine has died, 429 while the waiting queue is full. Call it right
        before queueing the request, so nothing slips in after the drain began."""
        if self.draining:
            raise shutting_down()
        if self.engine.is_dead:
            raise engine_dead(self.engine.dead_reason)
        limit = self.limits.max_waiting_requests
        if limit is not None and self.engine.stats().num_waiting >= limit:
            raise queue_full(limit)

    def resolve_model(self, requested: str | None) -> str:
        """The name to echo back; an unknown name is a 404 as in OpenAI and vLLM."""
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise APIError(404, f"The model `{requested}` does not exist.", "model", "model_not_found")
        return requested

    def token_text(self, token_id: int) -> str:
        """A token as text for logprobs; a byte fragment of a longer character decodes to U+FFFD."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return f"token_id:{token_id}"
        return tokenizer.decode([token_id], skip_special_tokens=False)
