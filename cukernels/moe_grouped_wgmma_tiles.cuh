// The tiles of moe_grouped_wgmma.cu's GEMMs and how a block walks them: the block's constants,
// a tile (sorted rows of one expert against a weight tile), the persistent, clustered walk over
// moe_tile_plan_kernel's plan, and the ring of shared-memory stages the producer fills.
// moe_grouped_wgmma.cu's header comment gives the whole design.
#pragma once

#include "moe_route.cuh"  // kMaxExperts
#include "wgmma.cuh"

namespace sparkd::moe_wgmma {

using namespace sparkd::wgmma;
using attn::smem_addr;

constexpr int kTileM = 128;         // sorted rows per tile: moe_grouped_gemm.cu's M-tile
constexpr int kTileN = 256;         // weight rows per tile
constexpr int kHalfN = kTileN / 2;  // gate_up: 128 gate rows, then the 128 matching up rows
constexpr int kTileK = kRowBytes / 2;  // K per stage: one 128-byte row of 16-bit elements
constexpr int kConsumerRows = 64;      // wgmma M
constexpr int kConsumers = kTileM / kConsumerRows;
constexpr int kThreads = kWarpgroupThreads * (1 + kConsumers);
constexpr int kStages = 4;
constexpr int kGroupM = 8;  // M-tiles per raster group
constexpr int kHalfBytes = kHalfN * kRowBytes;  // one TMA box: 128 weight rows of a 64-wide K slice
constexpr int kStageBytes = (kTileM + kTileN) * kRowBytes;
// setmaxnreg moves registers within the block's pool, the 168 a thread ptxas gives a block of
// 384 threads under __launch_bounds__(kThreads, 1) (the launcher checks the count): the
// producer's 56 (at 40 its copy addresses spill) and the consumers' 224 must fit it.
constexpr int kLaunchRegisters = 168;
constexpr int kProducerRegisters = 56, kConsumerRegisters = 224;
constexpr int kCopyRowStep = kWarpgroupThreads / kChunksPerRow;   // rows apart of one producer thread's copies
constexpr int kWarpsPerConsumer = kWarpgroupThreads / 32;
static_assert(kCopyRowStep % kSwizzleRows == 0, "a producer thread's rows share one swizzled chunk offset");
static_assert(kStageBytes % kSwizzleBytes == 0 && (kConsumerRows * kRowBytes) % kSwizzleBytes == 0,
              "every operand tile starts on a swizzle period");
static_assert(kWarpgroupThreads * (kProducerRegisters + kConsumers * kConsumerRegisters) <= kThreads * kLaunchRegisters,
              "the register budgets fit the block's pool");
static_assert(kTileN / 2 == kM64N256Outputs, "a consumer's 64 x 256 accumulators are one m64n256 wgmma's");
static_assert(kHalfBytes % kSwizzleBytes == 0, "each half of B starts on a swizzle period");

// A tile: sorted rows [row0, row_end) of `expert`, row_end - row0 <= kTileM (none: row0 ==
// row_end), against weight tile n_block.
struct Tile {
  int expert, row0, row_end, n_block;
};

// The tiles of one launch as this block sees them: cluster tile t of expert e is its M-tiles
// tile_starts[e] + kCluster * (t - cluster_starts[e]) + rank, the ones below tile_starts[e + 1].
template <int kCluster>
struct TileWalk {
  const int* tile_starts;     // [E + 1], global
  const int* cluster_starts;  // [E + 1], shared: sum over e' < e of ceil(M-tiles of e' / kCluster)
  const int* offsets;
  int num_experts, num_n, num_tiles, rank;  // num_tiles: cluster tiles times num_n

  // The index-th cluster tile in raster order (groups of kGroupM / kCluster cluster tiles times
  // the num_n weight tiles, M fastest within a group), as this block's rank takes it.
  __device__ Tile tile(int index) const {
    constexpr int kGroup = kGroupM / kCluster;
    const int m_tiles = num_tiles / num_n;
    const int group = index / (kGroup * num_n), in_group = index % (kGroup * num_n);
    const int group_m = min(m_tiles - group * kGroup, kGroup);
    const int m_tile = group * kGroup + in_group % group_m;
    // The owner is the last expert starting at or before m_tile (experts with no rows start
    // where the next one does, so they come first).
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (cluster_starts[mid] <= m_tile) lo = mid;
      else hi = mid - 1;
    }
    const int own_tile = __ldg(tile_starts + lo) + kCluster * (m_tile - cluster_starts[lo]) + rank;
    const int expert_end = __ldg(offsets + lo + 1);
    Tile tile;
    tile.expert = lo;
    tile.row0 = min(__ldg(offsets + lo) + (own_tile - __ldg(tile_starts + lo)) * kTileM, expert_end);
    tile.row_end = min(expert_end, tile.row0 + kTileM);
    tile.n_block = in_group / group_m;
    return tile;
  }
};

// cluster_starts[e] for e <= E from tile_starts, by the block's first warp (a scan over 32
// experts a step); the caller synchronises before the block reads it.
template <int kCluster>
__device__ __forceinline__ void scan_cluster_starts(const int* tile_starts, int num_experts, int* cluster_starts) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  int carry = 0;
  for (int base = 0; base < num_experts; base += 32) {
    const int e = base + lane;
    const int m_tiles = e < num_experts ? __ldg(tile_starts + e + 1) - __ldg(tile_starts + e) : 0;
    int sum = (m_tiles + kCluster - 1) / kCluster;
#pragma unroll
    for (int step = 1; step < 32; step *= 2) {
      const int before = __shfl_up_sync(kFullMask, sum, step);
      if (lane >= step) sum += before;
    }
    if (e < num_experts) cluster_starts[e + 1] = carry + sum;
    carry += __shfl_sync(kFullMask, sum, 31);
  }
  if (lane == 0) cluster_starts[0] = 0;
}

// A producer thread's activation rows of one tile: rows first_row + i * kCopyRowStep (nullptr
// past the tile's rows).
template <typename T>
struct TileSources {
  const T* a[kTileM / kCopyRowStep];

  // a[i] = row_pointer(row) for each of those rows of `tile` (row_pointer: sorted row -> const T*).
  template <typename RowPointer>
  __device__ __forceinline__ void fill(const Tile& tile, int first_row, RowPointer row_pointer) {
#pragma unroll
    for (int i = 0; i < kTileM / kCopyRowStep; ++i) {
      const int row = tile.row0 + first_row + i * kCopyRowStep;
      a[i] = row < tile.row_end ? row_pointer(row) : nullptr;
    }
  }
};

// The stages and their barriers in dynamic shared memory, from its first swizzle-period boundary:
// kStages stages of A then B, then kStages `full` and kStages `empty` barriers.
struct Ring {
  unsigned char* tiles;
  unsigned barriers;  // shared address of full[0]

  __device__ unsigned char* a_tile(int stage) const { return tiles + stage * kStageBytes; }
  __device__ unsigned char* b_tile(int stage) const { return a_tile(stage) + kTileM * kRowBytes; }
  __device__ unsigned full(int stage) const { return barriers + 8 * stage; }
  __device__ unsigned empty(int stage) const { return barriers + 8 * (kStages + stage); }
};

__device__ __forceinline__ Ring shared_ring() {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* tiles = smem + (kSwizzleBytes - smem_addr(smem) % kSwizzleBytes) % kSwizzleBytes;
  return {tiles, smem_addr(tiles + kStages * kStageBytes)};
}

}  // namespace sparkd::moe_wgmma
