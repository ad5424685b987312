"""Serving benchmark for any OpenAI-compatible server, reported like `vllm bench serve`.

Sends a seeded random dataset through the streaming /v1/completions (or
/v1/chat/completions) endpoint, paced by --request-rate (Poisson, or gamma with
--burstiness) and capped by --max-concurrency, then reports TTFT, TPOT, ITL and
E2EL, throughputs and goodput under SLOs. Definitions follow vLLM's:
  TTFT  first token event minus send time
  TPOT  (E2EL - TTFT) / (output tokens - 1), per request
  ITL   gaps between successive token events, over all requests
  E2EL  last byte minus send time
Output token counts come from the server's usage chunk (stream_options.include_usage).

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 \
        --random-input-len 128 --random-output-len 64 --max-concurrency 32 --ignore-eos
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
from tokenizers import Tokenizer

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "sparkd" / "demo_model"
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestSpec:
    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    start: float = 0.0  # perf_counter at send
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # perf_counter of each token event


def random_dataset(tokenizer: Tokenizer, num: int, input_len: int, output_len: int, range_ratio: float,
                   seed: int) -> list[RequestSpec]:
    """Prompts of random non-special tokens, decoded to text; lengths drawn uniformly from
    [len * (1 - range_ratio), len * (1 + range_ratio)] as in vLLM's random dataset."""
    rng = np.random.default_rng(seed)
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    vocab = np.array(sorted(i for t, i in tokenizer.get_vocab().items() if t not in special))
    in_lens = rng.integers(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio)) + 1, num)
    out_lens = rng.integers(max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio)) + 1, num)
    specs = []
    for in_len, out_len in zip(in_lens, out_lens, strict=True):
        text = tokenizer.decode(rng.choice(vocab, max(1, int(in_len))).tolist())
        ids = tokenizer.encode(text, add_special_tokens=False).ids[: int(in_len)]  # decoding may merge tokens
        specs.append(RequestSpec(tokenizer.decode(ids), len(ids), int(out_len)))
    return specs


async def sse_lines(response: httpx.Response):
    """The body's lines, split at line feeds only: unlike str.splitlines (httpx's aiter_lines),
    this never splits an event whose JSON holds U+2028 or U+0085."""
    buffer = b""
    async for chunk in response.aiter_bytes():
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()


