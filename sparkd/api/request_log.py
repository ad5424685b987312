"""--log-requests: one log line per API request with its id, sampling params and prompt.

Prompts are the users' data, so nothing else in sparkd logs them; this line is
written only when the operator asks for it, as vLLM's --enable-log-requests does.
"""

from __future__ import annotations

import logging

from .job import Job

log = logging.getLogger("sparkd.api.requests")


def log_request(job: Job, tokenizer, max_len: int) -> None:
    """prompt: the text (chat: the rendered conversation), cut to `max_len` characters."""
    prompts = [_prompt_text(prompt, tokenizer, max_len) for prompt in job.prompts]
    shown = prompts[0] if len(prompts) == 1 else prompts
    log.info("request %s: params %s, prompt: %r", job.id, job.params, shown)


def _prompt_text(prompt: str | list[int], tokenizer, max_len: int) -> str | list[int]:
    if isinstance(prompt, list):
        if tokenizer is None:
            return prompt[:max_len]
        # Only the head is shown, so only the head is decoded: a long prompt stays cheap to log.
        prompt = tokenizer.decode(prompt[:max_len], skip_special_tokens=False)
    return prompt if len(prompt) <= max_len else prompt[:max_len] + "..."
