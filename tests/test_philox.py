"""Philox4x32-10 against Random123's published answers and a scalar re-implementation."""

import numpy as np
import pytest

from sparkd.backend.cpu.philox import philox4x32_10, philox_uniforms, philox_words

# Random123 tests/kat_vectors: (counter, key) -> output, for philox4x32 with 10 rounds.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def scalar_philox(counter, key):
    """Philox4x32-10 with Python ints, one block at a time (the textbook form)."""
    mask = 0xFFFFFFFF
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0), p1 & mask, ((p0 >> 32) ^ c3 ^ k1), p0 & mask
    return c0, c1, c2, c3


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_known_answers(counter, key, expected):
    assert tuple(int(w[0]) for w in philox4x32_10(counter, key)) == expected
    assert scalar_philox(counter, key) == expected


def test_sampling_layout_matches_scalar_reference():
    # Seeds and steps above 2**32 exercise the high key/counter words; V % 4 != 0 the tail.
    seeds = np.array([0, 1, 0xDEADBEEF, 0x123456789ABCDEF0, 2**64 - 1], dtype=np.uint64)
    steps = np.array([0, 7, 2**32 + 5, 123456, 2**40 + 3], dtype=np.int64)
    vocab_size = 23
    words = philox_words(seeds, steps, vocab_size)
    assert words.shape == (5, vocab_size) and words.dtype == np.uint32
    for row, (seed, step) in enumerate(zip(seeds.tolist(), steps.tolist())):
        key = (seed & 0xFFFFFFFF, seed >> 32)
        for v in range(vocab_size):
            block = scalar_philox((v // 4, step & 0xFFFFFFFF, step >> 32, 0), key)
            assert words[row, v] == block[v % 4], (row, v)


def test_uniforms_formula_and_range():
    seeds = np.array([3, 99], dtype=np.uint64)
    steps = np.array([0, 1], dtype=np.int64)
    u = philox_uniforms(seeds, steps, 1001)
    words = philox_words(seeds, steps, 1001).astype(np.float64)
    exact = (np.floor(words / 2**9) + 0.5) * 2.0**-23
    assert u.dtype == np.float32
    np.testing.assert_array_equal(u.astype(np.float64), exact)  # exact in float32
    # The extremes of the formula stay strictly inside (0, 1) in float32.
    lowest, highest = np.float32((0 + 0.5) * 2.0**-23), np.float32(((2**32 - 1) // 2**9 + 0.5) * 2.0**-23)
    assert 0 < lowest and highest < 1


def test_uniforms_are_uniform_and_independent_of_batch():
    seeds = np.array([i * 0x9E3779B97F4A7C15 % 2**64 for i in range(64)], dtype=np.uint64)
    steps = np.arange(64, dtype=np.int64)
    u = philox_uniforms(seeds, steps, 4096)
    counts, _ = np.histogram(u, bins=16, range=(0, 1))
    expected = u.size / 16
    chi_square = ((counts - expected) ** 2 / expected).sum()
    assert chi_square < 45  # df = 15: p < 1e-4 above this
    # A row depends only on its own (seed, step).
    alone = philox_uniforms(seeds[10:11], steps[10:11], 4096)
    np.testing.assert_array_equal(alone[0], u[10])
