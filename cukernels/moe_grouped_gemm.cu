// Expert GEMMs of a mixture-of-experts layer at prefill-sized batches, on tensor cores
// (mma.sync m16n8k16, bf16 / fp16 in, fp32 accumulators). Same contracts as moe_gemm.cu,
// which stays the path for decode-sized batches and fp32.
//
// Shapes: T tokens, k choices each, P = T * k (token, expert) pairs (pair p = t * k + j),
// E experts, H hidden size, I expert intermediate size.
//   gate_up [E, 2I, H] = [gate | up] per expert, down [E, H, I], both row-major;
//   from the alignment kernel (moe_routing.cu), all int32:
//   sorted_pairs [P]   pair ids in expert order ("sorted rows");
//   offsets [E + 1]    expert e owns sorted rows offsets[e] .. offsets[e + 1] - 1;
//   from moe_tile_plan_kernel:
//   tile_starts [E + 1]  expert e owns the M-tiles tile_starts[e] .. tile_starts[e + 1] - 1,
//                        tile_starts[E] is their total.
//
// Each block computes a kTileM x kTileN tile of one expert's output: kTileM sorted rows
// of that expert (an "M-tile") against kTileN weight rows, with 8 warps of 64 x 64 (2 in
// M, 4 in N): the large tile halves the shared-memory and L2 bytes per MMA of a 64 x 128
// one. There is one M-tile slot per possible M-tile, ceil(P / kTileM) + min(E, P) of them
// (every active expert wastes at most one partial tile), so the grid depends on (P, E, N)
// only: graph-capturable. A block finds its expert from tile_starts; a slot past the
// total exits at once, and an expert no token chose owns no tile, so its weights are
// never read. In the last, partial M-tile of an expert, m16 row groups past its rows skip
// their MMAs.
//
// Blocks are numbered in groups of kGroupM M-tile slots, M fastest within a group: the
// blocks running together are the M-tiles of a few experts against a few weight tiles,
// so each weight tile is fetched from memory once for all of an expert's M-tiles and
// each gathered activation tile stays in L2 for all of its weight tiles.
//
// The K loop streams kTileK-wide slices of the gathered activation rows and the weight
// rows into shared memory with cp.async, kStages slices deep, one barrier per slice.
// Rows and columns past the end (and K past its end) are zero-filled, never read.
// Shared-memory rows are 128 bytes of 8 16-byte chunks, chunk c of row r stored at chunk
// c ^ (r % 8): the 8 rows one ldmatrix reads, and the 8 chunks of a row a cp.async
// phase writes, fall in distinct banks without padding.
#include "attention_mma.cuh"

using namespace sparkd;
using attn::cp_async_16;
using attn::cp_async_commit;
using attn::cp_async_wait;
using attn::ldmatrix_x4;
using attn::mma_16816;
using attn::pack_pair;

constexpr int kTileM = 128;  // sorted rows per block
constexpr int kTileN = 256;  // weight rows per block (for gate_up: 128 gate rows, then the 128 matching up rows)
constexpr int kTileK = 64;   // K per pipeline stage: one 128-byte row of 16-bit elements
constexpr int kWarpsM = 2, kWarpsN = 4;
constexpr int kWarpM = kTileM / kWarpsM, kWarpN = kTileN / kWarpsN;  // 64 x 64 per warp
constexpr int kThreads = 32 * kWarpsM * kWarpsN;
constexpr int kMT = kWarpM / 16, kNT = kWarpN / 8;  // a warp's m16 and n8 tiles
constexpr int kGroupM = 8;                          // M-tile slots per raster group
constexpr int kChunkBytes = 16;
constexpr int kRowBytes = 128;  // kTileK 16-bit elements
constexpr int kChunksPerRow = kRowBytes / kChunkBytes;
constexpr int kStageBytes = (kTileM + kTileN) * kRowBytes;  // A [kTileM] rows, then B [kTileN] rows

