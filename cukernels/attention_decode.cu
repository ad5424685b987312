// Paged attention for decode: one new query token per sequence, split-K over
// the context for long sequences.
//
// q, out [B, Hq, D]: sequence b's one token is row query_start_loc[b];
// k_cache, v_cache [NB, Hkv, BS, D]; seq_lens [B]; block_tables [B, max_blocks_per_seq].
//
// A block owns up to 16 query heads of one kv head (GQA: K/V are read once for
// all of them) and one split of the sequence's keys (decode_split below). A
// sequence that fits in one split is written directly;
// otherwise every split leaves its normalised output and log-sum-exp in the
// workspace and decode_combine_kernel merges them. The grid and the workspace
// depend only on host-side sizes, so the launches can be captured in a graph.
#include "attention_common.cuh"

using namespace sparkd;
using namespace sparkd::attn;

// ---- split-K ----

// A sequence's keys are cut into splits of a multiple of kSplitAlign keys, at
// least kMinSplitKeys long (MIN_SPLIT_KEYS in attention.py). The attention
// kernels and the combine kernel all derive the split length from seq_len.
constexpr int kSplitAlign = 64;
constexpr int kMinSplitKeys = 128;

// Keys per split when seq_len keys are shared by at most num_splits splits.
// Short sequences get fewer, longer splits: the rest of the grid exits at once.
__device__ __forceinline__ int split_length(int seq_len, int num_splits) {
  const int even = ceil_div(ceil_div(seq_len, num_splits), kSplitAlign) * kSplitAlign;
  return max(even, kMinSplitKeys);
}

// The keys [key_begin, key_end) that split `split` of a sequence covers. When
// the sequence fits in one split (direct), that block writes the output itself.
struct DecodeSplit {
  int key_begin, key_end;
  bool direct;
};

__device__ __forceinline__ DecodeSplit decode_split(int seq_len, int split, int num_splits) {
  const int len = split_length(seq_len, num_splits);
  return {split * len, min(seq_len, (split + 1) * len), seq_len <= len};
}

// Where a decode block writes one query head: `out` when the split is direct,
// else the split's slot of the workspace, which decode_combine_kernel reduces.
// Workspace: o_part [B, Hq, S, D] (normalised per split), lse_part [B, Hq, S] (log2).
template <typename T>
struct DecodeSink {
  T* out;       // the head's [D] in out
  float* part;  // the head's [D] in o_part for this split
  float* lse;   // the head's entry in lse_part for this split
  bool direct;

  __device__ void store(int d, float value) const {
    if (direct) out[d] = from_float<T>(value);
    else part[d] = value;
  }
  // lse2 = running max + log2(running sum), in log2 units.
  __device__ void store_lse(float lse2) const {
    if (!direct) *lse = lse2;
  }
};

template <typename T, int D>
__device__ __forceinline__ DecodeSink<T> decode_sink(T* out, float* o_part, float* lse_part, const PackedRows& rows,
                                                     int row, int seq, int split, int num_splits, bool direct) {
  const long long slot = (static_cast<long long>(seq) * rows.num_q_heads + rows.first_head + row) * num_splits + split;
  return {out + rows.offset(row, D), o_part + slot * D, lse_part + slot, direct};
}

// ---- kernels ----

constexpr int kDecodeRows = 16;  // query heads per block: one m-tile
constexpr int kDecodeKeys = 64;  // keys per stage: 16 per warp

// Stages in flight per head dim; mirrored by _DECODE_TILES in attention.py.
template <int D>
__host__ __device__ constexpr int decode_stages() { return D <= 128 ? 2 : 1; }

