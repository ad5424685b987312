// Building blocks shared by the paged attention kernels (attention_prefill.cu,
// attention_decode.cu): packed query rows, paged K/V addressing, cp.async
// tile loads and a multi-stage load/compute pipeline. The per-warp math lives
// in attention_mma.cuh (tensor cores) and attention_fp32.cuh (CUDA cores).
//
// Layouts: q, out [T, Hq, D]; k_cache, v_cache [NB, Hkv, BS, D]; key j of a
// sequence sits in block block_table[j / BS], row j % BS.
//
// Query rows are "packed": the rows of one (sequence, kv head) are numbered
// row = token * group + head_in_group (group = Hq / Hkv), so every query head
// that shares a kv head reads each K/V tile once (GQA). Decode is the case of
// one token, where the rows are the group's heads.
//
// Softmax runs in base 2: scores are scaled by scale * log2(e) once, so every
// exponential is a single exp2f. All softmax state is fp32.
#pragma once

#include "common.cuh"

namespace sparkd {
namespace attn {

constexpr int kWarps = 4;  // every attention kernel runs 4 warps
constexpr int kThreads = kWarps * 32;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Shared-memory row stride in elements: one 16-byte pad per row, so the 8 rows
// read by one ldmatrix (or one float4 phase) fall in distinct banks.
template <typename T, int D>
__host__ __device__ constexpr int smem_ld() { return D + 16 / static_cast<int>(sizeof(T)); }

// ---- packed query rows ----

// The query rows of one (sequence, kv head): row = token * group + head_in_group.
struct PackedRows {
  int q_begin;      // row in T of the sequence's first new token
  int q_len;        // new tokens of the sequence in this step
  int group;        // query heads per kv head
  int first_head;   // kv_head * group
  int num_q_heads;  // Hq
  int context;      // cached tokens before the first new one: seq_len - q_len

  __device__ int count() const { return q_len * group; }
  // Position of the row's token. Rows past count() are clamped to the last
  // token, so they compute finite values that are never stored.
  __device__ int position(int row) const { return context + min(row / group, q_len - 1); }
  // Element offset of the row's D values in q or out [T, Hq, D].
  __device__ long long offset(int row, int head_dim) const {
    return (static_cast<long long>(q_begin + row / group) * num_q_heads + first_head + row % group) * head_dim;
  }
};

__device__ __forceinline__ PackedRows packed_rows(const int* query_start_loc, const int* seq_lens, int seq,
                                                  int kv_head, int num_q_heads, int num_kv_heads) {
  PackedRows rows;
  rows.q_begin = query_start_loc[seq];
  rows.q_len = query_start_loc[seq + 1] - rows.q_begin;
  rows.group = num_q_heads / num_kv_heads;
  rows.first_head = kv_head * rows.group;
  rows.num_q_heads = num_q_heads;
  rows.context = seq_lens[seq] - rows.q_len;
  return rows;
}

// ---- paged K/V ----

// A key the block computed itself (decode with fused RoPE: the step's new key):
// load_kv_tile takes key `key` from k and v [D] in shared memory instead of the
// cache. key -1: every key comes from the cache.
template <typename T>
struct FreshKey {
  int key = -1;
  const T* k = nullptr;
  const T* v = nullptr;
};

// One sequence's keys and values for one kv head in the paged caches.
template <typename T, int D>
struct PagedKV {
  const T* k;               // k_cache + kv_head * BS * D
  const T* v;               // v_cache + kv_head * BS * D
  const int* block_table;   // the sequence's row of block_tables
  int block_size;           // BS
  long long block_stride;   // elements per block: Hkv * BS * D
  FreshKey<T> fresh;        // none unless the block sets one

