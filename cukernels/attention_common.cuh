// Building blocks of the paged attention kernels (attention_prefill.cu,
// attention_decode.cu): packed query rows, paged K/V addressing, cp.async
// tile loads, a multi-stage load/compute pipeline, the per-warp tensor-core
// steps of flash attention (S = Q K^T, online softmax, O += P V), and the
// fp32 CUDA-core equivalent.
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

// One sequence's keys and values for one kv head in the paged caches.
template <typename T, int D>
struct PagedKV {
  const T* k;               // k_cache + kv_head * BS * D
  const T* v;               // v_cache + kv_head * BS * D
  const int* block_table;   // the sequence's row of block_tables
  int block_size;           // BS
  long long block_stride;   // elements per block: Hkv * BS * D

  __device__ long long offset(int key) const {
    return static_cast<long long>(block_table[key / block_size]) * block_stride +
           static_cast<long long>(key % block_size) * D;
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

// Copies 16 bytes global -> shared, or zero-fills them when !valid (src is not read).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
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
// keys >= key_end are zeroed, so padding never feeds NaN garbage into P V.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_kv_tile(T* k_dst, T* v_dst, const PagedKV<T, D>& kv, int key0, int key_end) {
  constexpr int kVec = 16 / sizeof(T), kChunks = D / kVec, LD = smem_ld<T, D>();
#pragma unroll
  for (int i = 0; i < ceil_div(ROWS * kChunks, kThreads); ++i) {
    const int c = threadIdx.x + i * kThreads;
    if (c >= ROWS * kChunks) break;
    const int r = c / kChunks, col = (c % kChunks) * kVec;
    const int key = key0 + r;
    const bool valid = key < key_end;
    const long long src = valid ? kv.offset(key) + col : 0;
    cp_async_16(k_dst + r * LD + col, kv.k + src, valid);
    cp_async_16(v_dst + r * LD + col, kv.v + src, valid);
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

// ---- tensor cores: mma.sync m16n8k16, fp32 accumulators ----
//
// Fragment layouts (PTX ISA), g = lane / 4, c = lane % 4:
//   A 16x16 (4 regs): {row g, cols 2c..2c+1}, {row g+8, same}, {row g, cols 2c+8..}, {row g+8, cols 2c+8..}
//   B 16x8  (2 regs): {rows 2c..2c+1, col g}, {rows 2c+8..2c+9, col g}
//   C 16x8  (4 f32):  (g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1)

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                                        unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned short bits_of(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ unsigned short bits_of(__half x) { return __half_as_ushort(x); }

// Two floats rounded to T and packed in one register, `lo` in the low half (mma operand order).
template <typename T>
__device__ __forceinline__ unsigned pack_pair(float lo, float hi) {
  return bits_of(from_float<T>(lo)) | static_cast<unsigned>(bits_of(from_float<T>(hi))) << 16;
}

// ---- one warp's flash-attention steps on MT m-tiles (16 query rows each) ----
//
// s[mt][nt][e] holds scores of m-tile mt and key n-tile nt (8 keys); o[mt][dt][e]
// the output of m-tile mt and dim n-tile dt. Element e sits at row g + 8 * (e / 2),
// column 2c + e % 2 of its tile. m and l hold each row's running max and sum
// (l only over this lane's columns until finish_rows reduces it).

// s = Q K^T for q_rows [MT * 16][LD] and keys [NT * 8][LD] in shared memory.
template <typename T, int D, int MT, int NT>
__device__ __forceinline__ void warp_qk(float (&s)[MT][NT][4], const T* q_rows, const T* keys, int lane) {
  static_assert(NT % 2 == 0, "keys come in pairs of n-tiles (16 keys)");
  constexpr int LD = smem_ld<T, D>();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
  for (int k0 = 0; k0 < D; k0 += 16) {
    unsigned a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      ldmatrix_x4(a[mt], q_rows + (mt * 16 + lane % 16) * LD + k0 + (lane / 16) * 8);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      // Matrices: keys 0-7 dims 0-7, keys 0-7 dims 8-15, keys 8-15 dims 0-7, keys 8-15 dims 8-15.
      unsigned b[4];
      ldmatrix_x4(b, keys + (np * 16 + lane % 8 + (lane / 16) * 8) * LD + k0 + ((lane / 8) % 2) * 8);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<T>(s[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Scales scores to log2 units; with `masked`, keys past a row's last_key become -inf.
template <int MT, int NT>
__device__ __forceinline__ void scale_and_mask(float (&s)[MT][NT][4], float scale_log2, bool masked, int key0,
                                               const int (&last_key)[MT][2], int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + nt * 8 + (lane % 4) * 2 + e % 2;
        s[mt][nt][e] = masked && key > last_key[mt][e / 2] ? -infinity() : s[mt][nt][e] * scale_log2;
      }
}

// Online softmax: folds the tile's scores into (m, l), rescales o, and turns s into P.
template <int MT, int NT, int DT>
__device__ __forceinline__ void online_softmax(float (&s)[MT][NT][4], float (&m)[MT][2], float (&l)[MT][2],
                                               float (&o)[MT][DT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float tile_max = -infinity();
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) tile_max = fmaxf(tile_max, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
      // The 4 lanes of a quad hold one row.
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
      const float m_new = fmaxf(m[mt][half], tile_max);
      // A row with every key masked so far keeps m = -inf; subtracting 0 keeps P = 0, not NaN.
      const float ref = m_new == -infinity() ? 0.f : m_new;
      const float rescale = exp2f(m[mt][half] - ref);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          s[mt][nt][e] = exp2f(s[mt][nt][e] - ref);
          sum += s[mt][nt][e];
        }
      l[mt][half] = l[mt][half] * rescale + sum;
      m[mt][half] = m_new;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        o[mt][dt][2 * half] *= rescale;
        o[mt][dt][2 * half + 1] *= rescale;
      }
    }
}

// o += P V for P (in s, accumulator layout) and values [NT * 8][LD] in shared memory.
template <typename T, int D, int MT, int NT>
__device__ __forceinline__ void warp_pv(float (&o)[MT][D / 8][4], const float (&p)[MT][NT][4], const T* values,
                                        int lane) {
  constexpr int LD = smem_ld<T, D>();
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    // The C layout of two key n-tiles is the A layout of one 16-key k-step.
    unsigned a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      a[mt][0] = pack_pair<T>(p[mt][2 * kk][0], p[mt][2 * kk][1]);
      a[mt][1] = pack_pair<T>(p[mt][2 * kk][2], p[mt][2 * kk][3]);
      a[mt][2] = pack_pair<T>(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
      a[mt][3] = pack_pair<T>(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int d0 = 0; d0 < D; d0 += 16) {
      // Transposed matrices: keys 0-7 dims 0-7, keys 8-15 dims 0-7, keys 0-7 dims 8-15, keys 8-15 dims 8-15.
      unsigned b[4];
      ldmatrix_x4_trans(b, values + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD + d0 + (lane / 16) * 8);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<T>(o[mt][d0 / 8], a[mt], b[0], b[1]);
        mma_16816<T>(o[mt][d0 / 8 + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Completes each row's sum over the 4 lanes of its quad.
template <int MT>
__device__ __forceinline__ void finish_rows(float (&l)[MT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      l[mt][half] += __shfl_xor_sync(kFullMask, l[mt][half], 1);
      l[mt][half] += __shfl_xor_sync(kFullMask, l[mt][half], 2);
    }
}

// ---- fp32 on CUDA cores (exact path: no tensor cores, no TF32) ----
//
// A warp owns kFp32RowsPerWarp query rows. For Q K^T each lane takes one key of
// the 32-key tile; for P V each lane takes the dims lane, lane + 32, ...

constexpr int kFp32RowsPerWarp = 4;
constexpr int kFp32Rows = kWarps * kFp32RowsPerWarp;  // query rows per block
constexpr int kFp32Keys = 32;                          // keys per tile

template <int D>
struct Fp32Rows {
  static constexpr int R = kFp32RowsPerWarp, DL = D / 32;  // rows, dims per lane
  float o[R][DL];
  float m[R];  // running max, log2 units (identical in every lane)
  float l[R];  // running sum (identical in every lane)
};

// Attends the warp's rows (q_rows [R][D] in shared memory, already loaded or in
// flight) to keys [key_begin, key_end), row r seeing only keys <= last_key[r].
// smem_kv holds one K tile and one V tile [kFp32Keys][smem_ld]. All threads call it.
template <int D>
__device__ __forceinline__ void fp32_attend(Fp32Rows<D>& st, const float* q_rows, float* smem_kv,
                                            const PagedKV<float, D>& kv, int key_begin, int key_end,
                                            const int (&last_key)[kFp32RowsPerWarp], float scale_log2) {
  constexpr int R = kFp32RowsPerWarp, DL = D / 32, LD = smem_ld<float, D>();
  float* k_tile = smem_kv;
  float* v_tile = smem_kv + kFp32Keys * LD;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    st.m[r] = -infinity();
    st.l[r] = 0.f;
#pragma unroll
    for (int i = 0; i < DL; ++i) st.o[r][i] = 0.f;
  }
  pipelined_tiles<1>(
      ceil_div(key_end - key_begin, kFp32Keys),
      [&](int t, int) { load_kv_tile<float, D, kFp32Keys>(k_tile, v_tile, kv, key_begin + t * kFp32Keys, key_end); },
      [&](int t, int) {
        const int key = key_begin + t * kFp32Keys + lane;
        float s[R];
#pragma unroll
        for (int r = 0; r < R; ++r) s[r] = 0.f;
        // The pad of smem_ld puts the 8 lanes of each float4 phase in distinct banks.
        for (int d = 0; d < D; d += 4) {
          const float4 k4 = *reinterpret_cast<const float4*>(k_tile + lane * LD + d);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const float4 q4 = *reinterpret_cast<const float4*>(q_rows + r * LD + d);
            s[r] = fmaf(q4.x, k4.x, fmaf(q4.y, k4.y, fmaf(q4.z, k4.z, fmaf(q4.w, k4.w, s[r]))));
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          s[r] = key < key_end && key <= last_key[r] ? s[r] * scale_log2 : -infinity();
          const float m_new = fmaxf(st.m[r], warp_reduce(s[r], MaxOp()));
          const float ref = m_new == -infinity() ? 0.f : m_new;
          const float rescale = exp2f(st.m[r] - ref);
          s[r] = exp2f(s[r] - ref);
          st.l[r] = st.l[r] * rescale + warp_reduce(s[r], SumOp());
          st.m[r] = m_new;
#pragma unroll
          for (int i = 0; i < DL; ++i) st.o[r][i] *= rescale;
        }
        for (int j = 0; j < kFp32Keys; ++j) {
          float v[DL];
#pragma unroll
          for (int i = 0; i < DL; ++i) v[i] = v_tile[j * LD + lane + 32 * i];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const float p = __shfl_sync(kFullMask, s[r], j);
#pragma unroll
            for (int i = 0; i < DL; ++i) st.o[r][i] = fmaf(p, v[i], st.o[r][i]);
          }
        }
      });
}

}  // namespace attn
}  // namespace sparkd