// bf16 / fp16 on tensor cores. The 16 heads are the rows of one m-tile; each
// warp takes 16 keys of every tile with its own softmax state, and the four
// states are merged at the end.
// Launch: grid (ceil(group / 16) * num_splits, Hkv, B), block 128, dynamic
// shared memory (16 + 2 * stages * 64) * (D + 8) * sizeof(T) bytes; the final
// merge reuses it and needs (64 * D + 208) * 4 bytes, which is less.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    decode_attention_kernel(T* __restrict__ out, float* __restrict__ o_part, float* __restrict__ lse_part,
                            const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                            const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
                            const int* __restrict__ block_tables, int max_blocks_per_seq, int num_q_heads,
                            int num_kv_heads, int block_size, float scale_log2, int num_splits) {
  constexpr int LD = smem_ld<T, D>(), DT = D / 8, KEYS = kDecodeKeys, WARP_KEYS = KEYS / kWarps;

  const int seq = blockIdx.z, kv_head = blockIdx.y, split = blockIdx.x % num_splits;
  const int first_row = blockIdx.x / num_splits * kDecodeRows;
  const PackedRows rows = packed_rows(query_start_loc, seq_lens, seq, kv_head, num_q_heads, num_kv_heads);
  const DecodeSplit range = decode_split(seq_lens[seq], split, num_splits);
  if (range.key_begin >= range.key_end) return;

  extern __shared__ __align__(16) unsigned char smem[];
  T* q_tile = reinterpret_cast<T*>(smem);  // [16][LD]
  T* kv_tiles = q_tile + kDecodeRows * LD;  // per stage: K [KEYS][LD], then V [KEYS][LD]
  load_query_rows<T, D, kDecodeRows>(q_tile, q, rows, first_row);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int last_key[1][2] = {{range.key_end - 1, range.key_end - 1}};
  float m[1][2] = {{-infinity(), -infinity()}}, l[1][2] = {{0.f, 0.f}}, o[1][DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[0][dt][e] = 0.f;

  const PagedKV<T, D> kv =
      paged_kv<T, D>(k_cache, v_cache, block_tables, max_blocks_per_seq, seq, kv_head, num_kv_heads, block_size);
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
  finish_rows(l);

  // Merge the warps' states; the pipeline's last barrier freed the tiles.
  float* warp_o = reinterpret_cast<float*>(smem);     // [kWarps][16][D], unnormalised
  float* warp_m = warp_o + kWarps * kDecodeRows * D;  // [kWarps][16]
  float* warp_l = warp_m + kWarps * kDecodeRows;      // [kWarps][16]
  float* weight = warp_l + kWarps * kDecodeRows;      // [kWarps][16]: exp2(m_w - max) / total
  float* row_lse = weight + kWarps * kDecodeRows;     // [16]
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warp * kDecodeRows + lane / 4 + 8 * half;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      *reinterpret_cast<float2*>(warp_o + r * D + dt * 8 + (lane % 4) * 2) =
          make_float2(o[0][dt][2 * half], o[0][dt][2 * half + 1]);
    if (lane % 4 == 0) {
      warp_m[r] = m[0][half];
      warp_l[r] = l[0][half];
    }
  }
  __syncthreads();
  if (threadIdx.x < kDecodeRows) {
    const int r = threadIdx.x;
    float row_max = -infinity();
    for (int w = 0; w < kWarps; ++w) row_max = fmaxf(row_max, warp_m[w * kDecodeRows + r]);
    // Warp 0 always sees the split's first key, so row_max is finite; warps
    // that saw no key have m = -inf and weigh 0.
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += warp_l[w * kDecodeRows + r] * exp2f(warp_m[w * kDecodeRows + r] - row_max);
    for (int w = 0; w < kWarps; ++w) weight[w * kDecodeRows + r] = exp2f(warp_m[w * kDecodeRows + r] - row_max) / total;
    row_lse[r] = row_max + log2f(total);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kDecodeRows * D; e += kThreads) {
    const int r = e / D, d = e % D;
    if (first_row + r >= rows.count()) break;
    float value = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) value = fmaf(warp_o[(w * kDecodeRows + r) * D + d], weight[w * kDecodeRows + r], value);
    const DecodeSink<T> sink =
        decode_sink<T, D>(out, o_part, lse_part, rows, first_row + r, seq, split, num_splits, range.direct);
    sink.store(d, value);
    if (d == 0) sink.store_lse(row_lse[r]);
  }
}

