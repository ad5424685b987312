// The layout of attention_prefill_wgmma.cu's block (its constants, shared-memory tiles and
// barriers) and its producer warpgroup, which copies the Q tile once and the K and V tiles
// through the block table into the ring. attention_prefill_wgmma.cu has the consumers and the
// kernel, and its header comment the whole design.
#pragma once

#include "wgmma_attention.cuh"

namespace sparkd::prefill_wgmma {

using namespace sparkd::wgmma;
using attn::PackedRows;
using attn::PagedKV;

constexpr int kHeadDim = 128;
constexpr int kBlockRows = 128;     // packed query rows per block
constexpr int kConsumerRows = 64;   // wgmma M
constexpr int kConsumers = kBlockRows / kConsumerRows;
constexpr int kKeys = 64;           // keys per K / V tile: the N of S = Q K^T
constexpr int kStages = 4;
constexpr int kThreads = kWarpgroupThreads * (1 + kConsumers);
constexpr int kRowChunks = kHeadDim * 2 / kChunkBytes;                 // 16-byte chunks of a row
constexpr int kCopyRows = kWarpgroupThreads / kRowChunks;              // rows apart of one producer thread's copies
constexpr int kPanels = kHeadDim / kPanelDims;
constexpr int kQPanelBytes = kBlockRows * kRowBytes;                   // a panel of the Q tile
constexpr int kKvPanelBytes = kKeys * kRowBytes;                       // a panel of a K or V tile
constexpr int kQTileBytes = kPanels * kQPanelBytes;
constexpr int kKvTileBytes = kPanels * kKvPanelBytes;
// The register pool of a 384-thread block under __launch_bounds__(kThreads, 1) is 168 a thread
// (the launcher checks it); the budgets below must fit it.
constexpr int kLaunchRegisters = 168;
constexpr int kProducerRegisters = 56, kConsumerRegisters = 224;
static_assert(kStages >= 3, "a consumer releases tile t - 2's stage after waiting for K_t (the producer's K_t needs tile t - kStages's)");
static_assert(kCopyRows == kSwizzleRows, "a producer thread's rows share one swizzled chunk offset");
static_assert(kKeys % kCopyRows == 0 && kBlockRows % kCopyRows == 0, "the producer's copies cover whole tiles");
static_assert(kKeys == 64 && kHeadDim == 128, "S [64, kKeys] is an m64n64 and O [64, kHeadDim] an m64n128 accumulator");
static_assert(kWarpgroupThreads * (kProducerRegisters + kConsumers * kConsumerRegisters) <= kThreads * kLaunchRegisters,
              "the register budgets fit the block's pool");

// Dynamic shared memory from its first swizzle-period boundary: the Q tile, kStages stages of
// K then V, then the barriers q_full, k_full[kStages], v_full[kStages], empty[kStages].
struct Smem {
  unsigned char* tiles;
  unsigned barriers;  // shared address of q_full

  __device__ unsigned char* q() const { return tiles; }
  __device__ unsigned char* k(int stage) const { return tiles + kQTileBytes + 2 * stage * kKvTileBytes; }
  __device__ unsigned char* v(int stage) const { return k(stage) + kKvTileBytes; }
  __device__ unsigned q_full() const { return barriers; }
  __device__ unsigned k_full(int stage) const { return barriers + 8 * (1 + stage); }
  __device__ unsigned v_full(int stage) const { return barriers + 8 * (1 + kStages + stage); }
  __device__ unsigned empty(int stage) const { return barriers + 8 * (1 + 2 * kStages + stage); }
};

__device__ __forceinline__ Smem shared_tiles() {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* tiles = smem + (kSwizzleBytes - attn::smem_addr(smem) % kSwizzleBytes) % kSwizzleBytes;
  return {tiles, attn::smem_addr(tiles + kQTileBytes + 2 * kStages * kKvTileBytes)};
}

#if defined(SPARKD_HAS_WGMMA)

constexpr int kCopiesPerTile = kKeys / kCopyRows;  // a producer thread's rows of one K or V tile

// Copies 16 bytes at column `col` of keys key, key + kCopyRows, ... of one cache (the thread's
// share of a tile) to dst, dst + kCopyRows rows, ...; keys >= key_end are zero-filled. Unrolled,
// so the block-table reads are independent and in flight together, not one latency a copy.
template <typename T>
__device__ __forceinline__ void copy_keys(unsigned char* dst, const T* cache, const PagedKV<T, kHeadDim>& kv, int key,
                                          int key_end, int col) {
  // One division for the first key, then the later keys step through the blocks.
  int block = key / kv.block_size, slot = key % kv.block_size;
#pragma unroll
  for (int i = 0; i < kCopiesPerTile; ++i, key += kCopyRows) {
    const bool valid = key < key_end;
    attn::cp_async_16(dst + i * kCopyRows * kRowBytes, valid ? cache + kv.offset(block, slot) + col : cache, valid);
    for (slot += kCopyRows; slot >= kv.block_size; slot -= kv.block_size) ++block;
  }
}

// Warpgroup 0. Thread t copies chunk t % 16 of rows t / 16 + 8 i of each tile. Tiles go in the
// order the consumers read them, K_{t+1} before V_t (S_{t+1} is issued with P_t V_t): a stage
// is taken (empty) for its K and gets its V one tile later.
template <typename T>
__device__ __forceinline__ void produce(const Smem& smem, const T* q, const PackedRows& rows, int first_row,
                                        const PagedKV<T, kHeadDim>& kv, int key_end, int num_tiles) {
  const int chunk = threadIdx.x % kRowChunks, first = threadIdx.x / kRowChunks;
  const int col = chunk * kChunkBytes / static_cast<int>(sizeof(T));
  const int q_offset = panel_offset(kBlockRows, first, chunk), kv_offset = panel_offset(kKeys, first, chunk);
#pragma unroll
  for (int i = 0; i < kBlockRows / kCopyRows; ++i) {
    const int row = first_row + first + i * kCopyRows;
    const bool valid = row < rows.count();
    attn::cp_async_16(smem.q() + q_offset + i * kCopyRows * kRowBytes,
                      valid ? q + rows.offset(row, kHeadDim) + col : q, valid);
  }
  mbarrier_arrive_on_copies(smem.q_full());
  RingPosition<kStages> k_pos, v_pos;  // the stage K is copied to next, and V
  for (int tile = -1; tile < num_tiles; ++tile) {
    if (tile + 1 < num_tiles) {
      mbarrier_wait(smem.empty(k_pos.stage), k_pos.phase ^ 1);
      copy_keys(smem.k(k_pos.stage) + kv_offset, kv.k, kv, (tile + 1) * kKeys + first, key_end, col);
      mbarrier_arrive_on_copies(smem.k_full(k_pos.stage));
      k_pos.advance();
    }
    if (tile >= 0) {
      copy_keys(smem.v(v_pos.stage) + kv_offset, kv.v, kv, tile * kKeys + first, key_end, col);
      mbarrier_arrive_on_copies(smem.v_full(v_pos.stage));
      v_pos.advance();
    }
  }
  cp_async_wait_all();  // leave no copy in flight past the thread's exit
}

#endif  // SPARKD_HAS_WGMMA

}  // namespace sparkd::prefill_wgmma
