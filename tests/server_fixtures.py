"""A real `sparkd serve` subprocess on a tiny random checkpoint, for the API tests.

The checkpoint is a random Qwen3 saved by transformers (via the oracle) plus a
byte-level BPE tokenizer trained here with `tokenizers`, and a ChatML chat
template in tokenizer_config.json. Random weights mean garbage text: the API
tests check protocol, counts and framing, not prose.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOS_TOKEN_ID = 2
MAX_MODEL_LEN = 256
API_KEY = "sk-test-sparkd"
# The template writes the BOS itself, and the tokenizer's post-processor adds one to
# plain text (as Llama's does): a chat prompt must still hold exactly one.
CHATML_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unsupported role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_served_checkpoint(directory: Path) -> Path:
    """Tiny random Qwen3 + trained BPE tokenizer (adding a BOS) + ChatML template in `directory`."""
    from oracle import make_tiny_checkpoint  # torch + transformers: test-only

    make_tiny_checkpoint(directory, "Qwen3ForCausalLM", vocab_size=VOCAB_SIZE, bos_token_id=0,
                         eos_token_id=EOS_TOKEN_ID, max_position_embeddings=512)
    _train_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
    }))
    return directory


def _train_tokenizer():
    import argparse
    import asyncio
    import collections
    import json as json_module

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    corpus = [m.__doc__ or "" for m in (argparse, asyncio, collections, json_module, subprocess, socket)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{SPECIAL_TOKENS[0]} $A",
                                                             special_tokens=[(SPECIAL_TOKENS[0], 0)])
    assert tokenizer.get_vocab_size() <= VOCAB_SIZE
    return tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    base_url: str
    api_key: str
    process: subprocess.Popen
    log_path: Path

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http://", "ws://") + "/v1/ws"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, timeout: float | httpx.Timeout = 60) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name (labels dropped: one model, one label set)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                if "le" not in s.labels}

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Metrics once no request is running or waiting; fails after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["sparkd:num_requests_running"] == 0 and m["sparkd:num_requests_waiting"] == 0:
                return m
            assert time.monotonic() < deadline, f"server still busy: {m}"
            time.sleep(0.05)

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def log_size(self) -> int:
        """A mark in the log, for `log_since`."""
        return self.log_path.stat().st_size

    def log_since(self, mark: int) -> str:
        """What the server logged after `log_size()` returned `mark`."""
        return self.log_path.read_bytes()[mark:].decode(errors="replace")

    def stop(self) -> int:
        self.process.terminate()
        try:
            return self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def start_server(model_dir: Path, log_path: Path, *extra_args: str, api_key: str = API_KEY,
                 startup_timeout: float = 120.0) -> ServerProcess:
    """`sparkd serve` on `model_dir` (CPU, context MAX_MODEL_LEN); later flags in `extra_args` win."""
    return _launch(["--model", str(model_dir), "--max-model-len", str(MAX_MODEL_LEN), *extra_args], log_path,
                   api_key, startup_timeout)


def start_demo_server(log_path: Path, *extra_args: str, api_key: str = API_KEY,
                      startup_timeout: float = 120.0) -> ServerProcess:
    """`sparkd serve` with no model: the embedded demo model, on the CPU."""
    return _launch(list(extra_args), log_path, api_key, startup_timeout)


def _launch(serve_args: list[str], log_path: Path, api_key: str, startup_timeout: float) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "sparkd.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--api-key", api_key, "--uvicorn-log-level", "warning", *serve_args]
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log = open(log_path, "wb")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
    log.close()
    server = ServerProcess(f"http://127.0.0.1:{port}", api_key, process, log_path)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sparkd serve exited with {process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"sparkd serve did not become healthy in {startup_timeout} s:\n{server.log_tail()}")


def sse_payloads(body: bytes) -> list[str]:
    """The `data:` payloads of an SSE body in order. Events end at a blank line; unlike
    str.splitlines, this never splits an event whose JSON holds U+2028 or U+0085."""
    payloads = []
    for event in body.decode().split("\n\n"):
        data = [line[len("data:"):].removeprefix(" ") for line in event.split("\n") if line.startswith("data:")]
        if data:
            payloads.append("\n".join(data))
    return payloads


def complete_stream_chunks(payloads: list[str]) -> list[dict]:
    """The JSON chunks of a stream that ran to its end, checked: no error event, every
    choice that appeared got a finish_reason, and `[DONE]` comes last, once."""
    assert payloads and payloads[-1] == "[DONE]", f"stream did not end with [DONE]: {payloads[-3:]}"
    assert "[DONE]" not in payloads[:-1], "[DONE] before the end of the stream"
    chunks = [json.loads(p) for p in payloads[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    assert not errors, f"error event in the stream: {errors}"
    seen = {choice["index"] for c in chunks for choice in c["choices"]}
    finished = {choice["index"] for c in chunks for choice in c["choices"] if choice["finish_reason"] is not None}
    assert seen == finished, f"choices {sorted(seen - finished)} never finished"
    return chunks
