// Rotary embedding (neox rotate-half, partial rotary) fused with the paged
// KV-cache write.
//
// For a head vector x of head_dim values and half = rotary_dim / 2, at token
// position p with c = cos_sin[p, i] and s = cos_sin[p, half + i]:
//   out[i]        = x[i] * c - x[i + half] * s      i <  half
//   out[i + half] = x[i + half] * c + x[i] * s      i <  half
//   out[i]        = x[i]                            i >= rotary_dim
// The host builds cos_sin [max_pos, rotary_dim] float32 from the already
// scaled inv_freq (llama3 scaling) and multiplies in the attention scaling.
//
// Rotated q goes to q_out [T, Hq, D]; rotated k and plain v go to the caches
// [NB, Hkv, BS, D] at slot = slot_mapping[t] = block * BS + offset; a negative
// slot skips the cache write (padding tokens).
#include "common.cuh"

using namespace sparkd;

// Writes kVec consecutive outputs of one head, starting at dim, from head
// vector src. Each chunk reads its rotation partner chunk itself, so every
// thread produces exactly one output chunk.
template <typename T, int kVec>
__device__ __forceinline__ void rotate_chunk(T* dst, const T* src, const float* cos_sin_row, int dim,
                                             int rotary_dim) {
  float x[kVec];
  load_floats<kVec>(src + dim, x);
  if (dim < rotary_dim) {
    const int half = rotary_dim / 2;
    const bool first_half = dim < half;
    const int freq = first_half ? dim : dim - half;
    float partner[kVec], cos_v[kVec], sin_v[kVec];
    load_floats<kVec>(src + (first_half ? dim + half : freq), partner);
    load_floats<kVec>(cos_sin_row + freq, cos_v);
    load_floats<kVec>(cos_sin_row + half + freq, sin_v);
    // out = x * cos + sign * partner * sin, sign = -1 for the first half.
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float rotated = partner[i] * sin_v[i];
      x[i] = x[i] * cos_v[i] + (first_half ? -rotated : rotated);
    }
  }
  store_floats<kVec>(dst + dim, x);
}

// q: [T, Hq, D] at row stride q_stride; k, v: [T, Hkv, D] at k_stride, v_stride
// (elements; heads contiguous inside a row, so strided views of the fused qkv
// GEMM output work). positions, slot_mapping: [T] int32.
// Launch: grid = T blocks (one token each), block = 128..256 threads striding
// the (Hq + 2 Hkv) * D / kVec output chunks of the token.
template <typename T, int kVec>
__global__ void rope_write_kv_kernel(T* __restrict__ q_out, T* __restrict__ k_cache, T* __restrict__ v_cache,
                                     const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                     const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                                     const float* __restrict__ cos_sin, int num_q_heads, int num_kv_heads,
                                     int head_dim, int rotary_dim, int block_size, long long q_stride,
                                     long long k_stride, long long v_stride) {
  const int token = blockIdx.x;
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
      rotate_chunk<T, kVec>(q_out + (static_cast<long long>(token) * num_q_heads + head) * head_dim,
                            q + token * q_stride + head * head_dim, cos_sin_row, dim, rotary_dim);
      continue;
    }
    if (slot < 0) continue;
    const bool is_k = head < num_q_heads + num_kv_heads;
    const int kv_head = head - num_q_heads - (is_k ? 0 : num_kv_heads);
    const long long cache_row = ((cache_block * num_kv_heads + kv_head) * block_size + cache_offset) * head_dim;
    if (is_k) {
      rotate_chunk<T, kVec>(k_cache + cache_row, k + token * k_stride + kv_head * head_dim, cos_sin_row, dim,
                            rotary_dim);
    } else {
      float x[kVec];
      load_floats<kVec>(v + token * v_stride + kv_head * head_dim + dim, x);
      store_floats<kVec>(v_cache + cache_row + dim, x);
    }
  }
}
