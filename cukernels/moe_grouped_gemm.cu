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
// of that expert (an "M-tile") against kTileN weight rows. The grid has one slot in y per
// possible M-tile, ceil(P / kTileM) + min(E, P) of them (every active expert wastes at
// most one partial tile), so it depends on (P, E, N) only: graph-capturable. A block
// finds its expert from tile_starts; a slot past the total exits at once, and an expert
// no token chose owns no tile, so its weights are never read.
//
// The K loop streams kTileK-wide slices of the gathered activation rows and the weight
// rows into shared memory with cp.async, kStages slices in flight. Rows and columns past
// the end (and K past its end) are zero-filled, never read.
#include "attention_mma.cuh"

using namespace sparkd;
using attn::cp_async_16;
using attn::cp_async_commit;
using attn::cp_async_wait;
using attn::ldmatrix_x4;
using attn::mma_16816;
using attn::pack_pair;

constexpr int kTileM = 64;   // sorted rows per block
constexpr int kTileN = 128;  // weight rows per block (for gate_up: 64 gate rows, then the 64 matching up rows)
constexpr int kTileK = 32;   // K per pipeline stage
constexpr int kStages = 4;
constexpr int kWarpsN = 2;  // warps side by side in N; kTileM / kWarpM of them in M
constexpr int kWarpM = 32, kWarpN = kTileN / kWarpsN;  // each warp: 32 rows x 64 weight rows
constexpr int kThreads = 32 * (kTileM / kWarpM) * kWarpsN;
constexpr int kMT = kWarpM / 16, kNT = kWarpN / 8;  // a warp's m16 and n8 tiles
constexpr int kChunkBytes = 16;
// Shared-memory row stride: one 16-byte pad per row, so the 8 rows an ldmatrix reads
// fall in distinct banks.
template <typename T>
__host__ __device__ constexpr int tile_ld() { return kTileK + kChunkBytes / static_cast<int>(sizeof(T)); }

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

// The block's M-tile: sorted rows [row0, row_end) of `expert`, row_end - row0 <= kTileM.
struct MTile {
  int expert, row0, row_end;
};

// Finds the expert owning M-tile blockIdx.y: the number of experts whose tiles all lie
// before it (tile_starts is non-decreasing). False, for every thread, past the total.
// Every thread of the block must call it.
__device__ __forceinline__ bool find_m_tile(const int* tile_starts, const int* offsets, int num_experts, MTile& tile) {
  const int slot = blockIdx.y;
  if (slot >= tile_starts[num_experts]) return false;
  int expert = 0;
  for (int first = 0; first < num_experts; first += blockDim.x) {
    const int e = first + threadIdx.x;
    expert += __syncthreads_count(e < num_experts && tile_starts[e + 1] <= slot);
  }
  tile.expert = expert;
  tile.row0 = offsets[expert] + (slot - tile_starts[expert]) * kTileM;
  tile.row_end = offsets[expert + 1];
  return true;
}

// The sources of a thread's 16-byte chunks of every K slice: chunk column kc of tile rows
// r0 + i * kRowStep, nullptr for a row past the end (zero-filled).
template <typename T, int kRows>
struct TileSources {
  static constexpr int kChunksPerRow = kTileK * static_cast<int>(sizeof(T)) / kChunkBytes;
  static constexpr int kRowStep = kThreads / kChunksPerRow;
  static constexpr int kPerThread = kRows / kRowStep;
  static_assert(kRows % kRowStep == 0, "every thread copies the same number of rows");
  const T* row[kPerThread];

  __device__ static int first_row() { return threadIdx.x / kChunksPerRow; }
  __device__ static int chunk_col() {
    return (threadIdx.x % kChunksPerRow) * (kChunkBytes / static_cast<int>(sizeof(T)));
  }

  // Starts copying K slice [k0, k0 + kTileK) into dst [kRows][tile_ld]; K past k_size is zeroed.
  __device__ __forceinline__ void load(T* dst, int k0, int k_size, const T* any_valid) const {
    const int col = chunk_col(), r0 = first_row();
    const bool k_valid = k0 + col < k_size;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const bool valid = k_valid && row[i] != nullptr;
      cp_async_16(dst + (r0 + i * kRowStep) * tile_ld<T>() + col, valid ? row[i] + k0 + col : any_valid, valid);
    }
  }
};

