// The skinny GEMM at one row of x with the RMSNorm before it in its prologue: a decoder
// layer's pre-attention norm + qkv projection, or its post-attention norm + gate_up and
// SiLU-and-mul, as one launch at decode batch 1.
//
//   h = x + residual (fp32; h = x without a residual);  y = rmsnorm(h) * norm_weight, rounded to T
//   out = y @ w^T (+ bias)                 gemv_norm_kernel
//   out = silu(y @ gate^T) * (y @ up^T)    gemv_norm_silu_and_mul_kernel
//
// Why: the norm on its own is a launch whose few microseconds are all latency (a block
// loads a 4096-vector, reduces, stores) and the GEMV behind it cannot start its weight
// stream until the norm is done. Here every block issues its first pass of weight loads,
// then computes the norm itself while they are in flight: h, y and the row's sum of
// squares come from a few KB that every block re-reads from L2 / L1. y stays in registers
// as the very x chunks gemv_common.cuh's loop would load, so the products are gemv_kernel's
// (same chunks per thread, same order of sums). Block 0 also writes h, the new residual
// stream, to residual_out, which must not be residual: other blocks still read that.
//
// Launch: ceil(groups / groups_per_block) blocks of 32 * S threads, S warps as gemv_kernel's
// one-row launch (a thread per 16-byte chunk of K, at most kGemvMaxWarps warps); a group is
// kGemvRows rows of w (plain) or kGemvRows / 2 output columns (gated). Each block computes the
// norm once for its groups_per_block groups, so a larger count spreads that work over more
// weight bytes. kChunks: the x chunks a thread holds, K / chunk <= kChunks * threads.
// Preconditions (checked by the launcher): K a multiple of a 16-byte chunk, every pointer
// 16-byte aligned, residual_out apart from x and residual.
#include "gemv_common.cuh"

using namespace sparkd;

namespace {

// This thread's chunks c = threadIdx.x + p * blockDim.x of y = rmsnorm(x + residual) * weight
// (residual null: of x), rounded to T and packed as gemv's x chunks; chunks past K are zero.
// residual_out: where h goes, or null. R: residual's type, T or float (the fp32 stream).
// The loads of x and the residual are all issued before any is used (one round trip to L2, not
// one per chunk); the norm weight's go out after the reduction, which keeps the registers down.
// Every thread of the block calls it (the sum of squares is a block reduction).
template <typename T, typename R, int kChunks>
__device__ __forceinline__ void normed_chunks(uint4 (&y)[kChunks], const T* __restrict__ x,
                                              const R* __restrict__ residual, const T* __restrict__ weight,
                                              float eps, int num_chunks, float* __restrict__ residual_out) {
  using C = Chunk<T>;
  __shared__ float scratch[32];
  float h[kChunks][C::kSize], r[kChunks][C::kSize];
#pragma unroll
  for (int p = 0; p < kChunks; ++p) {
    const int offset = (threadIdx.x + p * blockDim.x) * C::kSize;
    const bool valid = offset < num_chunks * C::kSize;
#pragma unroll
    for (int i = 0; i < C::kSize; ++i) h[p][i] = r[p][i] = 0.f;
    if (valid) {
      load_floats<C::kSize>(x + offset, h[p]);
      if (residual != nullptr) load_floats<C::kSize>(residual + offset, r[p]);
    }
  }
  float sum_sq = 0.f;
#pragma unroll
  for (int p = 0; p < kChunks; ++p) {
    const int offset = (threadIdx.x + p * blockDim.x) * C::kSize;
#pragma unroll
    for (int i = 0; i < C::kSize; ++i) {
      h[p][i] += r[p][i];
      sum_sq += h[p][i] * h[p][i];
    }
    if (residual_out != nullptr && offset < num_chunks * C::kSize) {
      store_floats<C::kSize>(residual_out + offset, h[p]);
    }
  }
  sum_sq = row_group_reduce(sum_sq, SumOp{}, 0.f, scratch);
  const float inv_rms = 1.f / sqrtf(sum_sq / static_cast<float>(num_chunks * C::kSize) + eps);
#pragma unroll
  for (int p = 0; p < kChunks; ++p) {
    const int offset = (threadIdx.x + p * blockDim.x) * C::kSize;
    float w[C::kSize] = {};
    if (offset < num_chunks * C::kSize) load_floats<C::kSize>(weight + offset, w);
    Pack<T, C::kSize> pack;
#pragma unroll
    for (int i = 0; i < C::kSize; ++i) pack.v[i] = from_float<T>(h[p][i] * inv_rms * w[i]);
    y[p] = *reinterpret_cast<const uint4*>(&pack);
  }
}

// One pass of a thread over its group's rows: chunk c of each, straight from DRAM.
template <typename T>
__device__ __forceinline__ void load_pass(uint4 (&w_raw)[kGemvRows], const T* const (&w_rows)[kGemvRows], int c) {
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) w_raw[r] = load_streaming(w_rows[r] + static_cast<long long>(c) * Chunk<T>::kSize);
}

