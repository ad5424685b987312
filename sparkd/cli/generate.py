"""`sparkd generate`: stream one completion to the terminal, no server involved."""

from __future__ import annotations

import argparse
import sys
import time

import uvloop

from ..engine.sampling_params import SamplingParams
from .engine_flags import add_engine_flags, load_engine


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="stream a completion of PROMPT to the terminal",
                                   description="Stream a completion of PROMPT to the terminal "
                                               "(with no --model: the embedded demo model).")
    parser.add_argument("prompt", help="the prompt text ('-' reads it from standard input)")
    parser.add_argument("--chat", action="store_true",
                        help="send PROMPT as a user message through the model's chat template")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=128, help="(default: %(default)s)")
    sampling.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: %(default)s)")
    sampling.add_argument("--top-p", type=float, default=0.95, help="(default: %(default)s)")
    sampling.add_argument("--top-k", type=int, default=0, help="0 disables (default: %(default)s)")
    add_engine_flags(parser)
    parser.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if ns.prompt == "-" else ns.prompt
    try:
        params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                                top_k=ns.top_k)
    except ValueError as exc:
        raise SystemExit(f"sparkd: error: {exc}") from None
    engine = load_engine(ns)
    return uvloop.run(_generate(engine, prompt, params, ns.chat))


async def _generate(engine, prompt: str | list[int], params: SamplingParams, chat: bool) -> int:
    await engine.start()
    try:
        if chat:
            text = engine.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
            prompt = engine.tokenizer.encode(text, add_special_tokens=False)  # the template wrote any BOS
        start = time.perf_counter()
        first_token_at = None
        stream = engine.add_request(prompt, params)
        async for out in stream:
            seq = out.outputs[0]
            if seq.num_new_tokens and first_token_at is None:
                first_token_at = time.perf_counter()
            sys.stdout.write(seq.text_delta)
            sys.stdout.flush()
        elapsed = time.perf_counter() - start
        sys.stdout.write("\n")
    except ValueError as exc:  # RequestError, or a chat template that rejects the prompt
        print(f"sparkd: error: {exc}", file=sys.stderr)
        return 2
    finally:
        await engine.shutdown()
    if out.error is not None:
        print(f"sparkd: error: {out.error}", file=sys.stderr)
        return 1
    num_tokens = len(seq.token_ids)
    ttft = (first_token_at or start) - start
    print(f"[{num_tokens} tokens in {elapsed:.2f} s, {num_tokens / elapsed:.1f} tok/s, "
          f"first token after {ttft * 1000:.0f} ms, finish_reason={seq.finish_reason}]", file=sys.stderr)
    return 0
