"""bf16 on the trained demo model: sparkd's CUDA backend in bf16 against the numpy backend's fp32
reference, teacher-forced, on text like its training text (Python's pydoc topics).

The demo model is a trained Qwen3-Next hybrid (gated delta nets, gated attention, experts). Trained
weights give decided logits, which random tiny hybrids do not (their bf16 test is xfail in
test_engine_cuda.py: transformers' own bf16 agrees at 0.949 there); on these positions
transformers' bf16 agreed with its fp32 at 1.0 (CPU, 2026-12-01), so the issue's 0.99 bar is a
fair one for sparkd.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.engine.llm_engine import DEMO_MODEL_DIR

from .test_engine_cuda import BF16_MIN_TOP1_AGREEMENT, DECODE_LEN, NUM_SEQS, PREFILL_LEN, teacher_forced_logits

pytestmark = pytest.mark.gpu


def topic_sequences(num_seqs: int, length: int) -> list[list[int]]:
    """The first `length` tokens of each of the first `num_seqs` pydoc topics that have that many."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    sequences = []
    for text in sorted(set(topics.values())):
        ids = tokenizer.encode(text).ids
        if len(ids) >= length:
            sequences.append(ids[:length])
        if len(sequences) == num_seqs:
            return sequences
    raise AssertionError(f"fewer than {num_seqs} pydoc topics of {length} tokens")


def test_bf16_teacher_forced_top1_on_the_trained_demo_hybrid(cuda_ops_factory):
    """sparkd in bf16 must pick the fp32 reference's top-1 at >= 99% of the prefill and decode
    positions; transformers' bf16 agreement with the same reference is printed beside it."""
    import torch
    import transformers

    from sparkd.backend.cpu.ops import NumpyOps
    from sparkd.models.registry import load_model

    sequences = topic_sequences(NUM_SEQS, PREFILL_LEN + DECODE_LEN)
    reference = teacher_forced_logits(load_model(DEMO_MODEL_DIR, NumpyOps()), sequences).argmax(axis=-1)
    bf16 = teacher_forced_logits(load_model(DEMO_MODEL_DIR, cuda_ops_factory("bfloat16")), sequences).argmax(axis=-1)
    peer = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        peer_top1 = peer(torch.tensor(sequences)).logits[:, :-1].float().argmax(-1).numpy()
    matches = bf16 == reference
    print(f"demo model bf16 top-1 agreement with fp32: sparkd {matches.mean():.4f} (decode steps "
          f"{matches[:, PREFILL_LEN:].mean():.4f}), transformers {(peer_top1 == reference).mean():.4f}")
    assert matches.mean() >= BF16_MIN_TOP1_AGREEMENT
