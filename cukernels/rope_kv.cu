// Rotary embedding (neox rotate-half, partial rotary) fused with the paged
// KV-cache write, optionally after a per-head RMSNorm of q and k (Qwen3's
// q_norm / k_norm).
//
// For a head vector x of head_dim values and half = rotary_dim / 2, at token
// position p with c = cos_sin[p, i] and s = cos_sin[p, half + i]:
//   out[i]        = x[i] * c - x[i + half] * s      i <  half
//   out[i + half] = x[i + half] * c + x[i] * s      i <  half
//   out[i]        = x[i]                            i >= rotary_dim
// The host builds cos_sin [max_pos, rotary_dim] float32 from the already
// scaled inv_freq (llama3 scaling) and multiplies in the attention scaling.
//
// With norm weights, every q and k head is first replaced by
//   x = round_T(x / sqrt(mean(x^2) + eps) * weight)      (over all head_dim values)
// computed as rmsnorm_kernel (norm.cu) does and rounded to T where it stores, so
// the fused launch equals rmsnorm followed by the plain rotation.
//
// Rotated q goes to q_out [T, Hq, D]; rotated k and plain v go to the caches
// [NB, Hkv, BS, D] at slot = slot_mapping[t] = block * BS + offset; a negative
// slot skips the cache write (padding tokens).
#include "rope_common.cuh"

using namespace sparkd;

// Writes kVec consecutive outputs of one head, starting at dim, from head vector src
// (normalised first when norm_weight is set): rope_common.cuh's rotated_chunk.
template <typename T, int kVec>
__device__ __forceinline__ void store_rotated_chunk(T* dst, const T* src, const T* norm_weight, float inv_rms,
                                                    const float* cos_sin_row, int dim, int rotary_dim) {
  float x[kVec];
  rotated_chunk<T, kVec>(x, src, norm_weight, inv_rms, cos_sin_row, dim, rotary_dim);
  store_floats<kVec>(dst + dim, x);
}

// inv_rms[h] = 1 / sqrt(mean(x_h^2) + eps) for the token's q heads h < Hq and its
// k heads Hq + j (head_inv_rms: a group of lanes_per_head lanes per head, so a
// warp's groups share their passes and shuffles). Every thread of the block must
// call it; blockDim.x is a multiple of 32.
template <typename T, int kVec>
__device__ __forceinline__ void token_inv_rms(float* __restrict__ inv_rms, const T* q_row, const T* k_row,
                                              int num_q_heads, int num_kv_heads, int head_dim, float eps) {
  const int lanes = lanes_per_head(head_dim / kVec);
  const int group = threadIdx.x / lanes, lane = threadIdx.x % lanes;
  const int num_groups = blockDim.x / lanes, num_heads = num_q_heads + num_kv_heads;
  for (int first = 0; first < num_heads; first += num_groups) {  // the same passes for every thread
    const int head = first + group;
    const T* src = head >= num_heads     ? nullptr
                   : head < num_q_heads ? q_row + head * head_dim
                                        : k_row + (head - num_q_heads) * head_dim;
    const float value = head_inv_rms<T, kVec>(src, head_dim, lane, lanes, eps);
    if (src != nullptr && lane == 0) inv_rms[head] = value;
  }
  __syncthreads();
}

// q: [T, Hq, D] at row stride q_stride; k, v: [T, Hkv, D] at k_stride, v_stride
// (elements; heads contiguous inside a row, so strided views of the fused qkv
// GEMM output work). positions, slot_mapping: [T] int32. q_norm, k_norm: [D], or
// both null for no norm; with them the launch passes (Hq + Hkv) floats of dynamic
// shared memory.
// Launch: grid = T blocks (one token each), block = a multiple of 32, at most
// 256 threads, striding the (Hq + 2 Hkv) * D / kVec output chunks of the token.
template <typename T, int kVec>
__global__ void rope_write_kv_kernel(T* __restrict__ q_out, T* __restrict__ k_cache, T* __restrict__ v_cache,
                                     const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                     const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                                     const float* __restrict__ cos_sin, const T* __restrict__ q_norm,
                                     const T* __restrict__ k_norm, float eps, int num_q_heads, int num_kv_heads,
                                     int head_dim, int rotary_dim, int block_size, long long q_stride,
                                     long long k_stride, long long v_stride) {
  extern __shared__ float inv_rms[];  // [Hq + Hkv] with norm weights, else unused
  const int token = blockIdx.x;
  const T* q_row = q + token * q_stride;
  const T* k_row = k + token * k_stride;
  if (q_norm != nullptr) token_inv_rms<T, kVec>(inv_rms, q_row, k_row, num_q_heads, num_kv_heads, head_dim, eps);
  const float* cos_sin_row = cos_sin + static_cast<long long>(positions[token]) * rotary_dim;
  const int slot = slot_mapping[token];
  const long long cache_block = slot / block_size;
  const int cache_offset = slot % block_size;
  const int chunks_per_head = head_dim / kVec;
  const int num_heads = num_q_heads + 2 * num_kv_heads;
  for (int item = threadIdx.x; item < num_heads * chunks_per_head; item += blockDim.x) {
    const int head = item / chunks_per_head;
    const int dim = (item % chunks_per_head) * kVec;
    if (head < num_q_heads) {
      store_rotated_chunk<T, kVec>(q_out + (static_cast<long long>(token) * num_q_heads + head) * head_dim,
                                   q_row + head * head_dim, q_norm, q_norm != nullptr ? inv_rms[head] : 1.f,
                                   cos_sin_row, dim, rotary_dim);
      continue;
    }
    if (slot < 0) continue;
    const bool is_k = head < num_q_heads + num_kv_heads;
    const int kv_head = head - num_q_heads - (is_k ? 0 : num_kv_heads);
    const long long cache_row = ((cache_block * num_kv_heads + kv_head) * block_size + cache_offset) * head_dim;
    if (is_k) {
      store_rotated_chunk<T, kVec>(k_cache + cache_row, k_row + kv_head * head_dim, k_norm,
                                   k_norm != nullptr ? inv_rms[num_q_heads + kv_head] : 1.f, cos_sin_row, dim,
                                   rotary_dim);
    } else {
      float x[kVec];
      load_floats<kVec>(v + token * v_stride + kv_head * head_dim + dim, x);
      store_floats<kVec>(v_cache + cache_row + dim, x);
    }
  }
}
