// RMSNorm, plain and fused with the residual add, fp32 math.
//
//   rmsnorm:      out = x / sqrt(mean(x^2) + eps) * weight
//   add_rmsnorm:  residual' = x + residual, in fp32; out = rmsnorm(residual'), and for a MoE
//                 router optionally out_lo = the rounding error of out, in T as well; x stored,
//                 or a MoE block's combine of its expert rows (combine_add_rmsnorm_kernel)
//
// The residual stream stays in fp32 whatever T is: each layer adds its bf16/fp16
// output to it without rounding, so rounding errors do not pile up over the layers
// (the first layer's residual, the embedding, may come in T). Per-head q/k norm is
// the plain kernel over D-sized rows of a [T, H, D] view.
//
// Launch shape (every kernel): block = (threads_per_row, rows_per_block), one
// row group of threads_per_row (a multiple of 32, at most 1024) per row;
// grid = ceil(rows / rows_per_block). Each thread keeps its slice of the row in
// registers (at most kMaxElemsPerThread values), so the row is read once.
#include "moe_combine.cuh"

using namespace sparkd;

constexpr int kMaxElemsPerThread = 16;

// Holds up to kMaxElemsPerThread row values of one thread: chunk k covers
// elements [(threadIdx.x + k * blockDim.x) * kVec, ... + kVec).
template <int kVec>
struct RowSlice {
  static constexpr int kChunks = kMaxElemsPerThread / kVec;
  float v[kChunks][kVec];

  __device__ __forceinline__ static int offset(int k) { return (threadIdx.x + k * blockDim.x) * kVec; }
};

template <int kVec>
__device__ __forceinline__ float sum_of_squares(const float (&v)[kVec]) {
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kVec; ++i) sum += v[i] * v[i];
  return sum;
}

// Scales the slice by weight / rms and writes it to out (a row of dim values), rounded to T,
// and what that rounding lost to out_lo unless it is null: out + out_lo is the unrounded row
// to about 2^-16 of it in bf16 (2^-22 in fp16), which is what a MoE router's GEMM reads
// (CudaOps.add_rmsnorm_for_router). sum_sq: this thread's share of the row's sum of squares.
// Every thread of the block calls it; valid is false for threads past the last row, which join
// the reduction without storing.
template <typename T, int kVec>
__device__ __forceinline__ void normalize_and_store(T* __restrict__ out, T* __restrict__ out_lo,
                                                    const RowSlice<kVec>& slice, float sum_sq,
                                                    const T* __restrict__ weight, int dim, float eps, bool valid,
                                                    float* scratch) {
  sum_sq = row_group_reduce(sum_sq, SumOp{}, 0.f, scratch);
  const float inv_rms = 1.f / sqrtf(sum_sq / static_cast<float>(dim) + eps);
  if (!valid) return;
#pragma unroll
  for (int k = 0; k < RowSlice<kVec>::kChunks; ++k) {
    const int col = RowSlice<kVec>::offset(k);
    if (col >= dim) break;
    float w[kVec], y[kVec];
    load_floats<kVec>(weight + col, w);
#pragma unroll
    for (int i = 0; i < kVec; ++i) y[i] = slice.v[k][i] * inv_rms * w[i];
    store_floats<kVec>(out + col, y);
    if (out_lo != nullptr) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) y[i] -= to_float(from_float<T>(y[i]));
      store_floats<kVec>(out_lo + col, y);
    }
  }
}

// x: rows addressed as (outer, inner) = (r / inner_rows, r % inner_rows) at
//    x + outer * stride_outer + inner * stride_inner (elements); dim contiguous.
//    [T, H] uses inner_rows = 1; a [T, Hq, D] head view uses inner_rows = Hq.
// x is in X: T, or float (the fp32 residual stream, before the final norm).
// out: [rows, dim] contiguous in T. weight: [dim] in T.
template <typename T, typename X, int kVec>
__global__ void __launch_bounds__(1024)
rmsnorm_kernel(T* __restrict__ out, const X* __restrict__ x, const T* __restrict__ weight, int rows,
               int inner_rows, long long stride_outer, long long stride_inner, int dim, float eps) {
  __shared__ float scratch[32 * 32];
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  const bool valid = row < rows;
  const X* src = x + (row / inner_rows) * stride_outer + (row % inner_rows) * stride_inner;
  RowSlice<kVec> slice;
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < RowSlice<kVec>::kChunks; ++k) {
    const int col = RowSlice<kVec>::offset(k);
    if (!valid || col >= dim) break;
    load_floats<kVec>(src + col, slice.v[k]);
    sum_sq += sum_of_squares(slice.v[k]);
  }
  normalize_and_store<T, kVec>(out + static_cast<long long>(row) * dim, nullptr, slice, sum_sq, weight, dim,
                               eps, valid, scratch);
}

