// Paged attention for decode: one new query token per sequence, split-K over
// the context.
//
// q, out [B, Hq, D]: sequence b's one token is row query_start_loc[b];
// k_cache, v_cache [NB, Hkv, BS, D]; seq_lens [B]; block_tables [B, max_blocks_per_seq].
//
// A block owns up to 16 query heads of one kv head (GQA: K/V are read once for
// all of them) and one split of the sequence's keys (decode_split). Consecutive
// splits form a part. The bf16 / fp16 cluster kernel launches each part as a
// thread-block cluster that merges its splits in shared memory; the other
// kernels have parts of one split. A sequence that fits in one part is written
// directly. Otherwise every part leaves its normalised output and log-sum-exp
// in the workspace and counts itself in; the block that arrives last merges the
// parts into out (merge_parts), all in one launch. The grid and the workspace
// depend only on host-side sizes, and blocks past a sequence's used parts exit
// at once, so a graph planned for long contexts replays a short one at about
// the cost of its one part.
//
// The *_rope kernels take the step's un-rotated q, k and v instead of q and do
// rope_write_kv's work themselves (RopeQuery, attention_rope.cuh): one launch
// for a decode-only step.
#include "attention_fp32.cuh"
#include "attention_mma.cuh"
#include "attention_rope.cuh"

using namespace sparkd;
using namespace sparkd::attn;

// Arrivals per (sequence, kv head, head chunk) of a split launch (arrive_last).
// Zero when the module loads, and zero again after every launch. Launches that
// split must therefore not run concurrently (sparkd runs all work on one
// stream); the launcher splits only grids of at most kMaxDecodeCounters
// (DECODE_COUNTERS in attention_plan.py) unsplit blocks.
constexpr int kMaxDecodeCounters = 4096;
__device__ unsigned decode_arrivals[kMaxDecodeCounters];

// The counter of the block's (sequence, kv head, head chunk); grid.x = chunks * num_splits.
__device__ __forceinline__ unsigned* arrival_counter(int num_splits) {
  const int chunks = gridDim.x / num_splits;
  return decode_arrivals + (blockIdx.z * gridDim.y + blockIdx.y) * chunks + blockIdx.x / num_splits;
}

// ---- bf16 / fp16 on tensor cores ----

constexpr int kDecodeKeys = 64;  // keys per stage: 16 per warp

// Stages in flight per head dim; mirrored by _DECODE_TILES in attention_plan.py.
template <int D>
__host__ __device__ constexpr int decode_stages() { return D <= 128 ? 2 : 1; }

