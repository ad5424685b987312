// Skinny GEMM for decode-sized batches: out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]),
// M <= 16, fp32 accumulation whatever the storage type. How it streams w: gemv_common.cuh.
#include "gemv_common.cuh"

using namespace sparkd;

// out [M, N] (row stride ld_out) = x [M, K] (row stride ld_x) @ w [N, K]^T (+ bias [N] if not null).
// kM is the M tile: M <= kM rows of x run in one pass over w.
// Launch: ceil(N / kGemvRows) blocks of 32 * S threads, S in [1, kGemvMaxWarps] warps
// splitting K. Preconditions (checked by the launcher): K and ld_x are multiples of a
// 16-byte chunk, and x and w are 16-byte aligned.
template <typename T, typename OutT, int kM>
__global__ void __launch_bounds__(32 * kGemvMaxWarps)
    gemv_kernel(OutT* __restrict__ out, const T* __restrict__ x, const T* __restrict__ w,
                const OutT* __restrict__ bias, int M, int N, int K, long long ld_x, long long ld_out) {
  const int row0 = blockIdx.x * kGemvRows;
  const T* w_rows[kGemvRows];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) {
    // The last block's rows past N re-read row N - 1; their sums are never stored.
    w_rows[r] = w + static_cast<long long>(min(row0 + r, N - 1)) * K;
  }

  float acc[kM][kGemvRows] = {};
  accumulate_rows<T, kM>(acc, w_rows, GlobalRows<T>{x, ld_x}, M, K / Chunk<T>::kSize);

  __shared__ float partial[kGemvMaxWarps][kM * kGemvRows];
  store_warp_sums<kM>(acc, partial, M);
  for (int i = threadIdx.x; i < kM * kGemvRows; i += blockDim.x) {
    const int m = i / kGemvRows, row = row0 + i % kGemvRows;
    if (m >= M || row >= N) continue;
    float sum = block_total<kM>(partial, i);
    if (bias != nullptr) sum += to_float(bias[row]);
    out[m * ld_out + row] = from_float<OutT>(sum);
  }
}

// The gated MLP's first GEMM with its activation: out [M, I] = silu(x @ gate^T) * (x @ up^T),
// w = [gate | up] [2I, K] (gate_up_proj), bias [2I] or null. A block owns kCols output
// columns: gate rows c and up rows I + c for c in its columns, so both halves of a column
// meet in the block and the [M, 2I] product is never written. Each half is rounded to T
// first, as linear's output would be, then silu(g) * u is taken in fp32 (activation.cu).
// Launch: ceil(I / kCols) blocks; threads and preconditions as gemv_kernel.
template <typename T, int kM>
__global__ void __launch_bounds__(32 * kGemvMaxWarps)
    gemv_silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ w,
                             const T* __restrict__ bias, int M, int I, int K, long long ld_x) {
  constexpr int kCols = kGemvRows / 2;
  const int col0 = blockIdx.x * kCols;
  const T* w_rows[kGemvRows];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int col = min(col0 + c, I - 1);  // columns past I re-read the last; never stored
    w_rows[c] = w + static_cast<long long>(col) * K;
    w_rows[kCols + c] = w + static_cast<long long>(I + col) * K;
  }

  float acc[kM][kGemvRows] = {};
  accumulate_rows<T, kM>(acc, w_rows, GlobalRows<T>{x, ld_x}, M, K / Chunk<T>::kSize);

  __shared__ float partial[kGemvMaxWarps][kM * kGemvRows];
  store_warp_sums<kM>(acc, partial, M);
  for (int i = threadIdx.x; i < kM * kCols; i += blockDim.x) {
    const int m = i / kCols, c = i % kCols, col = col0 + c;
    if (m >= M || col >= I) continue;
    float gate = block_total<kM>(partial, m * kGemvRows + c);
    float up = block_total<kM>(partial, m * kGemvRows + kCols + c);
    if (bias != nullptr) {
      gate += to_float(bias[col]);
      up += to_float(bias[I + col]);
    }
    gate = to_float(from_float<T>(gate));
    up = to_float(from_float<T>(up));
    out[static_cast<long long>(m) * I + col] = from_float<T>(gate / (1.f + expf(-gate)) * up);
  }
}
