"""A validated API request, ready for the engine: prompts, sampling and how to format the results."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import msgspec

from ..engine.outputs import CompletionOutput, RequestOutput
from ..engine.sampling_params import SamplingParams
from .responses import UsageInfo


class ChunkFormat(Protocol):
    """The wire shape of one route: completions and chat each implement it."""

    id: str

    def opening_chunks(self, num_choices: int) -> list[msgspec.Struct]:
        """Chunks sent before any token (chat announces the assistant role)."""

    def chunk(self, index: int, seq: CompletionOutput) -> msgspec.Struct:
        """The chunk for what `seq` added in its latest update; `index` is the choice index."""

    def usage_chunk(self, usage: UsageInfo) -> msgspec.Struct:
        """The final chunk of a stream that asked for `stream_options.include_usage`."""

    def response(self, outputs: list[RequestOutput], n: int, usage: UsageInfo) -> msgspec.Struct:
        """The non-streaming body from each prompt's final output."""


@dataclass
class Job:
    id: str
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    fmt: ChunkFormat
