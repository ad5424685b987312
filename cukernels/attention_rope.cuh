// Where a decode block's query rows come from (attention_decode.cu): q already
// rotated (StoredQuery), or the step's un-rotated q, k and v, which the block
// rotates itself, with the KV-cache write fused in (RopeQuery).
//
// RopeQuery shares rope_write_kv_kernel's arithmetic (rope_common.cuh: the sums of
// squares, the norm and the rotation, at its 16-byte vector width: the launcher only
// fuses when that kernel would use the same width). So the rotated q, the cache
// contents and the attention output equal rope_write_kv followed by decode
// attention, bit for bit.
#pragma once

#include "attention_split.cuh"
#include "rope_common.cuh"

namespace sparkd {
namespace attn {

// q [B, Hq, D] contiguous, rotated: cp.async straight into the tile.
template <typename T, int D>
struct StoredQuery {
  const T* q;

  // Starts loading the block's rows into q_tile [kDecodeRows][smem_ld]; they land with the first K/V tile.
  __device__ void load(T* q_tile, T*, PagedKV<T, D>&, const PackedRows& rows, int first_row,
                       const DecodeSplit&) const {
    load_query_rows<T, D, kDecodeRows>(q_tile, q, rows, first_row);
  }
};

// Keys a RopeQuery block asks L2 for before it rotates: two bf16 decode tiles.
constexpr int kRopePrefetchKeys = 128;

// Elements per access of RopeQuery: one 16-byte vector.
template <typename T>
__host__ __device__ constexpr int rope_vec() { return 16 / static_cast<int>(sizeof(T)); }

// Shared memory RopeQuery needs besides the tiles: the fresh key and value
// [smem_ld] each, then one inverse RMS per query row and one for the key.
template <typename T, int D>
__host__ __device__ constexpr int rope_scratch_bytes() {
  return 2 * smem_ld<T, D>() * static_cast<int>(sizeof(T)) + (kDecodeRows + 1) * 4;
}

// 1 / sqrt(mean(x^2) + eps) of the block's num_q query heads (q_first + h * D)
// into inv_rms[h], and of k_head (when not null) into inv_rms[kDecodeRows]: each
// head by head_inv_rms, as rope_write_kv_kernel reduces it. Every thread calls it.
template <typename T, int D>
__device__ __forceinline__ void rope_inv_rms(float* inv_rms, const T* q_first, int num_q, const T* k_head,
                                             float eps) {
  constexpr int VEC = rope_vec<T>(), LANES = lanes_per_head(D / VEC);
  const int group = threadIdx.x / LANES, lane = threadIdx.x % LANES;
  const int num_heads = num_q + (k_head != nullptr);
  for (int first = 0; first < num_heads; first += kThreads / LANES) {  // the same passes for every thread
    const int head = first + group;
    const T* src = head >= num_heads ? nullptr : head < num_q ? q_first + head * D : k_head;
    const float value = head_inv_rms<T, VEC>(src, D, lane, LANES, eps);
    if (src != nullptr && lane == 0) inv_rms[head < num_q ? head : kDecodeRows] = value;
  }
  __syncthreads();
}

// The step's un-rotated rows: q [B, Hq, D], k, v [B, Hkv, D] at row strides
// (views of the qkv GEMM output), heads contiguous in a row. Every block rotates
// (and normalises) its query heads on load; the block whose split holds the
// sequence's newest key (its last one, the new token's) rotates that key, uses it
// and the new value from shared memory, and, in the first head chunk, writes
// both to the caches at slot_mapping[token] (a negative slot: no write, and the
// key is read from the cache as decode attention alone would).
template <typename T, int D>
struct RopeQuery {
  const T* q;
  const T* k;
  const T* v;
  long long q_stride, k_stride, v_stride;  // elements per token row
  const int* positions;                    // [B]
  const int* slot_mapping;                 // [B]
  const float* cos_sin;                    // [P, rotary_dim]: cos | sin, attention scaling folded in
  const T* q_norm;                         // [D], or null (then k_norm is null too)
  const T* k_norm;
  float eps;
  int rotary_dim;
  T* k_cache;  // [NB, Hkv, BS, D]
  T* v_cache;

  // Fills q_tile [kDecodeRows][smem_ld] (rows past the group zeroed) and, in the
  // block holding the newest key, scratch (rope_scratch_bytes) and kv.fresh.
  // Every thread calls it; it ends with a barrier.
  __device__ void load(T* q_tile, T* scratch, PagedKV<T, D>& kv, const PackedRows& rows, int first_row,
                       const DecodeSplit& range) const {
    constexpr int VEC = rope_vec<T>(), CHUNKS = D / VEC, LD = smem_ld<T, D>();
    // The first keys' trip from memory overlaps the rotation (the tiles may only load after it).
    prefetch_kv_rows<T, D>(kv, range.key_begin, min(range.key_end, range.key_begin + kRopePrefetchKeys));
    const int token = rows.q_begin, seq_len = rows.context + rows.q_len, slot = slot_mapping[token];
    const int kv_head = rows.first_head / rows.group;
    const int num_rows = min(kDecodeRows, rows.count() - first_row);
    const bool fresh = slot >= 0 && range.key_begin < range.key_end && range.key_end == seq_len;
    const T* q_first = q + token * q_stride + static_cast<long long>(rows.first_head + first_row) * D;
    const T* k_head = k + token * k_stride + kv_head * D;
    const T* v_head = v + token * v_stride + kv_head * D;
    T* fresh_k = scratch;
    T* fresh_v = scratch + LD;
    float* inv_rms = reinterpret_cast<float*>(scratch + 2 * LD);
    if (q_norm != nullptr) rope_inv_rms<T, D>(inv_rms, q_first, num_rows, fresh ? k_head : nullptr, eps);

    const float* cos_sin_row = cos_sin + static_cast<long long>(positions[token]) * rotary_dim;
    const long long cache_row = static_cast<long long>(slot / kv.block_size) * kv.block_stride +
                                static_cast<long long>(kv_head * kv.block_size + slot % kv.block_size) * D;
    const bool writes_cache = fresh && first_row == 0;  // later head chunks compute the same key
    for (int item = threadIdx.x; item < (kDecodeRows + 2) * CHUNKS; item += kThreads) {
      const int row = item / CHUNKS, dim = (item % CHUNKS) * VEC;
      float x[VEC];
      if (row < kDecodeRows) {
        if (row < num_rows) {
          rotated_chunk<T, VEC>(x, q_first + row * D, q_norm, q_norm != nullptr ? inv_rms[row] : 1.f, cos_sin_row,
                               dim, rotary_dim);
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i) x[i] = 0.f;
        }
        store_floats<VEC>(q_tile + row * LD + dim, x);
        continue;
      }
      if (!fresh) continue;
      const bool is_k = row == kDecodeRows;
      if (is_k) {
        rotated_chunk<T, VEC>(x, k_head, k_norm, k_norm != nullptr ? inv_rms[kDecodeRows] : 1.f, cos_sin_row, dim,
                             rotary_dim);
      } else {
        load_floats<VEC>(v_head + dim, x);
      }
      store_floats<VEC>((is_k ? fresh_k : fresh_v) + dim, x);
      if (writes_cache) store_floats<VEC>((is_k ? k_cache : v_cache) + cache_row + dim, x);
    }
    if (fresh) kv.fresh = {seq_len - 1, fresh_k, fresh_v};
    __syncthreads();  // the rows and the fresh key are in shared memory before any tile copies them
  }
};

}  // namespace attn
}  // namespace sparkd
