"""The engine flags `serve` and `generate` share, named and defaulted as in vLLM."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ..engine.args import STATE_DTYPES, EngineArgs


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    defaults = EngineArgs()
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="local Hugging Face checkpoint directory (default: the embedded demo model)")
    group.add_argument("--device", choices=("auto", "cpu", "cuda"), default=defaults.device,
                       help="auto picks cuda when a GPU answers, else cpu (default: %(default)s)")
    group.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=defaults.dtype,
                       help="weight and activation dtype (default: %(default)s, from the checkpoint)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context length in tokens (default: the model's max_position_embeddings)")
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                       help="most sequences in one step (default: %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                       help="most tokens in one step (default: %(default)s)")
    group.add_argument("--block-size", type=int, default=defaults.block_size,
                       help="tokens per KV cache block (default: %(default)s)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=defaults.enable_prefix_caching, help="reuse the KV of shared prompt prefixes")
    group.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization,
                       help="fraction of GPU memory for weights and KV cache (default: %(default)s)")
    group.add_argument("--num-gpu-blocks-override", type=int, default=None,
                       help="fix the number of KV cache blocks (default: sized from memory)")
    group.add_argument("--kv-cache-memory-gb", type=float, default=defaults.kv_cache_memory_gb,
                       help="KV cache budget in GiB on the CPU backend (default: %(default)s)")
    group.add_argument("--mamba-cache-dtype", choices=STATE_DTYPES,
                       default=defaults.mamba_cache_dtype,
                       help="a hybrid model's linear-attention state dtype (default: %(default)s)")
    group.add_argument("--seed", type=int, default=defaults.seed,
                       help="seed for requests that bring none (default: %(default)s)")


def load_engine(ns: argparse.Namespace, served_model_name: str | None = None,
                progress: Callable[[str], None] | None = None):
    """The AsyncEngine the flags describe; a bad flag or model directory exits with its message.
    progress: gets one-line status messages while the model loads and warms up."""
    from ..engine.async_engine import AsyncEngine

    try:
        return AsyncEngine.from_args(engine_args_from(ns, served_model_name), progress)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"sparkd: error: {exc}") from None


def engine_args_from(ns: argparse.Namespace, served_model_name: str | None = None) -> EngineArgs:
    return EngineArgs(
        model=ns.model,
        served_model_name=served_model_name,
        device=ns.device,
        dtype=ns.dtype,
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        block_size=ns.block_size,
        enable_prefix_caching=ns.enable_prefix_caching,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        num_gpu_blocks_override=ns.num_gpu_blocks_override,
        kv_cache_memory_gb=ns.kv_cache_memory_gb,
        seed=ns.seed,
        mamba_cache_dtype=ns.mamba_cache_dtype,
    )
