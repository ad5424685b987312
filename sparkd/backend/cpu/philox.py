"""Philox4x32-10 counter-based random numbers, vectorised in numpy.

This is the reference the CUDA sampler kernel reproduces bit for bit, so the
layout below is a contract, not an implementation detail.

Philox4x32-10 (Salmon et al., SC'11; Random123) maps a 128-bit counter
(c0, c1, c2, c3) and a 64-bit key (k0, k1), all uint32 words, to four uint32
words. Ten rounds of:

    (hi0, lo0) = mulhilo(0xD2511F53, c0)      # 32x32 -> 64-bit product
    (hi1, lo1) = mulhilo(0xCD9E8D57, c2)
    (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)

with the key bumped between rounds (k0 += 0x9E3779B9, k1 += 0xBB67AE85, mod
2**32); the first round uses the key as given.

Sampling layout: one call covers four vocab ids. For a row with 64-bit `seed`
drawing its token number `step` (the index of the output token, from 0):

    key     = (seed & 0xFFFFFFFF, seed >> 32)
    counter = (v // 4, step & 0xFFFFFFFF, step >> 32, 0)
    word j of that call (j = 0..3) belongs to vocab id 4 * (v // 4) + j
    u = ((word >> 9) + 0.5) * 2**-23

u keeps 23 random bits so that it is exact in float32: (word >> 9) < 2**23,
adding 0.5 needs 24 mantissa bits and scaling by a power of two is exact. The
result lies strictly inside (0, 1), in [2**-24, 1 - 2**-24]. (With 24 bits,
float32 would round the largest values up to exactly 1.0, making -log(u) = 0.)
A kernel computes it as `((w >> 9) + 0.5f) * 0x1p-23f`.
"""

from __future__ import annotations

import numpy as np

PHILOX_M0 = np.uint64(0xD2511F53)
PHILOX_M1 = np.uint64(0xCD9E8D57)
PHILOX_W0 = np.uint32(0x9E3779B9)
PHILOX_W1 = np.uint32(0xBB67AE85)
PHILOX_ROUNDS = 10

_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def philox4x32_10(counter: tuple, key: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Philox4x32-10 on broadcastable uint32 arrays.

    counter: 4 arrays (c0, c1, c2, c3), key: 2 arrays (k0, k1); all broadcast to
    one shape S. Returns the 4 output words, each uint32 [S].
    """
    c0, c1, c2, c3, k0, k1 = (np.array(x, dtype=np.uint32, ndmin=1) for x in (*counter, *key))
    c0, c1, c2, c3, k0, k1 = np.broadcast_arrays(c0, c1, c2, c3, k0, k1)
    k0, k1 = k0.copy(), k1.copy()
    for round_index in range(PHILOX_ROUNDS):
        if round_index:
            k0 += PHILOX_W0
            k1 += PHILOX_W1
        p0 = c0.astype(np.uint64) * PHILOX_M0
        p1 = c2.astype(np.uint64) * PHILOX_M1
        c0, c1, c2, c3 = (
            (p1 >> _SHIFT32).astype(np.uint32) ^ c1 ^ k0,
            (p1 & _LOW32).astype(np.uint32),
            (p0 >> _SHIFT32).astype(np.uint32) ^ c3 ^ k1,
            (p0 & _LOW32).astype(np.uint32),
        )
    return c0, c1, c2, c3


def philox_words(seeds: np.ndarray, steps: np.ndarray, vocab_size: int) -> np.ndarray:
    """Raw Philox words in the sampling layout. seeds [B] uint64, steps [B] int64
    -> [B, V] uint32 (word for vocab id v of each row)."""
    seeds = np.asarray(seeds).astype(np.uint64)[:, None]
    steps = np.asarray(steps).astype(np.int64).view(np.uint64)[:, None]
    blocks = np.arange((vocab_size + 3) // 4, dtype=np.uint32)[None, :]
    words = philox4x32_10(
        (blocks, steps & _LOW32, steps >> _SHIFT32, np.uint32(0)),
        (seeds & _LOW32, seeds >> _SHIFT32),
    )
    # [4, B, NB] -> [B, NB, 4] -> [B, 4 * NB]: word j of block b is vocab id 4b + j.
    interleaved = np.stack(words, axis=-1).reshape(len(seeds), -1)
    return interleaved[:, :vocab_size]


def philox_uniforms(seeds: np.ndarray, steps: np.ndarray, vocab_size: int) -> np.ndarray:
    """One uniform in (0, 1) per (row, vocab id). seeds [B] uint64, steps [B] int64
    -> [B, V] float32, laid out as the module docstring states."""
    words = philox_words(seeds, steps, vocab_size)
    return ((words >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)
