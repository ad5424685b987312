"""Render a model's jinja2 chat template as transformers' `apply_chat_template` does.

Same environment (sandboxed, trim_blocks + lstrip_blocks, loop controls, the
`{% generation %}` tag), the same helpers (`raise_exception`, `strftime_now`, a
`tojson` that keeps non-ASCII and HTML characters), and the same variables
(`messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens such
as `bos_token`, plus caller keyword arguments such as `enable_thinking`).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may arrive under; templates read `reasoning_content`
# (gpt-oss ones read `thinking`), so every name is filled, as transformers does.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateRaised(jinja2.TemplateError):
    """The template called `raise_exception(message)`: the conversation is invalid for this model."""


class ChatTemplate:
    """A compiled chat template, or several named ones (HF's list form) of which
    "tool_use" is chosen when tools are given and "default" otherwise."""

    def __init__(self, source: str | dict[str, str], special_tokens: dict[str, str]):
        """special_tokens: {"bos_token": "<s>", "eos_token": "</s>", ...}, visible to the template."""
        self.source = source
        self.special_tokens = special_tokens

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text. Raises ValueError for invalid messages or a template error."""
        if not messages:
            raise ValueError("messages must hold at least one message")
        if not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of dicts with 'role' and 'content'")
        try:
            return _compile(self._pick_source(tools)).render(
                messages=[_normalize_message(m) for m in messages],
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except TemplateRaised as error:
            raise ValueError(str(error)) from None
        except jinja2.TemplateError as error:
            raise ValueError(f"chat template error: {error}") from None

    def _pick_source(self, tools: list[dict[str, Any]] | None) -> str:
        if isinstance(self.source, str):
            return self.source
        if tools and "tool_use" in self.source:
            return self.source["tool_use"]
        if "default" in self.source:
            return self.source["default"]
        raise ValueError(f"the tokenizer has several chat templates ({', '.join(self.source)}) and none named 'default'")


def _normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """Drop None-valued keys (OpenAI clients send `content: null` next to tool calls,
    which templates would print as "None") and alias the reasoning fields."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training
    masks; rendering keeps the body as it is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
