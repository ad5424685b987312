"""CPU (numpy backend) decode throughput of a ~10M-parameter Qwen3-shaped model.

    python tools/bench_cpu_decode.py [--batch 1 32] [--new-tokens 64]

Random weights are written to a temporary checkpoint (no torch needed). Decode
tokens/s counts only steps after every sequence has its first token, so prompt
processing is excluded. The ratio printed is against the FLOP-free floor of this
machine: streaming every weight once per step at the measured numpy copy rate.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from sparkd import SamplingParams
from sparkd.engine.args import EngineArgs
from sparkd.engine.llm_engine import LLMEngine

CONFIG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=8192, hidden_size=384,
              intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
              head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1e6,
              tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, dtype="float32")


def write_checkpoint(directory: Path, seed: int = 0) -> int:
    """Random Qwen3 weights in HF names; returns the parameter count."""
    rng = np.random.default_rng(seed)
    c = CONFIG
    h, d, kv, q = c["hidden_size"], c["head_dim"], c["num_key_value_heads"], c["num_attention_heads"]

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(c["vocab_size"], h), "model.norm.weight": np.ones(h, np.float32)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(q * d, h), p + "self_attn.k_proj.weight": w(kv * d, h),
            p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.o_proj.weight": w(h, q * d),
            p + "self_attn.q_norm.weight": np.ones(d, np.float32), p + "self_attn.k_norm.weight": np.ones(d, np.float32),
            p + "mlp.gate_proj.weight": w(c["intermediate_size"], h), p + "mlp.up_proj.weight": w(c["intermediate_size"], h),
            p + "mlp.down_proj.weight": w(h, c["intermediate_size"]),
            p + "input_layernorm.weight": np.ones(h, np.float32), p + "post_attention_layernorm.weight": np.ones(h, np.float32),
        })
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return sum(t.size for t in tensors.values())


def decode_tokens_per_second(engine: LLMEngine, batch: int, new_tokens: int, prompt_len: int) -> float:
    rng = np.random.default_rng(batch)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(rng.integers(2, CONFIG["vocab_size"], prompt_len).tolist(), params)
    while any(r.num_output_tokens == 0 for r in list(engine.scheduler.requests.values())):
        engine.step()
    produced = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        produced += sum(c.num_new_tokens for out in engine.step() for c in out.outputs)
    return produced / (time.perf_counter() - start)


def copy_rate(nbytes: int) -> float:
    """numpy copy bandwidth (bytes read + written per second) on this machine."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        num_params = write_checkpoint(Path(tmp))
        engine = LLMEngine(EngineArgs(model=tmp, device="cpu", max_num_seqs=max(args.batch), num_gpu_blocks_override=1024))
        weight_bytes = 4 * num_params
        floor_tps = copy_rate(weight_bytes) / weight_bytes  # steps/s if a step only streamed the weights once
        print(f"# {num_params / 1e6:.1f}M parameters, float32 numpy backend; weight-streaming floor "
              f"{floor_tps:.0f} steps/s")
        print("| batch | decode tokens/s | steps/s | fraction of floor |")
        print("| --- | --- | --- | --- |")
        for batch in args.batch:
            tps = decode_tokens_per_second(engine, batch, args.new_tokens, args.prompt_len)
            print(f"| {batch} | {tps:.0f} | {tps / batch:.0f} | {tps / batch / floor_tps:.2f} |")


if __name__ == "__main__":
    main()