// acc[0][r] += y chunk . w_raw[r], in accumulate_rows' order.
template <typename T>
__device__ __forceinline__ void fma_pass(float (&acc)[1][kGemvRows], const uint4 (&w_raw)[kGemvRows], const uint4& y) {
  using C = Chunk<T>;
  float w_vals[kGemvRows][C::kSize], y_vals[C::kSize];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) C::unpack(w_raw[r], w_vals[r]);
  C::unpack(y, y_vals);
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) {
#pragma unroll
    for (int i = 0; i < C::kSize; ++i) acc[0][r] = fmaf(y_vals[i], w_vals[r][i], acc[0][r]);
  }
}

// The shared body: the norm, then groups [g_begin, g_end) of w, each stored by store(group, acc,
// partial). rows(group, w_rows) sets a group's row pointers. The next group's first pass is
// loaded before this group's sums are reduced, so its loads overlap the epilogue.
template <typename T, typename R, int kChunks, typename Rows, typename Store>
__device__ __forceinline__ void norm_then_groups(const T* x, const R* residual, const T* norm_weight, float eps,
                                                 float* residual_out, int K, int num_groups, int groups_per_block,
                                                 Rows rows, Store store) {
  const int num_chunks = K / Chunk<T>::kSize;
  const int g_begin = blockIdx.x * groups_per_block, g_end = min(g_begin + groups_per_block, num_groups);
  const T* w_rows[kGemvRows];
  uint4 w_raw[kGemvRows];
  rows(g_begin, w_rows);
  if (threadIdx.x < num_chunks) load_pass<T>(w_raw, w_rows, threadIdx.x);  // in flight during the norm

  uint4 y[kChunks];
  normed_chunks<T, R, kChunks>(y, x, residual, norm_weight, eps, num_chunks, blockIdx.x == 0 ? residual_out : nullptr);

  __shared__ float partial[kGemvMaxWarps][kGemvRows];
  for (int g = g_begin; g < g_end; ++g) {
    float acc[1][kGemvRows] = {};
#pragma unroll
    for (int p = 0; p < kChunks; ++p) {
      const int c = threadIdx.x + p * blockDim.x;
      if (c >= num_chunks) break;
      if (p > 0) load_pass<T>(w_raw, w_rows, c);
      fma_pass<T>(acc, w_raw, y[p]);
    }
    if (g + 1 < g_end) {
      rows(g + 1, w_rows);
      if (threadIdx.x < num_chunks) load_pass<T>(w_raw, w_rows, threadIdx.x);
    }
    store(g, acc, partial);
    __syncthreads();  // partial is reused by the next group
  }
}

}  // namespace

// out [1, N] = rmsnorm(x + residual) [1, K] @ w [N, K]^T (+ bias [N] if not null), T out.
template <typename T, typename R, int kChunks>
__global__ void __launch_bounds__(32 * kGemvMaxWarps)
    gemv_norm_kernel(T* __restrict__ out, float* __restrict__ residual_out, const T* __restrict__ x,
                     const R* __restrict__ residual, const T* __restrict__ norm_weight, float eps,
                     const T* __restrict__ w, const T* __restrict__ bias, int N, int K, int groups_per_block) {
  norm_then_groups<T, R, kChunks>(
      x, residual, norm_weight, eps, residual_out, K, (N + kGemvRows - 1) / kGemvRows, groups_per_block,
      [=](int g, const T* (&w_rows)[kGemvRows]) { product_rows(w_rows, w, g * kGemvRows, N, K); },
      [=](int g, const float (&acc)[1][kGemvRows], float (&partial)[kGemvMaxWarps][kGemvRows]) {
        store_product<T, 1>(out, acc, partial, bias, g * kGemvRows, 1, N, 0);
      });
}

// out [1, I] = silu(y @ gate^T) * (y @ up^T), y = rmsnorm(x + residual), w = [gate | up] [2I, K],
// bias [2I] or null; the activation as gemv_silu_and_mul_kernel's.
template <typename T, typename R, int kChunks>
__global__ void __launch_bounds__(32 * kGemvMaxWarps)
    gemv_norm_silu_and_mul_kernel(T* __restrict__ out, float* __restrict__ residual_out, const T* __restrict__ x,
                                  const R* __restrict__ residual, const T* __restrict__ norm_weight, float eps,
                                  const T* __restrict__ w, const T* __restrict__ bias, int I, int K,
                                  int groups_per_block) {
  constexpr int kCols = kGemvRows / 2;
  norm_then_groups<T, R, kChunks>(
      x, residual, norm_weight, eps, residual_out, K, (I + kCols - 1) / kCols, groups_per_block,
      [=](int g, const T* (&w_rows)[kGemvRows]) { gate_up_rows(w_rows, w, g * kCols, I, K); },
      [=](int g, const float (&acc)[1][kGemvRows], float (&partial)[kGemvMaxWarps][kGemvRows]) {
        store_silu_and_mul<T, 1>(out, acc, partial, bias, g * kCols, 1, I);
      });
}
