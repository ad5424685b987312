"""The MoE combine kernel (cukernels/moe_routing.cu) against numpy.

Expert rows in the output's dtype (as the expert GEMMs store them) against a float32 numpy
loop that rounds each product and sum as the kernel does: bit-exact, also after rounding to
bf16/fp16; and bf16/fp16 rows whose sum a kernel adding in bf16/fp16 would get wrong by more
than one ulp of the dtype: within one ulp of the fp32 sum.
"""

from __future__ import annotations

import numpy as np
import pytest

from .moe_cases import as_stored, combine_on_device, reference_combine

DTYPES = ["float32", "bfloat16", "float16"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,top_k,hidden", [(1, 8, 4096), (7, 2, 130), (64, 10, 256), (300, 1, 64),
                                                     (5, 16, 1026)])
def test_combine_matches_numpy_bit_for_bit(gpu, dtype, num_tokens, top_k, hidden):
    """H of 130 and 1026 take the scalar path (rows not 16-byte multiples), the others the vector one."""
    rng = np.random.default_rng(num_tokens * top_k + hidden)
    num_pairs = num_tokens * top_k
    expert_out = as_stored(rng.standard_normal((num_pairs, hidden)), dtype)  # rows as the expert GEMMs store them
    weights = rng.dirichlet(np.ones(top_k), size=num_tokens).astype(np.float32)
    row_of_pair = rng.permutation(num_pairs)
    out = combine_on_device(gpu, expert_out, weights, row_of_pair, dtype)
    np.testing.assert_array_equal(out.astype(np.float32),
                                  as_stored(reference_combine(expert_out, weights, row_of_pair), dtype))


def ulp(values: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of `dtype` at |values| (values of that dtype, as float32)."""
    magnitude = np.abs(values).astype(np.float32)
    if dtype == "float16":
        return np.spacing(magnitude.astype(np.float16)).astype(np.float32)
    return np.spacing(magnitude) * np.float32(2.0**16)  # bf16: fp32's exponent, 16 fewer fraction bits


def summed_in(dtype: str, expert_out, weights, row_of_pair) -> np.ndarray:
    """reference_combine with each product and each sum rounded to `dtype`: the wrong rounding point."""
    num_tokens, top_k = weights.shape
    rows = expert_out[row_of_pair.reshape(num_tokens, top_k)]
    out = np.zeros((num_tokens, expert_out.shape[1]), np.float32)
    for j in range(top_k):
        out = as_stored(out + as_stored(weights[:, j, None] * rows[:, j], dtype), dtype)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("hidden", [256, 130])  # the vector and the scalar path
def test_combine_sums_the_rows_in_fp32_and_rounds_once(gpu, dtype, hidden):
    """Each token's first row, weighted, is in [0.25, 1) and its 7 others under half an ulp of
    0.25 in the dtype: added in the dtype each would vanish (about 2 ulps in all); summed in fp32
    and rounded once, the output is within one ulp of the fp32 sum of the exact row values."""
    rng = np.random.default_rng(hidden)
    num_tokens, top_k = 64, 8
    half_ulp = ulp(np.float32(0.25), dtype) / 2
    pair_values = rng.uniform(half_ulp / 2, half_ulp, (num_tokens, top_k, hidden))
    pair_values[:, 0] = rng.uniform(0.5, 1.0, (num_tokens, hidden))
    weights = rng.uniform(0.5, 1.0, (num_tokens, top_k)).astype(np.float32)
    row_of_pair = rng.permutation(num_tokens * top_k)
    expert_out = np.empty((num_tokens * top_k, hidden), np.float32)
    expert_out[row_of_pair] = as_stored(pair_values.reshape(-1, hidden), dtype)
    expected = as_stored(reference_combine(expert_out, weights, row_of_pair), dtype)
    wrong = summed_in(dtype, expert_out, weights, row_of_pair)
    assert np.max(np.abs(wrong - expected) / ulp(expected, dtype)) > 1, "the rows must tell the rounding points apart"

    out = combine_on_device(gpu, expert_out, weights, row_of_pair, dtype)
    assert np.all(np.abs(out - expected) <= ulp(expected, dtype))
