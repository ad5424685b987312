// The arithmetic of RoPE and the q/k norm, shared by rope_write_kv_kernel (rope_kv.cu)
// and the decode attention that fuses it (attention_rope.cuh), so the two give the
// same bits. The rounding is spelled out with intrinsics (fma for the sums of squares
// and the rotation, separate multiplies for the norm), so neither kernel depends on
// where the compiler would contract plain expressions.
#pragma once

#include "common.cuh"

namespace sparkd {

// Lanes that reduce one head of `chunks` vectors: the next power of two, at most a warp.
__host__ __device__ constexpr int lanes_per_head(int chunks) {
  int lanes = 1;
  while (lanes < chunks && lanes < 32) lanes *= 2;
  return lanes;
}

// sum_sq += x[i]^2 for i in order, each an fma: one chunk of a head's sum of squares.
template <int VEC>
__device__ __forceinline__ void add_squares(float& sum_sq, const float (&x)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) sum_sq = __fmaf_rn(x[i], x[i], sum_sq);
}

// 1 / sqrt(mean(x^2) + eps) of a head of head_dim values from the partial sums of
// squares of the `lanes` aligned lanes of a warp that share it: a butterfly over
// them, so every one gets the same value. Every lane of the warp calls it.
__device__ __forceinline__ float group_inv_rms(float sum_sq, int head_dim, int lanes, float eps) {
  for (int offset = lanes / 2; offset > 0; offset /= 2)
    sum_sq = __fadd_rn(sum_sq, __shfl_xor_sync(kFullMask, sum_sq, offset));
  return __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, static_cast<float>(head_dim)), eps)));
}

// 1 / sqrt(mean(x^2) + eps) of one head of head_dim values, reduced by the `lanes`
// aligned lanes of a warp that share it (lanes_per_head): lane l adds chunks l,
// l + lanes, ... of VEC values in turn, then group_inv_rms. Every lane of the warp
// calls it (the shuffles); lanes with no head pass head = nullptr.
template <typename T, int VEC>
__device__ __forceinline__ float head_inv_rms(const T* head, int head_dim, int lane, int lanes, float eps) {
  float sum_sq = 0.f;
  if (head != nullptr) {
    for (int chunk = lane; chunk < head_dim / VEC; chunk += lanes) {
      float x[VEC];
      load_floats<VEC>(head + chunk * VEC, x);
      add_squares<VEC>(sum_sq, x);
    }
  }
  return group_inv_rms(sum_sq, head_dim, lanes, eps);
}

// x (VEC values of a head from dim on) RMS-normalised: scaled by inv_rms and the
// weight norm_weight[dim, dim + VEC), then rounded to T, as rmsnorm_kernel stores them.
template <typename T, int VEC>
__device__ __forceinline__ void normalise(float (&x)[VEC], const T* norm_weight, float inv_rms, int dim) {
  float w[VEC];
  load_floats<VEC>(norm_weight + dim, w);
#pragma unroll
  for (int i = 0; i < VEC; ++i) x[i] = to_float(from_float<T>(__fmul_rn(__fmul_rn(x[i], inv_rms), w[i])));
}

// VEC values of a head vector from dim on, normalised when norm_weight is set.
template <typename T, int VEC>
__device__ __forceinline__ void load_normed(const T* head, const T* norm_weight, float inv_rms, int dim,
                                            float (&x)[VEC]) {
  load_floats<VEC>(head + dim, x);
  if (norm_weight != nullptr) normalise<T, VEC>(x, norm_weight, inv_rms, dim);
}

// The first dim of the chunk that dims [dim, dim + VEC) rotate with (dim < rotary_dim):
// i pairs with i + rotary_dim / 2.
__device__ __forceinline__ int rotation_partner(int dim, int rotary_dim) {
  const int half = rotary_dim / 2;
  return dim < half ? dim + half : dim - half;
}

// cos_v, sin_v = the rotation's factors for dims [dim, dim + VEC) (dim < rotary_dim)
// from the token's cos_sin row.
template <int VEC>
__device__ __forceinline__ void rotation_factors(float (&cos_v)[VEC], float (&sin_v)[VEC], const float* cos_sin_row,
                                                 int dim, int rotary_dim) {
  const int half = rotary_dim / 2;
  const int freq = dim < half ? dim : dim - half;
  load_floats<VEC>(cos_sin_row + freq, cos_v);
  load_floats<VEC>(cos_sin_row + half + freq, sin_v);
}

// Neox-rotates x, a chunk of a head, with the values of its rotation partner chunk:
// x = x * cos + sign * partner * sin, sign = -1 in the first half.
template <int VEC>
__device__ __forceinline__ void rotate(float (&x)[VEC], const float (&partner)[VEC], const float (&cos_v)[VEC],
                                       const float (&sin_v)[VEC], bool first_half) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float rotated = __fmul_rn(partner[i], sin_v[i]);
    x[i] = __fmaf_rn(x[i], cos_v[i], first_half ? -rotated : rotated);
  }
}

// x = dims [dim, dim + VEC) of the (normalised) head, neox-rotated where dim <
// rotary_dim. Each chunk reads its rotation partner chunk itself.
template <typename T, int VEC>
__device__ __forceinline__ void rotated_chunk(float (&x)[VEC], const T* head, const T* norm_weight, float inv_rms,
                                              const float* cos_sin_row, int dim, int rotary_dim) {
  load_normed<T, VEC>(head, norm_weight, inv_rms, dim, x);
  if (dim >= rotary_dim) return;
  float partner[VEC], cos_v[VEC], sin_v[VEC];
  load_normed<T, VEC>(head, norm_weight, inv_rms, rotation_partner(dim, rotary_dim), partner);
  rotation_factors<VEC>(cos_v, sin_v, cos_sin_row, dim, rotary_dim);
  rotate<VEC>(x, partner, cos_v, sin_v, dim < rotary_dim / 2);
}

}  // namespace sparkd
