"""Shared pieces of the device sampling tests (test_sampling*.py): LLM-like logits, neutral
parameters, and one draw on the device beside the numpy sampler's."""

from __future__ import annotations

import numpy as np

from sparkd.backend.base import SamplingTensors
from sparkd.backend.cpu.sampler import sample as reference_sample
from sparkd.backend.cuda.kernels import sampling
from sparkd.backend.dtypes import DType


def llm_like_logits(rng, rows: int, vocab: int) -> np.ndarray:
    """A broad background plus a few strong candidates per row, as real logits look."""
    logits = 3 * rng.standard_normal((rows, vocab), dtype=np.float32)
    for row in logits:
        row[rng.integers(0, vocab, size=min(vocab, 5))] += 8
    return logits


def sampling_tensors(rng, rows: int, **fields) -> SamplingTensors:
    """Neutral parameters (temperature 1, no filters, no penalties) with `fields` overridden."""
    no_ids = np.full((rows, 0), -1, np.int32)
    params = {
        "temperature": np.ones(rows, np.float32), "top_k": np.zeros(rows, np.int32),
        "top_p": np.ones(rows, np.float32), "min_p": np.zeros(rows, np.float32),
        "repetition_penalty": np.ones(rows, np.float32), "presence_penalty": np.zeros(rows, np.float32),
        "frequency_penalty": np.zeros(rows, np.float32), "prompt_token_ids": no_ids, "output_token_ids": no_ids,
        "banned_token_ids": no_ids, "seeds": rng.integers(0, 2**64, size=rows, dtype=np.uint64),
        "steps": rng.integers(0, 2**40, size=rows, dtype=np.int64), "num_logprobs": -1,
    }
    return SamplingTensors(**(params | fields))


def sample_on_device(gpu, logits, params: SamplingTensors, split: bool = True):
    """Through `sample_async` (which splits where it can), or with splitting off."""
    from sparkd.backend.cuda.transfer import DownloadRing

    if split:
        return sampling.sample_async(logits, params, gpu.staging, DownloadRing(), gpu.allocator, gpu.stream).result()
    inputs, out, workspace = device_buffers(gpu, logits, params, split=False)
    sampling.launch_sample(out, logits, inputs, workspace, gpu.stream, split=False)
    return out.download_async(DownloadRing(), gpu.stream).result()


def device_buffers(gpu, logits, params: SamplingTensors, split: bool = True):
    """(inputs, outputs, workspace or None) for `launch_sample`."""
    inputs = sampling.upload_inputs(params, gpu.staging)
    out = sampling.SamplerBuffers.allocate(
        gpu.allocator, logits.shape[0], sampling.num_top_logprobs(params.num_logprobs, logits.shape[1]))
    needs = sampling.needs_row_workspace(inputs, logits, split)
    return inputs, out, gpu.empty(logits.shape, DType.float32) if needs else None


def sample_both(gpu, logits: np.ndarray, params: SamplingTensors, split: bool = True):
    """(device SamplerOutput, reference SamplerOutput); also checks the raw logits stay untouched."""
    device_logits = gpu.upload(logits)
    got = sample_on_device(gpu, device_logits, params, split)
    np.testing.assert_array_equal(gpu.download(device_logits), logits)
    return got, reference_sample(logits, params)


def pick(rng, choices, rows, dtype):
    return np.asarray(choices, dtype)[rng.integers(0, len(choices), size=rows)]