async def send_one(http: httpx.AsyncClient, args: argparse.Namespace, spec: RequestSpec) -> RequestResult:
    body: dict = {"model": args.model, "max_tokens": spec.output_len, "stream": True,
                  "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    result = RequestResult(prompt_len=spec.prompt_len, start=time.perf_counter())
    try:
        async with http.stream("POST", ENDPOINTS[args.endpoint], json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in sse_lines(response):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
                    result.output_len = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and "role" not in chunk["choices"][0].get("delta", {}):
                    result.token_times.append(now)
        result.latency = time.perf_counter() - result.start
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if result.token_times:
        result.ttft = result.token_times[0] - result.start
        result.itl = np.diff(result.token_times).tolist()
        result.success = True
    else:
        result.error = "no tokens received"
    return result


async def run_benchmark(args: argparse.Namespace, specs: list[RequestSpec]) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=args.max_concurrency or len(specs), max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    gate = asyncio.Semaphore(args.max_concurrency or len(specs))
    rng = np.random.default_rng(args.seed)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits, timeout=None) as http:
        probe = await send_one(http, args, RequestSpec(specs[0].prompt, specs[0].prompt_len, 4))
        if not probe.success:
            raise SystemExit(f"the test request failed: {probe.error}")

        async def limited(spec: RequestSpec) -> RequestResult:
            async with gate:
                return await send_one(http, args, spec)

        start = time.perf_counter()
        tasks = []
        for spec in specs:
            tasks.append(asyncio.create_task(limited(spec)))
            if args.request_rate != float("inf"):
                # Gamma inter-arrival times: burstiness 1 is Poisson, lower is burstier, same mean rate.
                theta = 1.0 / (args.request_rate * args.burstiness)
                await asyncio.sleep(rng.gamma(args.burstiness, theta))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def summarize(args: argparse.Namespace, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [gap for r in ok for gap in r.itl]
    e2els = [r.latency for r in ok]
    total_in, total_out = sum(r.prompt_len for r in ok), sum(r.output_len for r in ok)
    slos = dict(item.split(":") for item in args.goodput) if args.goodput else {}
    good = [r for r in ok if all(_slo_value(r, name) * 1000 <= float(limit) for name, limit in slos.items())]
    token_times = np.array(sorted(t for r in ok for t in r.token_times)) - min((r.start for r in ok), default=0)
    spans = [(r.start, r.start + r.latency) for r in ok]
    summary = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "base_url": args.base_url, "endpoint": args.endpoint,
        "model": args.model, "num_prompts": len(results), "request_rate": args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "duration": duration,
        "completed": len(ok), "failed": len(results) - len(ok), "total_input_tokens": total_in,
        "total_output_tokens": total_out, "request_throughput": len(ok) / duration,
        "request_goodput": len(good) / duration if slos else None, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": float(np.bincount(token_times.astype(int)).max()) if len(token_times) else 0.0,
        "max_concurrent_requests": _peak_overlap(spans),
        "errors": sorted({r.error for r in results if r.error}),
    }
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        ms = np.array(values) * 1000 if values else np.zeros(1)
        summary[f"mean_{name}_ms"], summary[f"median_{name}_ms"] = float(ms.mean()), float(np.median(ms))
        summary[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    summary["per_request"] = [{k: v for k, v in asdict(r).items() if k != "token_times"} for r in results]
    return summary


def _slo_value(r: RequestResult, name: str) -> float:
    if name == "ttft":
        return r.ttft
    if name == "tpot":
        return (r.latency - r.ttft) / max(1, r.output_len - 1)
    if name == "e2el":
        return r.latency
    raise SystemExit(f"--goodput: unknown metric {name!r} (use ttft, tpot or e2el)")


def _peak_overlap(spans: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def print_report(s: dict, args: argparse.Namespace) -> None:
    def row(label: str, value) -> None:
        print(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Maximum request concurrency:", s["max_concurrency"] or "unlimited")
    row("Request rate (req/s):", s["request_rate"])
    row("Benchmark duration (s):", s["duration"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    if s["request_goodput"] is not None:
        row("Request goodput (req/s):", s["request_goodput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Peak output token throughput (tok/s):", s["max_output_tokens_per_s"])
    row("Peak concurrent requests:", s["max_concurrent_requests"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name, title in titles.items():
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {name.upper()} (ms):", s[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", s[f"median_{name}_ms"])
        for p in args.metric_percentiles.split(","):
            row(f"P{float(p):g} {name.upper()} (ms):", s[f"p{float(p):g}_{name}_ms"])
    print("=" * 50)
    for error in s["errors"][:5]:
        print(f"error: {error}", file=sys.stderr)


def plot(s: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in s["per_request"] if r["success"]]
    series = {
        "TTFT (ms)": [r["ttft"] * 1000 for r in ok],
        "TPOT (ms)": [(r["latency"] - r["ttft"]) * 1000 / (r["output_len"] - 1) for r in ok if r["output_len"] > 1],
        "ITL (ms)": [g * 1000 for r in ok for g in r["itl"]],
        "E2EL (ms)": [r["latency"] * 1000 for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (label, values) in zip(axes.flat, series.items(), strict=True):
        ax.hist(values, bins=50)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    fig.suptitle(f"{s['model']}: {s['completed']} requests, {s['output_throughput']:.0f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: the demo model's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 is Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate the full output length")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", action="store_true", help="write the JSON results")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--plot", default=None, metavar="PNG", help="write latency histograms (needs matplotlib)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        args.model = httpx.get(f"{args.base_url}/v1/models", headers=headers).json()["data"][0]["id"]
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else DEMO_MODEL_DIR
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    specs = random_dataset(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                           args.random_range_ratio, args.seed)
    results, duration = asyncio.run(run_benchmark(args, specs))
    summary = summarize(args, results, duration)
    print_report(summary, args)
    if args.save_result:
        name = args.result_filename or f"bench-{summary['date']}.json"
        path = Path(args.result_dir) / name
        path.write_text(json.dumps(summary, indent=1))
        print(f"results written to {path}")
    if args.plot:
        plot(summary, Path(args.plot))


if __name__ == "__main__":
    main()
