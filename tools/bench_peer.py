"""The peer beside sparkd's decode benchmarks (bench_decode.py, bench_moe.py): HF transformers'
generate with the static cache, batch 1, in the same process, and the rows that compare it
with sparkd's served rate.
"""

from __future__ import annotations

import time

from bench_common import verdict

PEER_REPS = 3  # runs of the peer after its warm-up, the best taken


def transformers_decode(hf_config: dict, model_type: str, num_layers: int, prompt_len: int, new_tokens: int,
                        compile: bool = True, reps: int = PEER_REPS, device: str = "cuda",
                        cache_implementation: str | None = "static") -> tuple[float, float] | None:
    """(tokens/s of generate, decode-only tokens/s with the prompt's forward taken out) for
    batch 1 after a prompt_len-token prompt, static cache (compiled by generate unless `compile` is
    False; cache_implementation None: the model's default cache, for hybrid models, whose state the
    static cache does not hold); each the best of `reps` runs after a warm-up (which compiles), as sparkd's own
    figures are best-ofs: a single run of the peer moved between 112.6 and 142.4 tok/s from
    call to call (docs/benchmarks.md). None without torch, transformers or a CUDA torch
    (device "cpu" checks the arithmetic of this function on a tiny config)."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    if device == "cuda" and not torch.cuda.is_available():
        return None
    hf = {k: v for k, v in hf_config.items() if k != "architectures"}
    config = transformers.AutoConfig.for_model(model_type, **{**hf, "num_hidden_layers": num_layers})
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    prompt = torch.randint(0, config.vocab_size, (1, prompt_len), device=device)
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
              "pad_token_id": config.eos_token_id, "disable_compile": not compile}
    if cache_implementation is not None:
        kwargs["cache_implementation"] = cache_implementation
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def best_of(work) -> float:
        work()  # the first generate compiles the decode step
        times = []
        for _ in range(reps):
            synchronize()
            start = time.perf_counter()
            work()
            synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.no_grad():
        total = best_of(lambda: model.generate(prompt, **kwargs))
        prompt_forward = best_of(lambda: model(prompt))
    return new_tokens / total, (new_tokens - 1) / (total - prompt_forward)


def print_peer(peer: tuple[float, float] | None, how: str, prompt_len: int, new_tokens: int,
               served_tokens_per_s: float, target: float | None) -> None:
    """The transformers rows beside sparkd's batch-1 served rate (`peer` from transformers_decode)."""
    if peer is None:
        print("\n# transformers baseline skipped (--no-transformers, or no CUDA torch)")
        return
    generate_tokens_per_s, decode_tokens_per_s = peer
    print(f"\n| transformers, {how}, batch 1 | tok/s | sparkd served / it | target |")
    print("| --- | --- | --- | --- |")
    print(f"| generate: {prompt_len}-token prompt + {new_tokens} new tokens | {generate_tokens_per_s:.1f} | "
          f"{served_tokens_per_s / generate_tokens_per_s:.2f} | |")
    ratio = served_tokens_per_s / decode_tokens_per_s
    print(f"| decode only (the prompt's forward taken out) | {decode_tokens_per_s:.1f} | {ratio:.2f} | "
          f"{verdict(ratio, target) if target else ''} |")
