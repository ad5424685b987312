// Varlen causal paged attention with GQA for prefill and mixed steps
// (flash-attention 2 style, online softmax in fp32).
//
// q, out [T, Hq, D]; k_cache, v_cache [NB, Hkv, BS, D]; query_start_loc [B+1];
// seq_lens [B] (context after the step); block_tables [B, max_blocks_per_seq].
// Query token i of sequence s sits at position seq_lens[s] - query_len + i and
// sees keys 0..that position, so a chunk after cached context (chunked prefill,
// a prefix hit) and a one-token decode are handled alike.
//
// A block owns the packed rows (token * group + head, see attention_common.cuh)
// first_row .. first_row + ROWS of one (sequence, kv head) and walks the keys
// its last row can see, in tiles.
#include "attention_fp32.cuh"
#include "attention_mma.cuh"

using namespace sparkd;
using namespace sparkd::attn;

// Tile shape per head dim: MT m-tiles of 16 rows per warp, KEYS keys per
// stage, STAGES stages in flight. Mirrored by PREFILL_TILES in attention_plan.py.
template <int D>
struct PrefillTile;
template <>
struct PrefillTile<64> {
  static constexpr int kMTiles = 2, kKeys = 64, kStages = 2;
};
template <>
struct PrefillTile<128> {
  static constexpr int kMTiles = 2, kKeys = 32, kStages = 2;
};
template <>
struct PrefillTile<256> {
  static constexpr int kMTiles = 1, kKeys = 32, kStages = 1;
};

// bf16 / fp16 on tensor cores (mma.sync m16n8k16, fp32 accumulators).
// Launch: grid (ceil(max_query_len * group / ROWS), Hkv, B), block 128, with
// ROWS = 64 * kMTiles and dynamic shared memory
// (ROWS + 2 * kStages * kKeys) * (D + 8) * sizeof(T) bytes.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    prefill_attention_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k_cache,
                             const T* __restrict__ v_cache, const int* __restrict__ query_start_loc,
                             const int* __restrict__ seq_lens, const int* __restrict__ block_tables,
                             int max_blocks_per_seq, int num_q_heads, int num_kv_heads, int block_size,
                             float scale_log2) {
  using Tile = PrefillTile<D>;
  constexpr int MT = Tile::kMTiles, KEYS = Tile::kKeys, NT = KEYS / 8, DT = D / 8;
  constexpr int ROWS = kWarps * 16 * MT, LD = smem_ld<T, D>();

  const int seq = blockIdx.z, kv_head = blockIdx.y;
  const PackedRows rows = packed_rows(query_start_loc, seq_lens, seq, kv_head, num_q_heads, num_kv_heads);
  // Later rows see more keys: launching them first shortens the tail.
  const int first_row = (gridDim.x - 1 - blockIdx.x) * ROWS;
  if (first_row >= rows.count()) return;

  extern __shared__ __align__(16) unsigned char smem[];
  T* q_tile = reinterpret_cast<T*>(smem);  // [ROWS][LD]
  T* kv_tiles = q_tile + ROWS * LD;        // per stage: K [KEYS][LD], then V [KEYS][LD]
  load_query_rows<T, D, ROWS>(q_tile, q, rows, first_row);

  // The last row sees the most keys; from first_masked on, some row must mask.
  const int key_end = rows.position(min(first_row + ROWS, rows.count()) - 1) + 1;
  const int first_masked = rows.position(first_row) + 1;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row = first_row + warp * 16 * MT;
  int last_key[MT][2];
  float m[MT][2], l[MT][2], o[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      last_key[mt][half] = rows.position(warp_row + mt * 16 + lane / 4 + 8 * half);
      m[mt][half] = -infinity();
      l[mt][half] = 0.f;
    }
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
  }

  const PagedKV<T, D> kv =
      paged_kv<T, D>(k_cache, v_cache, block_tables, max_blocks_per_seq, seq, kv_head, num_kv_heads, block_size);
  pipelined_tiles<Tile::kStages>(
      ceil_div(key_end, KEYS),
      [&](int t, int stage) {
        T* k_tile = kv_tiles + stage * 2 * KEYS * LD;
        load_kv_tile<T, D, KEYS>(k_tile, k_tile + KEYS * LD, kv, t * KEYS, key_end);
      },
      [&](int t, int stage) {
        const T* k_tile = kv_tiles + stage * 2 * KEYS * LD;
        float s[MT][NT][4];
        warp_qk<T, D, MT, NT>(s, q_tile + warp * 16 * MT * LD, k_tile, lane);
        scale_and_mask(s, scale_log2, (t + 1) * KEYS > first_masked, t * KEYS, last_key, lane);
        online_softmax(s, m, l, o);
        warp_pv<T, D, MT, NT>(o, s, k_tile + KEYS * LD, lane);
      });

  finish_rows(l);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_row + mt * 16 + lane / 4 + 8 * half;
      if (row >= rows.count()) continue;
      T* dst = out + rows.offset(row, D) + (lane % 4) * 2;
      const float inv = 1.f / l[mt][half];
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        *reinterpret_cast<unsigned*>(dst + dt * 8) =
            pack_pair<T>(o[mt][dt][2 * half] * inv, o[mt][dt][2 * half + 1] * inv);
    }
}

// fp32 on CUDA cores, exact to rounding (no TF32).
// Launch: grid (ceil(max_query_len * group / 16), Hkv, B), block 128, dynamic
// shared memory (16 + 2 * 32) * (D + 4) * 4 bytes.
template <int D>
__global__ void __launch_bounds__(kThreads)
    prefill_attention_fp32_kernel(float* __restrict__ out, const float* __restrict__ q,
                                  const float* __restrict__ k_cache, const float* __restrict__ v_cache,
                                  const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
                                  const int* __restrict__ block_tables, int max_blocks_per_seq, int num_q_heads,
                                  int num_kv_heads, int block_size, float scale_log2) {
  constexpr int R = kFp32RowsPerWarp, LD = smem_ld<float, D>();

  const int seq = blockIdx.z, kv_head = blockIdx.y;
  const PackedRows rows = packed_rows(query_start_loc, seq_lens, seq, kv_head, num_q_heads, num_kv_heads);
  const int first_row = blockIdx.x * kFp32Rows;
  if (first_row >= rows.count()) return;

  extern __shared__ __align__(16) unsigned char smem[];
  float* q_tile = reinterpret_cast<float*>(smem);  // [kFp32Rows][LD], then the K/V tiles
  load_query_rows<float, D, kFp32Rows>(q_tile, q, rows, first_row);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row = first_row + warp * R;
  int last_key[R];
#pragma unroll
  for (int r = 0; r < R; ++r) last_key[r] = rows.position(warp_row + r);
  const int key_end = rows.position(min(first_row + kFp32Rows, rows.count()) - 1) + 1;

  Fp32Rows<D> st;
  fp32_attend<D>(st, q_tile + warp * R * LD, q_tile + kFp32Rows * LD,
                 paged_kv<float, D>(k_cache, v_cache, block_tables, max_blocks_per_seq, seq, kv_head, num_kv_heads,
                                    block_size),
                 0, key_end, last_key, scale_log2);

#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (warp_row + r >= rows.count()) continue;
    float* dst = out + rows.offset(warp_row + r, D);
    const float inv = 1.f / st.l[r];
#pragma unroll
    for (int i = 0; i < D / 32; ++i) dst[lane + 32 * i] = st.o[r][i] * inv;
  }
}