// acc += a_tile . b_tile^T for the warp's 32 rows and 64 weight rows of one K slice.
// a_tile [kTileM][tile_ld], b_tile [kTileN][tile_ld] in shared memory; b_rows[np] is the
// tile row of the warp's n-tile pair np (n-tiles 2np and 2np + 1, 16 rows).
template <typename T>
__device__ __forceinline__ void warp_mma_slice(float (&acc)[kMT][kNT][4], const T* a_tile, const T* b_tile,
                                               const int (&b_rows)[kNT / 2], int warp_m, int lane) {
  constexpr int LD = tile_ld<T>();
#pragma unroll
  for (int k16 = 0; k16 < kTileK; k16 += 16) {
    unsigned a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
      ldmatrix_x4(a[mt], a_tile + (warp_m * kWarpM + mt * 16 + lane % 16) * LD + k16 + (lane / 16) * 8);
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
      // Matrices: rows 0-7 k 0-7, rows 0-7 k 8-15, rows 8-15 k 0-7, rows 8-15 k 8-15.
      unsigned b[4];
      ldmatrix_x4(b, b_tile + (b_rows[np] + lane % 8 + (lane / 16) * 8) * LD + k16 + ((lane / 8) % 2) * 8);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        mma_16816<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// acc = A . B^T over K for the block's tile, through a kStages-deep cp.async pipeline.
// a: the thread's activation rows, b: its weight rows. Every thread must call it.
template <typename T>
__device__ __forceinline__ void tile_product(float (&acc)[kMT][kNT][4], const TileSources<T, kTileM>& a,
                                             const TileSources<T, kTileN>& b, const int (&b_rows)[kNT / 2],
                                             int k_size, const T* any_valid) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kStageElems = (kTileM + kTileN) * tile_ld<T>();
  T* stages = reinterpret_cast<T*>(smem);  // per stage: A [kTileM][LD], then B [kTileN][LD]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / kWarpsN;
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
      a.load(stages + s * kStageElems, s * kTileK, k_size, any_valid);
      b.load(stages + s * kStageElems + kTileM * tile_ld<T>(), s * kTileK, k_size, any_valid);
    }
    cp_async_commit();
  }
  for (int slice = 0; slice < num_slices; ++slice) {
    const int ahead = slice + kStages - 1;
    if (ahead < num_slices) {
      T* stage = stages + (ahead % kStages) * kStageElems;
      a.load(stage, ahead * kTileK, k_size, any_valid);
      b.load(stage + kTileM * tile_ld<T>(), ahead * kTileK, k_size, any_valid);
    }
    cp_async_commit();  // possibly empty: one group per slice keeps the count below right
    cp_async_wait<kStages - 1>();
    __syncthreads();
    const T* stage = stages + (slice % kStages) * kStageElems;
    warp_mma_slice<T>(acc, stage, stage + kTileM * tile_ld<T>(), b_rows, warp_m, lane);
    __syncthreads();  // the stage is refilled by a later load
  }
}

// hidden[row, c] = silu(x[tok] . gate[e, c]) * (x[tok] . up[e, c]) for every sorted row of
// expert e, tok = sorted_pairs[row] / top_k; silu(g) = g / (1 + exp(-g)).
// hidden [P, I] contiguous, x [T, H] (row stride ld_x), gate_up [E, 2I, H] contiguous.
// A block's 128 weight rows are 64 gate rows c0 .. c0 + 63 and the same 64 up rows, and
// each warp holds 32 gate columns and their up columns, so SiLU-and-mul runs in registers.
// Launch: grid (ceil(I / 64), ceil(P / kTileM) + min(E, P)), kThreads threads, dynamic
// shared memory moe_grouped_smem_bytes. Preconditions (checked by the launcher): H, I and
// ld_x are multiples of a 16-byte chunk; x and gate_up are 16-byte aligned.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    moe_grouped_gate_up_kernel(T* __restrict__ hidden, const T* __restrict__ x, const T* __restrict__ gate_up,
                               const int* __restrict__ sorted_pairs, const int* __restrict__ offsets,
                               const int* __restrict__ tile_starts, int num_experts, int top_k, int hidden_size,
                               int inter_size, long long ld_x) {
  constexpr int kCols = kTileN / 2;  // hidden columns per block
  MTile tile;
  if (!find_m_tile(tile_starts, offsets, num_experts, tile)) return;
  const int col0 = blockIdx.x * kCols;

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
  // The warp's n-tiles 0 .. kNT/2 - 1 are gate columns, the rest their up columns.
  const int warp_n = (threadIdx.x / 32) % kWarpsN;
  int b_rows[kNT / 2];
#pragma unroll
  for (int np = 0; np < kNT / 2; ++np) {
    b_rows[np] = (np / (kNT / 4)) * kCols + warp_n * (kWarpN / 2) + (np % (kNT / 4)) * 16;
  }

  float acc[kMT][kNT][4];
  tile_product<T>(acc, a, b, b_rows, hidden_size, x);

  const int lane = threadIdx.x % 32, warp_m = threadIdx.x / 32 / kWarpsN;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = tile.row0 + warp_m * kWarpM + mt * 16 + lane / 4 + 8 * half;
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

// expert_out[row, h] = hidden[row] . down[e, h] for every sorted row of expert e, in fp32.
// expert_out [P, H] float32, hidden [P, I], down [E, H, I], all contiguous.
// Launch: grid (ceil(H / kTileN), ceil(P / kTileM) + min(E, P)), kThreads threads, dynamic
// shared memory moe_grouped_smem_bytes. Preconditions (checked by the launcher): H and I
// are multiples of a 16-byte chunk; hidden and down are 16-byte aligned.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    moe_grouped_down_kernel(float* __restrict__ expert_out, const T* __restrict__ hidden, const T* __restrict__ down,
                            const int* __restrict__ offsets, const int* __restrict__ tile_starts, int num_experts,
                            int hidden_size, int inter_size) {
  MTile tile;
  if (!find_m_tile(tile_starts, offsets, num_experts, tile)) return;
  const int h0 = blockIdx.x * kTileN;

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
  const int warp_n = (threadIdx.x / 32) % kWarpsN;
  int b_rows[kNT / 2];
#pragma unroll
  for (int np = 0; np < kNT / 2; ++np) b_rows[np] = warp_n * kWarpN + np * 16;

  float acc[kMT][kNT][4];
  tile_product<T>(acc, a, b, b_rows, inter_size, hidden);

  const int lane = threadIdx.x % 32, warp_m = threadIdx.x / 32 / kWarpsN;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = tile.row0 + warp_m * kWarpM + mt * 16 + lane / 4 + 8 * half;
      if (row >= tile.row_end) continue;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int h = h0 + warp_n * kWarpN + nt * 8 + (lane % 4) * 2;
        if (h >= hidden_size) continue;  // H is even, so h + 1 < H too
        *reinterpret_cast<float2*>(expert_out + static_cast<long long>(row) * hidden_size + h) =
            make_float2(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
      }
    }
}
