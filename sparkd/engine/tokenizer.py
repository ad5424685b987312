"""The model's tokenizer: `tokenizer.json` through the `tokenizers` library, plus the
special tokens and chat template of `tokenizer_config.json` (and `chat_template.jinja`).

Ids match transformers' fast tokenizer for the same directory: as in transformers 5,
`tokenizer.json`'s post-processor alone decides which special tokens `encode` adds
(tokenizer_config's add_bos_token / add_eos_token are ignored when it exists).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from .chat_template import ChatTemplate

# The named special tokens transformers exposes to chat templates.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str],
        extra_special_tokens: Sequence[str] = (),
        chat_template: str | dict[str, str] | None = None,
    ):
        """special_tokens: named ones, e.g. {"eos_token": "<|im_end|>"};
        extra_special_tokens: further tokens to treat as special (HF additional_special_tokens)."""
        self.backend = backend
        self.special_tokens = special_tokens
        self.chat_template = ChatTemplate(chat_template, special_tokens) if chat_template else None
        special = [self.backend.token_to_id(t) for t in [*special_tokens.values(), *extra_special_tokens]]
        special += [i for i, token in backend.get_added_tokens_decoder().items() if token.special]
        self.all_special_ids = sorted({i for i in special if i is not None})

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        backend = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        special_tokens = {name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name)}
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        if isinstance(extra, dict):  # transformers 5 may name them: {"image_token": "<image>"}
            extra = list(extra.values())
        return cls(backend, special_tokens, [_token_text(t) for t in extra], _read_chat_template(model_dir, config))

    # ---- ids <-> text ----
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    @property
    def vocab_size(self) -> int:
        """Base vocabulary plus added tokens (HF `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    # ---- chat ----
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """The rendered prompt text, or with tokenize=True its ids. The template already
        writes the special tokens it wants, so tokenizing adds none (as in transformers).
        Raises ValueError when the model has no template or the template rejects the messages."""
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat_template; send a plain prompt instead")
        text = self.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, documents=documents, **kwargs
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The directory's tokenizer, or None when it has no `tokenizer.json`."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_dir(model_dir)


def _token_text(token: str | dict[str, Any]) -> str:
    """tokenizer_config stores a token as its text or as a serialized AddedToken."""
    return token["content"] if isinstance(token, dict) else token


def _read_chat_template(model_dir: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """`chat_template.jinja` (transformers 5 saves it there) or tokenizer_config's
    `chat_template`, a string or a list of {"name", "template"}."""
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return template
