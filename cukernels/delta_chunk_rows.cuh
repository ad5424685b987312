// A chunk's rows moved into shared memory for the chunked delta rule's kernels
// (delta_rule_chunked.cu): through registers (ChunkRows, converting to float on the way) or
// straight (copy_chunk_rows_async, float32 sources). kChunk rows a tile.
#pragma once

#include "attention_common.cuh"  // cp.async
#include "delta_net_common.cuh"
#include "mma_tf32.cuh"

namespace sparkd {

constexpr int kChunk = 64;

struct AsIs {
  __device__ __forceinline__ float operator()(float x) const { return x; }
};

// The operands of many products, stored rounded for them (mma_tf32.cuh's keep_tf32).
template <int kTerms>
struct KeepTf32 {
  __device__ __forceinline__ float operator()(float x) const { return keep_tf32<kTerms>(x); }
};

// A thread's share of rows [0, kChunk) x columns [0, kCols) of a row-major source (row i at
// src + i * ld_src), in two steps so that several tiles' loads are in flight together: load()
// into registers, zeros at rows >= n and columns >= width (a multiple of 4, as ld_src and src's
// offset), then store() into dst[i * ld_dst + c] as floats (through op).
template <int kCols, int kThreads, typename T>
struct ChunkRows {
  static constexpr int kQuadsPerRow = kCols / 4, kPerThread = kChunk * kQuadsPerRow / kThreads;
  static_assert(kChunk * kQuadsPerRow % kThreads == 0, "the tile splits evenly over the threads");
  Pack<T, 4> quads[kPerThread];

  __device__ __forceinline__ static int row(int m) { return (threadIdx.x + m * kThreads) / kQuadsPerRow; }
  __device__ __forceinline__ static int col(int m) { return 4 * ((threadIdx.x + m * kThreads) % kQuadsPerRow); }

  __device__ __forceinline__ void load(const T* src, long long ld_src, int n, int width) {
#pragma unroll
    for (int m = 0; m < kPerThread; ++m) {
      if (row(m) < n && col(m) < width) {
        quads[m] = *reinterpret_cast<const Pack<T, 4>*>(src + row(m) * ld_src + col(m));
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) quads[m].v[e] = from_float<T>(0.f);
      }
    }
  }

  template <typename Op = AsIs>
  __device__ __forceinline__ void store(float* dst, int ld_dst, Op op = {}) const {
#pragma unroll
    for (int m = 0; m < kPerThread; ++m) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[row(m) * ld_dst + col(m) + e] = op(to_float(quads[m].v[e]));
    }
  }
};

// The same rows of a float32 source copied straight into shared memory (cp.async, zero-filled
// past n and width); the caller commits and waits.
template <int kCols, int kThreads>
__device__ __forceinline__ void copy_chunk_rows_async(float* dst, int ld_dst, const float* src, long long ld_src, int n,
                                                      int width) {
  using Rows = ChunkRows<kCols, kThreads, float>;
#pragma unroll
  for (int m = 0; m < Rows::kPerThread; ++m) {
    const int i = Rows::row(m), c = Rows::col(m);
    const bool valid = i < n && c < width;
    attn::cp_async_16(dst + i * ld_dst + c, valid ? src + i * ld_src + c : src, valid);
  }
}

}  // namespace sparkd