// fp32 on CUDA cores, exact to rounding (no TF32).
// Launch: grid (ceil(group / 16) * num_splits, Hkv, B), block 128, dynamic
// shared memory (16 + 2 * 32) * (D + 4) * 4 bytes.
template <int D>
__global__ void __launch_bounds__(kThreads)
    decode_attention_fp32_kernel(float* __restrict__ out, float* __restrict__ o_part, float* __restrict__ lse_part,
                                 const float* __restrict__ q, const float* __restrict__ k_cache,
                                 const float* __restrict__ v_cache, const int* __restrict__ query_start_loc,
                                 const int* __restrict__ seq_lens, const int* __restrict__ block_tables,
                                 int max_blocks_per_seq, int num_q_heads, int num_kv_heads, int block_size,
                                 float scale_log2, int num_splits) {
  static_assert(kFp32Rows == kDecodeRows, "both decode kernels cut a group into chunks of 16 heads");
  constexpr int R = kFp32RowsPerWarp, LD = smem_ld<float, D>();

  const int seq = blockIdx.z, kv_head = blockIdx.y, split = blockIdx.x % num_splits;
  const int first_row = blockIdx.x / num_splits * kFp32Rows;
  const PackedRows rows = packed_rows(query_start_loc, seq_lens, seq, kv_head, num_q_heads, num_kv_heads);
  const DecodeSplit range = decode_split(seq_lens[seq], split, num_splits);
  if (range.key_begin >= range.key_end) return;

  extern __shared__ __align__(16) unsigned char smem[];
  float* q_tile = reinterpret_cast<float*>(smem);  // [16][LD], then the K/V tiles
  load_query_rows<float, D, kFp32Rows>(q_tile, q, rows, first_row);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row = first_row + warp * R;
  int last_key[R];
#pragma unroll
  for (int r = 0; r < R; ++r) last_key[r] = range.key_end - 1;

  Fp32Rows<D> st;
  fp32_attend<D>(st, q_tile + warp * R * LD, q_tile + kFp32Rows * LD,
                 paged_kv<float, D>(k_cache, v_cache, block_tables, max_blocks_per_seq, seq, kv_head, num_kv_heads,
                                    block_size),
                 range.key_begin, range.key_end, last_key, scale_log2);

#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (warp_row + r >= rows.count()) continue;
    const DecodeSink<float> sink =
        decode_sink<float, D>(out, o_part, lse_part, rows, warp_row + r, seq, split, num_splits, range.direct);
    const float inv = 1.f / st.l[r];
#pragma unroll
    for (int i = 0; i < D / 32; ++i) sink.store(lane + 32 * i, st.o[r][i] * inv);
    if (lane == 0) sink.store_lse(st.m[r] + log2f(st.l[r]));
  }
}

// Merges the splits of every sequence that used more than one:
// out = sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max).
// Launch: grid (Hq, B), block D (one thread per dim).
template <typename T, int D>
__global__ void __launch_bounds__(D)
    decode_combine_kernel(T* __restrict__ out, const float* __restrict__ o_part, const float* __restrict__ lse_part,
                          const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens, int num_q_heads,
                          int num_splits) {
  const int head = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
  const int seq_len = seq_lens[seq];
  const int used = ceil_div(seq_len, split_length(seq_len, num_splits));
  if (used <= 1) return;  // written directly by the attention kernel
  const long long slot = (static_cast<long long>(seq) * num_q_heads + head) * num_splits;
  float lse_max = -infinity();
  for (int s = 0; s < used; ++s) lse_max = fmaxf(lse_max, lse_part[slot + s]);
  float total = 0.f, value = 0.f;
  for (int s = 0; s < used; ++s) {
    const float w = exp2f(lse_part[slot + s] - lse_max);
    total += w;
    value = fmaf(w, o_part[(slot + s) * D + d], value);
  }
  out[(static_cast<long long>(query_start_loc[seq]) * num_q_heads + head) * D + d] = from_float<T>(value / total);
}