// Byte offset of chunk `chunk` of row `row` in a swizzled tile.
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kRowBytes + ((chunk ^ (row % 8)) * kChunkBytes);
}

constexpr int kPlanThreads = 1024;  // >= the most experts moe_routing.cu handles

// tile_starts[e] = sum over e' < e of ceil(count(e') / kTileM); tile_starts[E] = the total.
// Launch: one block of kPlanThreads threads; E <= kPlanThreads.
__global__ void __launch_bounds__(kPlanThreads)
    moe_tile_plan_kernel(int* __restrict__ tile_starts, const int* __restrict__ offsets, int num_experts) {
  __shared__ int scratch[32];
  const int expert = threadIdx.x;
  const int tiles = expert < num_experts ? (offsets[expert + 1] - offsets[expert] + kTileM - 1) / kTileM : 0;
  int total;
  const int start = block_exclusive_sum(tiles, scratch, total);
  if (expert < num_experts) tile_starts[expert] = start;
  if (threadIdx.x == 0) tile_starts[num_experts] = total;
}

// The block's work: sorted rows [row0, row_end) of `expert`, row_end - row0 <= kTileM, against
// weight tile n_block.
struct BlockTile {
  int expert, row0, row_end, n_block;
};

// Maps blockIdx.x to (M-tile slot, weight tile) in groups of kGroupM slots, M fastest, and
// finds the expert owning the slot: the number of experts whose tiles all lie before it
// (tile_starts is non-decreasing). False, for every thread, past the total. The grid is
// num_slots * (weight tiles) blocks. Every thread of the block must call it.
__device__ __forceinline__ bool find_block_tile(const int* tile_starts, const int* offsets, int num_experts,
                                                int num_slots, BlockTile& tile) {
  const int num_n = gridDim.x / num_slots;
  const int group = blockIdx.x / (kGroupM * num_n), in_group = blockIdx.x % (kGroupM * num_n);
  const int first_slot = group * kGroupM;
  const int group_slots = min(num_slots - first_slot, kGroupM);
  const int slot = first_slot + in_group % group_slots;
  if (slot >= tile_starts[num_experts]) return false;
  int expert = 0;
  for (int first = 0; first < num_experts; first += blockDim.x) {
    const int e = first + threadIdx.x;
    expert += __syncthreads_count(e < num_experts && tile_starts[e + 1] <= slot);
  }
  tile.expert = expert;
  tile.row0 = offsets[expert] + (slot - tile_starts[expert]) * kTileM;
  tile.row_end = min(offsets[expert + 1], tile.row0 + kTileM);
  tile.n_block = in_group / group_slots;
  return true;
}

// The sources of a thread's 16-byte chunks of every K slice: chunk kc of tile rows
// first_row() + i * kRowStep, nullptr for a row past the end (zero-filled).
template <typename T, int kRows>
struct TileSources {
  static constexpr int kRowStep = kThreads / kChunksPerRow;
  static constexpr int kPerThread = kRows / kRowStep;
  static constexpr int kChunkElems = kChunkBytes / static_cast<int>(sizeof(T));
  static_assert(kRows % kRowStep == 0, "every thread copies the same number of rows");
  const T* row[kPerThread];

  __device__ static int first_row() { return threadIdx.x / kChunksPerRow; }

  // Starts copying K slice [k0, k0 + kTileK) into the swizzled tile at dst; K past k_size is zeroed.
  __device__ __forceinline__ void load(unsigned char* dst, int k0, int k_size, const T* any_valid) const {
    const int chunk = threadIdx.x % kChunksPerRow, col = k0 + chunk * kChunkElems;
    const bool k_valid = col < k_size;
    // Rows first_row() + i * kRowStep share their swizzle, as kRowStep is a multiple of 8.
    unsigned char* first = dst + swizzled(first_row(), chunk);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const bool valid = k_valid && row[i] != nullptr;
      cp_async_16(first + i * kRowStep * kRowBytes, valid ? row[i] + col : any_valid, valid);
    }
  }
};

