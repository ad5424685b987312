"""Diagnostics of the Hopper building blocks in wgmma.cuh that moe_grouped_wgmma's kernels are
made of, so that a failing GEMM test says where:
  - one wgmma on known operands: the swizzled tile, the matrix descriptor, the accumulator layout;
  - one swizzled tile copied in with cp.async completing on an mbarrier, and read back.
The diagnostics compile against a copy of wgmma.cuh. Every test skips off sm_90.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cuda.kernels import moe_grouped_wgmma
from sparkd.backend.dtypes import DType

from .wgmma_probes import probe_compiler, probe_source

pytestmark = pytest.mark.gpu

@pytest.fixture(autouse=True)
def _hopper(gpu):
    from sparkd.backend.cuda.driver import device_arch

    if not moe_grouped_wgmma.use_wgmma(device_arch()):
        pytest.skip(f"wgmma runs on {moe_grouped_wgmma.WGMMA_ARCH} only, this device is {device_arch()}")



PROBES = probe_source("wgmma.cuh", r"""
// d [64, 256] fp32 = a [64, 64] . b [256, 64]^T over K 0 .. 16 k_steps - 1, a and b bf16 row-major.
// One warpgroup stores the tiles swizzled (a's 64 rows, then b's 256) with ordinary stores; k_steps
// wgmma m64n256k16 read them through tile_descriptor; d goes out through accumulator_row / _col.
__global__ void __launch_bounds__(128)
    wgmma_probe_kernel(float* d, const __nv_bfloat16* a, const __nv_bfloat16* b, int k_steps) {
#if defined(SPARKD_HAS_WGMMA)
  unsigned char* tiles = aligned_shared();
  for (int c = threadIdx.x; c < (64 + 256) * kChunksPerRow; c += blockDim.x) {
    const uint4* from = c < 64 * kChunksPerRow ? reinterpret_cast<const uint4*>(a) + c
                                               : reinterpret_cast<const uint4*>(b) + c - 64 * kChunksPerRow;
    *reinterpret_cast<uint4*>(tiles + swizzled_offset(c / kChunksPerRow, c % kChunksPerRow)) = *from;
  }
  fence_proxy_async();
  __syncthreads();
  float acc[kM64N256Outputs];
#pragma unroll
  for (int i = 0; i < kM64N256Outputs; ++i) acc[i] = 0.f;
  const unsigned a_tile = attn::smem_addr(tiles), b_tile = a_tile + 64 * kRowBytes;
  fence_operands(acc);
  wgmma_fence();
  for (int step = 0; step < k_steps; ++step)
    wgmma_m64n256k16<__nv_bfloat16>(acc, tile_descriptor(a_tile + step * kStepBytes),
                                    tile_descriptor(b_tile + step * kStepBytes));
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(acc);
#pragma unroll
  for (int i = 0; i < kM64N256Outputs; ++i) d[accumulator_row(i) * 256 + accumulator_col(i)] = acc[i];
#endif
}