// add_rmsnorm's x rows, stored: [rows, dim] in T, contiguous.
template <typename T>
struct StoredRows {
  const T* x;

  template <int kVec>
  __device__ __forceinline__ void load(int row, int col, int dim, float (&out)[kVec]) const {
    load_floats<kVec>(x + static_cast<long long>(row) * dim + col, out);
  }
};

// add_rmsnorm's x rows as a MoE block's output before its combine: row t is combine_columns
// (moe_combine.cuh) of token t's k expert rows, rounded to T: the values moe_combine_kernel
// stores, so the norm is the two launches' bit for bit.
template <typename T>
struct CombinedRows {
  const T* expert_out;     // [P, dim]
  const float* weights;    // [rows, k]
  const int* row_of_pair;  // [P]
  int top_k;

  template <int kVec>
  __device__ __forceinline__ void load(int row, int col, int dim, float (&out)[kVec]) const {
    float acc[kVec];
    combine_columns<T, kVec>(acc, expert_out, weights, row_of_pair, row, col, dim, top_k);
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = to_float(from_float<T>(acc[i]));
  }
};

// The body of both add_rmsnorm kernels, x rows from `x` (StoredRows or CombinedRows).
// residual_in: [rows, dim] in R (T or float); residual_out: [rows, dim] float, which may be
// residual_in itself (R = float: updated in place), so neither is __restrict__; both
// contiguous. out: [rows, dim] in T, row stride ld_out; out_lo: null, or [rows, dim] in T at the
// same row stride (out's rounding error, for a MoE router).
template <typename T, typename R, int kVec, typename Rows>
__device__ __forceinline__ void add_rmsnorm_rows(T* __restrict__ out, T* __restrict__ out_lo, long long ld_out,
                                                 float* residual_out, const R* residual_in, const Rows& x,
                                                 const T* __restrict__ weight, int rows, int dim, float eps) {
  __shared__ float scratch[32 * 32];
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  const bool valid = row < rows;
  const long long base = static_cast<long long>(row) * dim;
  RowSlice<kVec> slice;
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < RowSlice<kVec>::kChunks; ++k) {
    const int col = RowSlice<kVec>::offset(k);
    if (!valid || col >= dim) break;
    float a[kVec], b[kVec];
    load_floats<kVec>(residual_in + base + col, b);  // first: x's rows may be a combine's dependent loads
    x.template load<kVec>(row, col, dim, a);
#pragma unroll
    for (int i = 0; i < kVec; ++i) slice.v[k][i] = a[i] + b[i];
    store_floats<kVec>(residual_out + base + col, slice.v[k]);
    sum_sq += sum_of_squares(slice.v[k]);
  }
  const long long out_row = static_cast<long long>(row) * ld_out;
  normalize_and_store<T, kVec>(out + out_row, out_lo != nullptr ? out_lo + out_row : nullptr, slice, sum_sq, weight,
                               dim, eps, valid, scratch);
}

// x: [rows, dim] in T; the rest as add_rmsnorm_rows.
template <typename T, typename R, int kVec>
__global__ void __launch_bounds__(1024)
add_rmsnorm_kernel(T* __restrict__ out, T* __restrict__ out_lo, long long ld_out, float* residual_out,
                   const R* residual_in, const T* __restrict__ x, const T* __restrict__ weight, int rows, int dim,
                   float eps) {
  add_rmsnorm_rows<T, R, kVec>(out, out_lo, ld_out, residual_out, residual_in, StoredRows<T>{x}, weight, rows, dim,
                               eps);
}

// Threads a combine_add_rmsnorm row may have: with a batch of expert rows in flight besides its
// row slice, a thread needs more than the 64 registers of a 1024-thread block (it spilled there).
constexpr int kCombineNormThreads = 512;

// add_rmsnorm_kernel with x the MoE combine of expert_out [P, dim] in T by weights [rows, k]
// float32 and row_of_pair [P] (CombinedRows): a MoE layer's output, added in the next layer's
// norm without being stored. kVec > 1: expert_out 16-byte aligned. No out_lo: the norm after a
// MoE block feeds the next layer's attention or delta net, not a router.
template <typename T, typename R, int kVec>
__global__ void __launch_bounds__(kCombineNormThreads, 1)
combine_add_rmsnorm_kernel(T* __restrict__ out, long long ld_out, float* residual_out, const R* residual_in,
                           const T* __restrict__ expert_out, const float* __restrict__ weights,
                           const int* __restrict__ row_of_pair, int top_k, const T* __restrict__ weight, int rows,
                           int dim, float eps) {
  add_rmsnorm_rows<T, R, kVec>(out, nullptr, ld_out, residual_out, residual_in,
                               CombinedRows<T>{expert_out, weights, row_of_pair, top_k}, weight, rows, dim, eps);
}
