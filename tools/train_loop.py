"""What the trainers in tools/ share (train_demo_model.py, train_tiny_mixtral.py): their training
options, seeding, the token stream and its windows, the AdamW loop, and small file and machine
helpers. Dev-only: needs torch and transformers (the `test` extra)."""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import PreTrainedModel

TRAINING_COUNTS = ("steps", "batch_size", "seq_len", "warmup_steps", "threads")


def add_training_arguments(parser: argparse.ArgumentParser, steps: int, seq_len: int) -> None:
    """The options `train` reads (tools/train_tiny_mixtral.py's too), with these defaults."""
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps (a fixed count, for reproducibility)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")


def parse_positive(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> argparse.Namespace:
    args = parser.parse_args()
    for name in names:
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def seed_torch(args: argparse.Namespace) -> None:
    """args.threads CPU threads, args.seed, deterministic kernels: a rerun writes the same weights."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)


def token_stream(documents: list[str], tokenizer: Tokenizer, end_of_text: int) -> tuple[np.ndarray, np.ndarray]:
    """All documents as one int64 token array, each followed by the end_of_text id; and where each starts."""
    ids = [encoding.ids + [end_of_text] for encoding in tokenizer.encode_batch(documents)]
    lengths = np.array([len(doc) for doc in ids])
    return np.fromiter((i for doc in ids for i in doc), dtype=np.int64), np.cumsum(lengths) - lengths


def window_starts(rng: np.random.Generator, doc_starts: np.ndarray, num_tokens: int, args: argparse.Namespace) -> np.ndarray:
    """[batch_size] window offsets: half at a random token, half at a document's first token.

    Prompts arrive at position 0 with nothing before them; windows that also start a document
    teach the model that case, which random offsets (almost always mid-document) never show."""
    last = num_tokens - args.seq_len - 1
    anywhere = rng.integers(0, last, args.batch_size)
    at_document = rng.choice(doc_starts[doc_starts < last], args.batch_size)
    return np.where(rng.random(args.batch_size) < 0.5, anywhere, at_document)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(model: PreTrainedModel, stream: np.ndarray, doc_starts: np.ndarray, args: argparse.Namespace,
          bf16_autocast: bool = True) -> list[float]:
    """args.steps AdamW steps on windows of the stream; returns the loss of every step (with an
    MoE's router balance loss where its config asks for one: output_router_logits)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    rng = np.random.default_rng(args.seed)
    offsets = np.arange(args.seq_len + 1)
    losses, start = [], time.time()
    for step in range(args.steps):
        windows = torch.from_numpy(stream[window_starts(rng, doc_starts, len(stream), args)[:, None] + offsets])
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        # bf16 matmuls with fp32 master weights: about 1.4x faster on AVX512-BF16 CPUs.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
            outputs = model(input_ids=windows[:, :-1])
        loss = torch.nn.functional.cross_entropy(outputs.logits.float().flatten(0, 1), windows[:, 1:].flatten())
        if getattr(outputs, "aux_loss", None) is not None:
            loss = loss + model.config.router_aux_loss_coef * outputs.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {np.mean(losses[-25:]):.3f}  lr {learning_rate(step, args):.2e}  "
                  f"{time.time() - start:6.0f}s", flush=True)
    return losses


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), flags=re.M) if cpuinfo.exists() else []
    return names[0] if names else platform.processor() or platform.machine()