// The tile row of the first weight row of a warp's n-tile pair np (n-tiles 2np, 2np + 1).
// kPairedHalves (gate_up): pairs 0 .. kNT/4 - 1 are the warp's gate rows in the first half
// of the tile, the rest the matching up rows in the second; otherwise kWarpN rows in a run.
template <bool kPairedHalves>
__device__ __forceinline__ constexpr int pair_row(int np) {
  return kPairedHalves ? (np / (kNT / 4)) * (kTileN / 2) + (np % (kNT / 4)) * 16 : np * 16;
}

// The warp's ldmatrix fragments of one 16-wide K step: a[mt] (rows of m-tile mt) and
// b[np] (n-tiles 2np and 2np + 1). a_row, b_row: byte offsets of the lane's rows;
// `step` picks the chunk pair, swizzled by the lane's row % 8 (= lane % 8).
template <bool kPairedHalves>
__device__ __forceinline__ void load_fragments(unsigned (&a)[kMT][4], unsigned (&b)[kNT / 2][4],
                                               const unsigned char* a_tile, const unsigned char* b_tile, int a_row,
                                               int b_row, int step, int lane) {
  // A matrices: rows 0-7 k 0-7, rows 8-15 k 0-7, rows 0-7 k 8-15, rows 8-15 k 8-15.
  const int a_chunk = ((2 * step + lane / 16) ^ (lane % 8)) * kChunkBytes;
  // B matrices: rows 0-7 k 0-7, rows 0-7 k 8-15, rows 8-15 k 0-7, rows 8-15 k 8-15.
  const int b_chunk = ((2 * step + (lane / 8) % 2) ^ (lane % 8)) * kChunkBytes;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) ldmatrix_x4(a[mt], a_tile + a_row + mt * 16 * kRowBytes + a_chunk);
#pragma unroll
  for (int np = 0; np < kNT / 2; ++np)
    ldmatrix_x4(b[np], b_tile + b_row + pair_row<kPairedHalves>(np) * kRowBytes + b_chunk);
}

// acc += a_tile . b_tile^T for the warp's 64 rows and 64 weight rows of one K slice; m-tiles
// mt >= m_tiles (rows past the expert's) skip their MMAs. The next step's fragments load
// while the current step's MMAs run.
template <typename T, bool kPairedHalves>
__device__ __forceinline__ void warp_mma_slice(float (&acc)[kMT][kNT][4], const unsigned char* a_tile,
                                               const unsigned char* b_tile, int a_row, int b_row, int m_tiles,
                                               int lane) {
  constexpr int kSteps = kTileK / 16;
  unsigned a[2][kMT][4], b[2][kNT / 2][4];
  load_fragments<kPairedHalves>(a[0], b[0], a_tile, b_tile, a_row, b_row, 0, lane);
#pragma unroll
  for (int step = 0; step < kSteps; ++step) {
    const int cur = step % 2;
    if (step + 1 < kSteps)
      load_fragments<kPairedHalves>(a[1 - cur], b[1 - cur], a_tile, b_tile, a_row, b_row, step + 1, lane);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      if (mt >= m_tiles) continue;
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        mma_16816<T>(acc[mt][2 * np], a[cur][mt], b[cur][np][0], b[cur][np][1]);
        mma_16816<T>(acc[mt][2 * np + 1], a[cur][mt], b[cur][np][2], b[cur][np][3]);
      }
    }
  }
}