// The 16 heads are the rows of one m-tile; each warp takes 16 keys of every
// tile with its own softmax state; the warps, then the CLUSTER blocks of a part,
// are merged at the end. Block rank = split % CLUSTER, so grid.x = chunks *
// num_splits with num_splits a multiple of CLUSTER.
// Dynamic shared memory: max((16 + 2 * stages * 64) * (D + 8) * sizeof(T), (64 * D + 352) * 4) bytes,
// plus rope_scratch_bytes<T, D>() after the tiles with a RopeQuery.
template <typename T, int D, int CLUSTER, typename Query>
__device__ __forceinline__ void decode_attention(T* out, float* o_part, float* lse_part, const Query& query,
                                                 const T* k_cache,
                                                 const T* v_cache, const int* query_start_loc, const int* seq_lens,
                                                 const int* block_tables, int max_blocks_per_seq, int num_q_heads,
                                                 int num_kv_heads, int block_size, float scale_log2, int num_splits,
                                                 int min_split_keys) {
  constexpr int LD = smem_ld<T, D>(), DT = D / 8, KEYS = kDecodeKeys, WARP_KEYS = KEYS / kWarps;

  const int seq = blockIdx.z, kv_head = blockIdx.y, split = blockIdx.x % num_splits;
  const int first_row = blockIdx.x / num_splits * kDecodeRows;
  // The sequence's length and query row are read together, before the exit test.
  const PackedRows rows = packed_rows(query_start_loc, seq_lens, seq, kv_head, num_q_heads, num_kv_heads);
  const DecodeSplit range = decode_split(rows.context + rows.q_len, split, num_splits, CLUSTER, min_split_keys);
  // A part past the sequence's end leaves whole (every block of a cluster must
  // reach its barriers); inside a part, blocks with an empty split still merge.
  if (split / CLUSTER >= range.used_parts) return;
  const int num_rows = min(kDecodeRows, rows.count() - first_row);

  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float m[1][2] = {{-infinity(), -infinity()}}, l[1][2] = {{0.f, 0.f}}, o[1][DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[0][dt][e] = 0.f;

  if (range.key_begin < range.key_end) {
    T* q_tile = reinterpret_cast<T*>(smem);   // [16][LD]
    T* kv_tiles = q_tile + kDecodeRows * LD;  // per stage: K [KEYS][LD], then V [KEYS][LD]
    PagedKV<T, D> kv =
        paged_kv<T, D>(k_cache, v_cache, block_tables, max_blocks_per_seq, seq, kv_head, num_kv_heads, block_size);
    query.load(q_tile, kv_tiles + 2 * decode_stages<D>() * KEYS * LD, kv, rows, first_row, range);
    const int last_key[1][2] = {{range.key_end - 1, range.key_end - 1}};
    pipelined_tiles<decode_stages<D>()>(
        ceil_div(range.key_end - range.key_begin, KEYS),
        [&](int t, int stage) {
          T* k_tile = kv_tiles + stage * 2 * KEYS * LD;
          load_kv_tile<T, D, KEYS>(k_tile, k_tile + KEYS * LD, kv, range.key_begin + t * KEYS, range.key_end);
        },
        [&](int t, int stage) {
          const T* k_warp = kv_tiles + stage * 2 * KEYS * LD + warp * WARP_KEYS * LD;
          const int key0 = range.key_begin + t * KEYS + warp * WARP_KEYS;
          float s[1][WARP_KEYS / 8][4];
          warp_qk<T, D, 1, WARP_KEYS / 8>(s, q_tile, k_warp, lane);
          scale_and_mask(s, scale_log2, key0 + WARP_KEYS > range.key_end, key0, last_key, lane);
          online_softmax(s, m, l, o);
          warp_pv<T, D, 1, WARP_KEYS / 8>(o, s, k_warp + KEYS * LD, lane);
        });
  }
  finish_rows(l);

  // The pipeline's last barrier freed the tiles for the merges.
  const DecodeMergeSmem<D> sm(smem);
  merge_warps<D>(sm, m, l, o, num_rows);
  merge_cluster<T, D, CLUSTER>(sm, split % CLUSTER, out, o_part, lse_part, rows, first_row, seq, split / CLUSTER,
                               num_splits / CLUSTER, range.direct());
  // Every block of a used part stored a slice of it.
  if (!range.direct() && arrive_last(arrival_counter(num_splits), range.used_parts * CLUSTER))
    merge_parts<T, D>(out, o_part, lse_part, rows, first_row, seq, range.used_parts, num_splits / CLUSTER);
}

// ---- fp32 on CUDA cores, exact to rounding (no TF32) ----

// Every split is its own part.
// Dynamic shared memory (16 + 2 * 32) * (D + 4) * 4 bytes, plus
// rope_scratch_bytes<float, D>() after the tiles with a RopeQuery.
template <int D, typename Query>
__device__ __forceinline__ void decode_attention_fp32(float* out, float* o_part, float* lse_part, const Query& query,
                                                      const float* k_cache, const float* v_cache,
                                                      const int* query_start_loc, const int* seq_lens,
                                                      const int* block_tables, int max_blocks_per_seq,
                                                      int num_q_heads, int num_kv_heads, int block_size,
                                                      float scale_log2, int num_splits, int min_split_keys) {
  static_assert(kFp32Rows == kDecodeRows, "both decode kernels cut a group into chunks of 16 heads");
  constexpr int R = kFp32RowsPerWarp, LD = smem_ld<float, D>();

  const int seq = blockIdx.z, kv_head = blockIdx.y, split = blockIdx.x % num_splits;
  const int first_row = blockIdx.x / num_splits * kFp32Rows;
  const PackedRows rows = packed_rows(query_start_loc, seq_lens, seq, kv_head, num_q_heads, num_kv_heads);
  const DecodeSplit range = decode_split(rows.context + rows.q_len, split, num_splits, 1, min_split_keys);
  if (split >= range.used_parts) return;

  extern __shared__ __align__(16) unsigned char smem[];
  float* q_tile = reinterpret_cast<float*>(smem);  // [16][LD], then the K/V tiles
  float* kv_tile = q_tile + kFp32Rows * LD;
  PagedKV<float, D> kv =
      paged_kv<float, D>(k_cache, v_cache, block_tables, max_blocks_per_seq, seq, kv_head, num_kv_heads, block_size);
  query.load(q_tile, kv_tile + 2 * kFp32Keys * LD, kv, rows, first_row, range);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row = first_row + warp * R;
  int last_key[R];
#pragma unroll
  for (int r = 0; r < R; ++r) last_key[r] = range.key_end - 1;

  Fp32Rows<D> st;
  fp32_attend<D>(st, q_tile + warp * R * LD, kv_tile, kv, range.key_begin, range.key_end, last_key, scale_log2);

#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (warp_row + r >= rows.count()) continue;
    const DecodeSink<float> sink =
        decode_sink<float, D>(out, o_part, lse_part, rows, warp_row + r, seq, split, num_splits, range.direct());
    const float inv = 1.f / st.l[r];
#pragma unroll
    for (int i = 0; i < D / 32; ++i) sink.store(lane + 32 * i, st.o[r][i] * inv);
    if (lane == 0) sink.store_lse(st.m[r] + log2f(st.l[r]));
  }
  if (!range.direct() && arrive_last(arrival_counter(num_splits), range.used_parts))
    merge_parts<float, D>(out, o_part, lse_part, rows, first_row, seq, range.used_parts, num_splits);
}

