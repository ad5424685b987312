"""Engine configuration: the knobs `sparkd serve` and `LLM(...)` expose, named as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass

STATE_DTYPES = ("float32", "bfloat16", "float16")  # what --mamba-cache-dtype takes


@dataclass
class EngineArgs:
    """model: a local HF checkpoint directory (None = the embedded demo model).
    num_gpu_blocks_override: fix the KV pool size in blocks (tests, tuning).
    kv_cache_memory_gb: CPU backend KV pool budget when no override is given.
    capture_graphs_at_startup: capture every decode graph before serving (False:
      each at its first use, so a capture failure fails the request that hit it).
    mamba_cache_dtype: what a hybrid model's linear-attention state (conv windows and recurrent
      state) is held in: float32 (default), bfloat16 or float16; computed in float32 either way.
    """

    model: str | None = None
    served_model_name: str | None = None
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_gb: float = 2.0
    seed: int = 0
    capture_graphs_at_startup: bool = True
    mamba_cache_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.mamba_cache_dtype not in STATE_DTYPES:
            raise ValueError(f"mamba_cache_dtype must be one of {', '.join(STATE_DTYPES)}, got {self.mamba_cache_dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
