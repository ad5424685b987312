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
  product_rows(w_rows, w, row0, N, K);

  float acc[kM][kGemvRows] = {};
  accumulate_rows<T, kM>(acc, w_rows, GlobalRows<T>{x, ld_x}, M, K / Chunk<T>::kSize);

  __shared__ float partial[kGemvMaxWarps][kM * kGemvRows];
  store_product<OutT, kM>(out, acc, partial, bias, row0, M, N, ld_out);
}

// The gated MLP's first GEMM with its activation: out [M, I] = silu(x @ gate^T) * (x @ up^T),
// w = [gate | up] [2I, K] (gate_up_proj), bias [2I] or null. A block owns kGemvRows / 2 output
// columns (gate_up_rows), so both halves of a column meet in the block and the [M, 2I] product
// is never written; the activation as store_silu_and_mul says.
// Launch: ceil(I / (kGemvRows / 2)) blocks; threads and preconditions as gemv_kernel.
template <typename T, int kM>
__global__ void __launch_bounds__(32 * kGemvMaxWarps)
    gemv_silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ w,
                             const T* __restrict__ bias, int M, int I, int K, long long ld_x) {
  const int col0 = blockIdx.x * (kGemvRows / 2);
  const T* w_rows[kGemvRows];
  gate_up_rows(w_rows, w, col0, I, K);

  float acc[kM][kGemvRows] = {};
  accumulate_rows<T, kM>(acc, w_rows, GlobalRows<T>{x, ld_x}, M, K / Chunk<T>::kSize);

  __shared__ float partial[kGemvMaxWarps][kM * kGemvRows];
  store_silu_and_mul<T, kM>(out, acc, partial, bias, col0, M, I);
}