// ---- the kernels ----
//
// Launch: grid (ceil(group / 16) * num_splits, Hkv, B), block 128. Workspace as
// DecodeSink with P = num_splits / cluster parts (unused when that is 1).
// decode_attention_kernel, decode_attention_fp32_kernel: every split is its own
// part. decode_attention_cluster_kernel: num_splits a multiple of
// kDecodeCluster; clusters of kDecodeCluster blocks along x form the parts.
// Shared memory as decode_attention / decode_attention_fp32.

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    decode_attention_kernel(T* __restrict__ out, float* __restrict__ o_part, float* __restrict__ lse_part,
                            const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                            const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
                            const int* __restrict__ block_tables, int max_blocks_per_seq, int num_q_heads,
                            int num_kv_heads, int block_size, float scale_log2, int num_splits, int min_split_keys) {
  decode_attention<T, D, 1>(out, o_part, lse_part, StoredQuery<T, D>{q}, k_cache, v_cache, query_start_loc, seq_lens,
                            block_tables, max_blocks_per_seq, num_q_heads, num_kv_heads, block_size, scale_log2,
                            num_splits, min_split_keys);
}

template <typename T, int D>
__global__ void __cluster_dims__(kDecodeCluster, 1, 1) __launch_bounds__(kThreads)
    decode_attention_cluster_kernel(T* __restrict__ out, float* __restrict__ o_part, float* __restrict__ lse_part,
                                    const T* __restrict__ q, const T* __restrict__ k_cache,
                                    const T* __restrict__ v_cache, const int* __restrict__ query_start_loc,
                                    const int* __restrict__ seq_lens, const int* __restrict__ block_tables,
                                    int max_blocks_per_seq, int num_q_heads, int num_kv_heads, int block_size,
                                    float scale_log2, int num_splits, int min_split_keys) {
  decode_attention<T, D, kDecodeCluster>(out, o_part, lse_part, StoredQuery<T, D>{q}, k_cache, v_cache,
                                         query_start_loc, seq_lens, block_tables, max_blocks_per_seq, num_q_heads,
                                         num_kv_heads, block_size, scale_log2, num_splits, min_split_keys);
}