// acc = A . B^T over K for the block's tile, through a kStages-deep cp.async pipeline.
// a: the thread's activation rows, b: its weight rows. Every thread must call it.
template <typename T, int kStages, bool kPairedHalves>
__device__ __forceinline__ void tile_product(float (&acc)[kMT][kNT][4], const TileSources<T, kTileM>& a,
                                             const TileSources<T, kTileN>& b, const BlockTile& tile, int k_size,
                                             const T* any_valid) {
  extern __shared__ __align__(128) unsigned char smem[];  // per stage: A [kTileM] rows, then B [kTileN] rows
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  const int a_row = (warp_m * kWarpM + lane % 16) * kRowBytes;
  const int b_first = kPairedHalves ? warp_n * (kWarpN / 2) : warp_n * kWarpN;
  const int b_row = (b_first + lane % 8 + (lane / 16) * 8) * kRowBytes;
  const int m_tiles = (tile.row_end - tile.row0 - warp_m * kWarpM + 15) / 16;  // may be <= 0 or > kMT
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

  const int num_slices = (k_size + kTileK - 1) / kTileK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_slices) {
      a.load(smem + s * kStageBytes, s * kTileK, k_size, any_valid);
      b.load(smem + s * kStageBytes + kTileM * kRowBytes, s * kTileK, k_size, any_valid);
    }
    cp_async_commit();
  }
  for (int slice = 0; slice < num_slices; ++slice) {
    cp_async_wait<kStages - 2>();  // this thread's copies of `slice` have landed
    // Every thread's copies of `slice` are visible, and every warp is done with slice - 1,
    // whose stage the load below refills.
    __syncthreads();
    const int ahead = slice + kStages - 1;
    if (ahead < num_slices) {
      unsigned char* stage = smem + (ahead % kStages) * kStageBytes;
      a.load(stage, ahead * kTileK, k_size, any_valid);
      b.load(stage + kTileM * kRowBytes, ahead * kTileK, k_size, any_valid);
    }
    cp_async_commit();  // possibly empty: one group per slice keeps the count above right
    const unsigned char* stage = smem + (slice % kStages) * kStageBytes;
    warp_mma_slice<T, kPairedHalves>(acc, stage, stage + kTileM * kRowBytes, a_row, b_row, m_tiles, lane);
  }
}

// The sorted row of a lane's accumulator elements 2 * half, 2 * half + 1 in m-tile mt.
__device__ __forceinline__ int acc_row(const BlockTile& tile, int mt, int half) {
  const int lane = threadIdx.x % 32, warp_m = threadIdx.x / 32 / kWarpsN;
  return tile.row0 + warp_m * kWarpM + mt * 16 + lane / 4 + 8 * half;
}

// hidden[row, c] = silu(x[tok] . gate[e, c]) * (x[tok] . up[e, c]) for every sorted row of
// expert e, tok = sorted_pairs[row] / top_k; silu(g) = g / (1 + exp(-g)).
// hidden [P, I] contiguous, x [T, H] (row stride ld_x), gate_up [E, 2I, H] contiguous.
// A block's 256 weight rows are 128 gate rows c0 .. c0 + 127 and the same 128 up rows, and
// each warp holds 32 gate columns and their up columns, so SiLU-and-mul runs in registers.
// Launch: grid num_slots * ceil(I / 128) with num_slots = ceil(P / kTileM) + min(E, P),
// kThreads threads, dynamic shared memory kStages * kStageBytes. Preconditions (checked by
// the launcher): H, I and ld_x are multiples of a 16-byte chunk; x and gate_up are 16-byte aligned.
template <typename T, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    moe_grouped_gate_up_kernel(T* __restrict__ hidden, const T* __restrict__ x, const T* __restrict__ gate_up,
                               const int* __restrict__ sorted_pairs, const int* __restrict__ offsets,
                               const int* __restrict__ tile_starts, int num_experts, int num_slots, int top_k,
                               int hidden_size, int inter_size, long long ld_x) {
  constexpr int kCols = kTileN / 2;  // hidden columns per block
  BlockTile tile;
  if (!find_block_tile(tile_starts, offsets, num_experts, num_slots, tile)) return;
  const int col0 = tile.n_block * kCols;

  TileSources<T, kTileM> a;
#pragma unroll
  for (int i = 0; i < a.kPerThread; ++i) {
    const int row = tile.row0 + a.first_row() + i * a.kRowStep;
    a.row[i] = row < tile.row_end ? x + static_cast<long long>(sorted_pairs[row] / top_k) * ld_x : nullptr;
  }
  const T* expert_w = gate_up + static_cast<long long>(tile.expert) * 2 * inter_size * hidden_size;
  TileSources<T, kTileN> b;
#pragma unroll
  for (int i = 0; i < b.kPerThread; ++i) {
    const int r = b.first_row() + i * b.kRowStep;  // tile row: gate rows, then up rows
    const int col = col0 + r % kCols;
    b.row[i] = col < inter_size
                   ? expert_w + (static_cast<long long>(r < kCols ? 0 : inter_size) + col) * hidden_size
                   : nullptr;
  }

  float acc[kMT][kNT][4];
  tile_product<T, kStages, true>(acc, a, b, tile, hidden_size, x);

  // The warp's n-tiles 0 .. kNT/2 - 1 are gate columns, the rest their up columns.
  const int lane = threadIdx.x % 32, warp_n = (threadIdx.x / 32) % kWarpsN;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = acc_row(tile, mt, half);
      if (row >= tile.row_end) continue;
#pragma unroll
      for (int nt = 0; nt < kNT / 2; ++nt) {
        const int col = col0 + warp_n * (kWarpN / 2) + nt * 8 + (lane % 4) * 2;
        if (col >= inter_size) continue;  // I is even, so col + 1 < I too
        float out[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float gate = acc[mt][nt][2 * half + j], up = acc[mt][nt + kNT / 2][2 * half + j];
          out[j] = gate / (1.f + expf(-gate)) * up;
        }
        *reinterpret_cast<unsigned*>(hidden + static_cast<long long>(row) * inter_size + col) =
            pack_pair<T>(out[0], out[1]);
      }
    }
}

