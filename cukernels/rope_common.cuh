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

// 1 / sqrt(mean(x^2) + eps) of one head of head_dim values, reduced by the `lanes`
// aligned lanes of a warp that share it (lanes_per_head): lane l adds chunks l,
// l + lanes, ... of VEC values in turn, then a butterfly over the lanes. Every lane
// of the warp calls it (the shuffles); lanes with no head pass head = nullptr.
template <typename T, int VEC>
__device__ __forceinline__ float head_inv_rms(const T* head, int head_dim, int lane, int lanes, float eps) {
  float sum_sq = 0.f;
  if (head != nullptr) {
    for (int chunk = lane; chunk < head_dim / VEC; chunk += lanes) {
      float x[VEC];
      load_floats<VEC>(head + chunk * VEC, x);
#pragma unroll
      for (int i = 0; i < VEC; ++i) sum_sq = __fmaf_rn(x[i], x[i], sum_sq);
    }
  }
  for (int offset = lanes / 2; offset > 0; offset /= 2)
    sum_sq = __fadd_rn(sum_sq, __shfl_xor_sync(kFullMask, sum_sq, offset));
  return __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, static_cast<float>(head_dim)), eps)));
}

// VEC values of a head vector from dim on, RMS-normalised (scaled by inv_rms and
// the weight, then rounded to T, as rmsnorm_kernel stores them) when norm_weight is set.
template <typename T, int VEC>
__device__ __forceinline__ void load_normed(const T* head, const T* norm_weight, float inv_rms, int dim,
                                            float (&x)[VEC]) {
  load_floats<VEC>(head + dim, x);
  if (norm_weight == nullptr) return;
  float w[VEC];
  load_floats<VEC>(norm_weight + dim, w);
#pragma unroll
  for (int i = 0; i < VEC; ++i) x[i] = to_float(from_float<T>(__fmul_rn(__fmul_rn(x[i], inv_rms), w[i])));
}

// x = dims [dim, dim + VEC) of the (normalised) head, neox-rotated where dim <
// rotary_dim: out = x * cos + sign * partner * sin, sign = -1 for the first half.
// Each chunk reads its rotation partner chunk itself.
template <typename T, int VEC>
__device__ __forceinline__ void rotated_chunk(float (&x)[VEC], const T* head, const T* norm_weight, float inv_rms,
                                              const float* cos_sin_row, int dim, int rotary_dim) {
  load_normed<T, VEC>(head, norm_weight, inv_rms, dim, x);
  if (dim >= rotary_dim) return;
  const int half = rotary_dim / 2;
  const bool first_half = dim < half;
  const int freq = first_half ? dim : dim - half;
  float partner[VEC], cos_v[VEC], sin_v[VEC];
  load_normed<T, VEC>(head, norm_weight, inv_rms, first_half ? dim + half : freq, partner);
  load_floats<VEC>(cos_sin_row + freq, cos_v);
  load_floats<VEC>(cos_sin_row + half + freq, sin_v);
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float rotated = __fmul_rn(partner[i], sin_v[i]);
    x[i] = __fmaf_rn(x[i], cos_v[i], first_half ? -rotated : rotated);
  }
}

}  // namespace sparkd
