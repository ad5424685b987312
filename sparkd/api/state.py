"""What every route needs: the engine, the metrics and the names the model answers to."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..engine.async_engine import AsyncEngine
from .errors import APIError
from .metrics import ServerMetrics


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_names: list[str]
    metrics: ServerMetrics
    started: int = field(default_factory=lambda: int(time.time()))

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