// expert_out[row, h] = hidden[row] . down[e, h] for every sorted row of expert e, summed in fp32
// and rounded to T. expert_out [P, H], hidden [P, I], down [E, H, I], all in T and contiguous.
// Launch: grid num_slots * ceil(H / kTileN) with num_slots = ceil(P / kTileM) + min(E, P),
// kThreads threads, dynamic shared memory kStages * kStageBytes. Preconditions (checked by
// the launcher): H and I are multiples of a 16-byte chunk; hidden and down are 16-byte aligned.
template <typename T, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    moe_grouped_down_kernel(T* __restrict__ expert_out, const T* __restrict__ hidden, const T* __restrict__ down,
                            const int* __restrict__ offsets, const int* __restrict__ tile_starts, int num_experts,
                            int num_slots, int hidden_size, int inter_size) {
  BlockTile tile;
  if (!find_block_tile(tile_starts, offsets, num_experts, num_slots, tile)) return;
  const int h0 = tile.n_block * kTileN;

  TileSources<T, kTileM> a;
#pragma unroll
  for (int i = 0; i < a.kPerThread; ++i) {
    const int row = tile.row0 + a.first_row() + i * a.kRowStep;
    a.row[i] = row < tile.row_end ? hidden + static_cast<long long>(row) * inter_size : nullptr;
  }
  TileSources<T, kTileN> b;
#pragma unroll
  for (int i = 0; i < b.kPerThread; ++i) {
    const int h = h0 + b.first_row() + i * b.kRowStep;
    b.row[i] = h < hidden_size ? down + (static_cast<long long>(tile.expert) * hidden_size + h) * inter_size : nullptr;
  }

  float acc[kMT][kNT][4];
  tile_product<T, kStages, false>(acc, a, b, tile, inter_size, hidden);

  const int lane = threadIdx.x % 32, warp_n = (threadIdx.x / 32) % kWarpsN;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = acc_row(tile, mt, half);
      if (row >= tile.row_end) continue;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int h = h0 + warp_n * kWarpN + nt * 8 + (lane % 4) * 2;
        if (h >= hidden_size) continue;  // H is even, so h + 1 < H too
        *reinterpret_cast<unsigned*>(expert_out + static_cast<long long>(row) * hidden_size + h) =
            pack_pair<T>(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
      }
    }
}