template <int D>
__global__ void __launch_bounds__(kThreads)
    decode_attention_fp32_kernel(float* __restrict__ out, float* __restrict__ o_part, float* __restrict__ lse_part,
                                 const float* __restrict__ q, const float* __restrict__ k_cache,
                                 const float* __restrict__ v_cache, const int* __restrict__ query_start_loc,
                                 const int* __restrict__ seq_lens, const int* __restrict__ block_tables,
                                 int max_blocks_per_seq, int num_q_heads, int num_kv_heads, int block_size,
                                 float scale_log2, int num_splits, int min_split_keys) {
  decode_attention_fp32<D>(out, o_part, lse_part, StoredQuery<float, D>{q}, k_cache, v_cache, query_start_loc,
                           seq_lens, block_tables, max_blocks_per_seq, num_q_heads, num_kv_heads, block_size,
                           scale_log2, num_splits, min_split_keys);
}

// The fused RoPE kernels: q, k, v [B, H, D] at row strides instead of q, then
// RopeQuery's fields; the caches are written, so they are not __restrict__ const.
#define SPARKD_ROPE_PARAMS(T)                                                                                   \
  const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, long long q_stride,               \
      long long k_stride, long long v_stride, const int *__restrict__ positions,                               \
      const int *__restrict__ slot_mapping, const float *__restrict__ cos_sin, const T *__restrict__ q_norm,   \
      const T *__restrict__ k_norm, float eps, int rotary_dim, T *k_cache, T *v_cache
#define SPARKD_ROPE_QUERY(T, D) \
  RopeQuery<T, D> { q, k, v, q_stride, k_stride, v_stride, positions, slot_mapping, cos_sin, q_norm, k_norm, eps, \
                    rotary_dim, k_cache, v_cache }

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    decode_attention_rope_kernel(T* __restrict__ out, float* __restrict__ o_part, float* __restrict__ lse_part,
                                 SPARKD_ROPE_PARAMS(T), const int* __restrict__ query_start_loc,
                                 const int* __restrict__ seq_lens, const int* __restrict__ block_tables,
                                 int max_blocks_per_seq, int num_q_heads, int num_kv_heads, int block_size,
                                 float scale_log2, int num_splits, int min_split_keys) {
  decode_attention<T, D, 1>(out, o_part, lse_part, SPARKD_ROPE_QUERY(T, D), k_cache, v_cache, query_start_loc,
                            seq_lens, block_tables, max_blocks_per_seq, num_q_heads, num_kv_heads, block_size,
                            scale_log2, num_splits, min_split_keys);
}

template <typename T, int D>
__global__ void __cluster_dims__(kDecodeCluster, 1, 1) __launch_bounds__(kThreads)
    decode_attention_rope_cluster_kernel(T* __restrict__ out, float* __restrict__ o_part,
                                         float* __restrict__ lse_part, SPARKD_ROPE_PARAMS(T),
                                         const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
                                         const int* __restrict__ block_tables, int max_blocks_per_seq,
                                         int num_q_heads, int num_kv_heads, int block_size, float scale_log2,
                                         int num_splits, int min_split_keys) {
  decode_attention<T, D, kDecodeCluster>(out, o_part, lse_part, SPARKD_ROPE_QUERY(T, D), k_cache, v_cache,
                                         query_start_loc, seq_lens, block_tables, max_blocks_per_seq, num_q_heads,
                                         num_kv_heads, block_size, scale_log2, num_splits, min_split_keys);
}

template <int D>
__global__ void __launch_bounds__(kThreads)
    decode_attention_rope_fp32_kernel(float* __restrict__ out, float* __restrict__ o_part,
                                      float* __restrict__ lse_part, SPARKD_ROPE_PARAMS(float),
                                      const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
                                      const int* __restrict__ block_tables, int max_blocks_per_seq, int num_q_heads,
                                      int num_kv_heads, int block_size, float scale_log2, int num_splits,
                                      int min_split_keys) {
  decode_attention_fp32<D>(out, o_part, lse_part, SPARKD_ROPE_QUERY(float, D), k_cache, v_cache, query_start_loc,
                           seq_lens, block_tables, max_blocks_per_seq, num_q_heads, num_kv_heads, block_size,
                           scale_log2, num_splits, min_split_keys);
}

#undef SPARKD_ROPE_QUERY
#undef SPARKD_ROPE_PARAMS