  // Element offset of row `row` of the sequence's block `block` (key block * BS + row).
  __device__ long long offset(int block, int row) const {
    return static_cast<long long>(block_table[block]) * block_stride + static_cast<long long>(row) * D;
  }
};

template <typename T, int D>
__device__ __forceinline__ PagedKV<T, D> paged_kv(const T* k_cache, const T* v_cache, const int* block_tables,
                                                 int max_blocks_per_seq, int seq, int kv_head, int num_kv_heads,
                                                 int block_size) {
  const long long head_offset = static_cast<long long>(kv_head) * block_size * D;
  return {k_cache + head_offset, v_cache + head_offset,
          block_tables + static_cast<long long>(seq) * max_blocks_per_seq, block_size,
          static_cast<long long>(num_kv_heads) * block_size * D};
}

// ---- cp.async ----

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes global -> shared, or zero-fills them when !valid (src is not read).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `pending` of this thread's committed groups are in flight.
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
}

// Starts loading ROWS query rows into dst [ROWS][smem_ld]; rows >= rows.count() are zeroed.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_query_rows(T* dst, const T* q, const PackedRows& rows, int first_row) {
  constexpr int kVec = 16 / sizeof(T), kChunks = D / kVec, LD = smem_ld<T, D>();
#pragma unroll
  for (int i = 0; i < ceil_div(ROWS * kChunks, kThreads); ++i) {
    const int c = threadIdx.x + i * kThreads;
    if (c >= ROWS * kChunks) break;
    const int r = c / kChunks, col = (c % kChunks) * kVec;
    const int row = first_row + r;
    const bool valid = row < rows.count();
    cp_async_16(dst + r * LD + col, valid ? q + rows.offset(row, D) + col : q, valid);
  }
}

// Starts loading keys [key0, key0 + ROWS) into k_dst, v_dst [ROWS][smem_ld];
// keys >= key_end are zeroed, so padding never feeds NaN garbage into P V. The
// fresh key, if any, is copied from shared memory at once; like the copies in
// flight, it is visible to the block after its next barrier.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_kv_tile(T* k_dst, T* v_dst, const PagedKV<T, D>& kv, int key0, int key_end) {
  constexpr int kVec = 16 / sizeof(T), kChunks = D / kVec, LD = smem_ld<T, D>();
  static_assert(kThreads % kChunks == 0, "each thread keeps one 16-byte column of the tile");
  constexpr int kRowStep = kThreads / kChunks;
  const int col = (threadIdx.x % kChunks) * kVec;
  int r = threadIdx.x / kChunks;
  // One division for the thread's first key, then its later keys step through the
  // blocks: dividing by the run-time block size per copy cost more than the copies.
  int block = (key0 + r) / kv.block_size, row = (key0 + r) % kv.block_size;
#pragma unroll
  for (int i = 0; i < ceil_div(ROWS, kRowStep); ++i, r += kRowStep) {
    if (r >= ROWS) break;
    if (key0 + r == kv.fresh.key) {
      *reinterpret_cast<uint4*>(k_dst + r * LD + col) = *reinterpret_cast<const uint4*>(kv.fresh.k + col);
      *reinterpret_cast<uint4*>(v_dst + r * LD + col) = *reinterpret_cast<const uint4*>(kv.fresh.v + col);
    } else {
      const bool valid = key0 + r < key_end;
      const long long src = valid ? kv.offset(block, row) + col : 0;
      cp_async_16(k_dst + r * LD + col, kv.k + src, valid);
      cp_async_16(v_dst + r * LD + col, kv.v + src, valid);
    }
    for (row += kRowStep; row >= kv.block_size; row -= kv.block_size) ++block;
  }
}

// Asks L2 for keys [key_begin, key_end) of K and V, without waiting: a block
// that has other work before its first tile load finds them there.
template <typename T, int D>
__device__ __forceinline__ void prefetch_kv_rows(const PagedKV<T, D>& kv, int key_begin, int key_end) {
  constexpr int kLines = D * static_cast<int>(sizeof(T)) / 128;  // 128-byte lines per row
  static_assert(kLines >= 1, "a row covers whole lines");
  for (int i = threadIdx.x; i < (key_end - key_begin) * kLines; i += kThreads) {
    const int key = key_begin + i / kLines;
    const long long offset = kv.offset(key / kv.block_size, key % kv.block_size) + (i % kLines) * (128 / sizeof(T));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(kv.k + offset));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(kv.v + offset));
  }
}

// Runs compute(tile, stage) for tiles 0..num_tiles-1 while load(tile, stage)
// keeps up to STAGES - 1 later tiles in flight. Copies issued before the call
// (the query rows) complete with tile 0. Every thread of the block must call it.
template <int STAGES, typename Load, typename Compute>
__device__ __forceinline__ void pipelined_tiles(int num_tiles, Load load, Compute compute) {
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_tiles) load(s, s);
    cp_async_commit();
  }
  for (int t = 0; t < num_tiles; ++t) {
    const int ahead = t + STAGES - 1;
    if (ahead < num_tiles) load(ahead, ahead % STAGES);
    cp_async_commit();  // possibly empty: keeps one group per tile for the count below
    cp_async_wait<STAGES - 1>();
    __syncthreads();
    compute(t, t % STAGES);
    __syncthreads();  // the stage is overwritten by a later load
  }
}

}  // namespace attn
}  // namespace sparkd