// image [128, 64]: the shared-memory bytes of rows [128, 64] (bf16) copied in as the kernels'
// producer does (thread t: 16-byte chunk t % 8 of rows t / 8 + 16 i, to swizzled_offset) with
// cp.async, completion through cp.async.mbarrier.arrive.noinc on a barrier of 128 arrivals; back:
// the tile read through swizzled_offset. arrived[t]: the barrier's phase completed for thread t
// within the spin limit (else the tile is not read).
__global__ void __launch_bounds__(128)
    swizzle_probe_kernel(__nv_bfloat16* image, __nv_bfloat16* back, int* arrived, const __nv_bfloat16* rows) {
#if defined(SPARKD_HAS_WGMMA)
  constexpr int kRows = 128;
  unsigned char* tile = aligned_shared();
  const unsigned barrier = attn::smem_addr(tile + kRows * kRowBytes);
  if (threadIdx.x == 0) {
    mbarrier_init(barrier, blockDim.x);
    mbarrier_init_fence();
  }
  __syncthreads();
  const int chunk = threadIdx.x % kChunksPerRow;
  for (int row = threadIdx.x / kChunksPerRow; row < kRows; row += blockDim.x / kChunksPerRow)
    attn::cp_async_16(tile + swizzled_offset(row, chunk), rows + row * 64 + chunk * 8, true);
  mbarrier_arrive_on_copies(barrier);
  bool done = false;
  for (int spin = 0; spin < (1 << 20) && !done; ++spin) done = mbarrier_try_wait(barrier, 0);
  arrived[threadIdx.x] = done;
  if (!done) return;
  for (int c = threadIdx.x; c < kRows * kChunksPerRow; c += blockDim.x) {
    reinterpret_cast<uint4*>(image)[c] = reinterpret_cast<const uint4*>(tile)[c];
    reinterpret_cast<uint4*>(back)[c] =
        *reinterpret_cast<const uint4*>(tile + swizzled_offset(c / kChunksPerRow, c % kChunksPerRow));
  }
#endif
}
""")


@pytest.fixture
def probe(compile_test_kernel, tmp_path):
    """name -> that kernel of PROBES, built (for sm_90a) against copies of wgmma.cuh and its headers."""
    return probe_compiler(compile_test_kernel, tmp_path, "wgmma.cuh", PROBES)


_M, _N, _K = np.arange(64)[:, None], np.arange(256)[:, None], np.arange(64)[None, :]
_SMALL_INTS = np.random.default_rng(3)
# name: (a [64, 64], b [256, 64], wgmma steps, what a mismatch points at); bf16-exact integers,
# so the products are exact and D must equal a @ b.T bit for bit.
LAYOUT_PROBES = {
    "rows": ((_K == 0) * (_M + 1.0), (_K == 0) * np.ones((256, 1)), 1,
             "D[m, n] = m + 1: accumulator_row, or A's row order in the tile (swizzle, stride byte offset)"),
    "columns": ((_K == 0) * np.ones((64, 1)), (_K == 0) * (_N + 1.0), 1,
                "D[m, n] = n + 1: accumulator_col, or B's row order in the tile"),
    "k_in_a_step": ((_K == _M % 16) * 1.0, (_K < 16) * (_K + 1.0) * np.ones((256, 1)), 1,
                    "D[m, n] = m % 16 + 1: the K order within a wgmma's 32 bytes of a row (the chunk swizzle)"),
    "k_steps": (_SMALL_INTS.integers(-3, 4, (64, 64)) * 1.0, _SMALL_INTS.integers(-3, 4, (256, 64)) * 1.0, 4,
                "D = A . B^T over K 64: the descriptor's start address advance of 32 bytes a step"),
}


def _ranges(indices: np.ndarray) -> str:
    """'0-15, 32-47' for the sorted indices."""
    breaks = np.flatnonzero(np.diff(indices) != 1)
    starts, ends = np.r_[indices[:1], indices[breaks + 1]], np.r_[indices[breaks], indices[-1:]]
    return ", ".join(f"{s}-{e}" if s != e else f"{s}" for s, e in zip(starts, ends))


def _where_wrong(got: np.ndarray, expected: np.ndarray) -> str:
    wrong = got != expected  # NaN (never written) counts as wrong
    cells = list(zip(*np.nonzero(wrong)))[:6]
    return (f"{wrong.sum()} of {wrong.size} wrong, in rows {_ranges(np.flatnonzero(wrong.any(axis=1)))} and columns "
            f"{_ranges(np.flatnonzero(wrong.any(axis=0)))}; first (row, col, got, expected): "
            f"{[(int(r), int(c), float(got[r, c]), float(expected[r, c])) for r, c in cells]}")


@pytest.mark.parametrize("name", LAYOUT_PROBES)
def test_one_wgmma_on_known_operands(gpu, probe, name):
    a, b, k_steps, suspect = LAYOUT_PROBES[name]
    d = gpu.upload(np.full((64, 256), np.nan, np.float32))
    args = [d, gpu.upload(a.astype(np.float32), DType.bfloat16), gpu.upload(b.astype(np.float32), DType.bfloat16),
            np.int32(k_steps)]
    probe("wgmma_probe_kernel").launch(1, 128, args, shared_mem=1024 + (64 + 256) * 128, stream=gpu.stream)
    got = gpu.download(d)
    expected = a[:, : 16 * k_steps] @ b[:, : 16 * k_steps].T
    assert np.array_equal(got, expected), f"{suspect}\n{_where_wrong(got, expected)}"


def test_swizzled_tile_round_trip_through_cp_async_and_an_mbarrier(gpu, probe):
    rows_dev = gpu.upload(np.random.default_rng(7).standard_normal((128, 64), dtype=np.float32), DType.bfloat16)
    rows = gpu.download(rows_dev)
    image, back = gpu.empty((128, 64), DType.bfloat16), gpu.empty((128, 64), DType.bfloat16)
    arrived = gpu.upload(np.zeros(128, np.int32))
    probe("swizzle_probe_kernel").launch(1, 128, [image, back, arrived, rows_dev], shared_mem=1024 + 128 * 128 + 8,
                                         stream=gpu.stream)
    assert gpu.download(arrived).all(), "the copies' noinc arrivals never completed the barrier's phase (count 128)"
    # Chunk c (8 elements) of row r sits at chunk c ^ (r % 8) of the same row.
    r, c = np.arange(128)[:, None], np.arange(8)[None, :]
    expected = np.empty((128, 8, 8), np.float32)
    expected[r, c ^ (r % 8)] = rows.reshape(128, 8, 8)
    image, expected = gpu.download(image), expected.reshape(128, 64)
    assert np.array_equal(image, expected), f"swizzled_offset: {_where_wrong(image, expected)}"
    assert np.array_equal(gpu.download(back), rows), "reading through swizzled_offset does not undo writing through it"
