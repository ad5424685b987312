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
constexpr int kCopyRows = kWarpgroupThreads / kRowChunks;              // rows apart of one producer thread's Q copies
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
static_assert(kCopyRows == kSwizzleRows, "a producer thread's query rows share one swizzled chunk offset");
static_assert(kBlockRows % kCopyRows == 0, "the producer's query copies cover the Q tile");
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

// A producer thread's share of every K and V tile: one key row of the tile (two threads a row),
// half of each of its two 64-dim panels. So a thread looks its key up in the block table once a
// tile, and K and V of a tile share that lookup; the two threads of a row read its 32-byte
// sectors whole, chunk 2c + half of a panel each in step c.
constexpr int kThreadsPerKey = kWarpgroupThreads / kKeys;
constexpr int kKeyChunks = kRowChunks / kThreadsPerKey;  // 16-byte chunks of a key row a thread copies
static_assert(kThreadsPerKey == 2, "two producer threads a key row, one half of each panel's chunks each");

// Where a producer thread's key of the next tile lives: the sequence's block and the row in it.
// Keys step kKeys a tile, so the cursor moves without a division after the first.
struct KeyCursor {
  int block, slot, tile_blocks, tile_slots, block_size;

  __device__ KeyCursor(int key, int block_size_)
      : block(key / block_size_), slot(key % block_size_), tile_blocks(kKeys / block_size_),
        tile_slots(kKeys % block_size_), block_size(block_size_) {}

  __device__ __forceinline__ void advance() {
    block += tile_blocks;
    slot += tile_slots;
    if (slot >= block_size) {
      slot -= block_size;
      ++block;
    }
  }
};

// Chunk i of a key row's thread `half`, as a chunk of the row (kChunksPerRow to a panel): panel
// i / 4, that panel's chunk 2 (i % 4) + half.
__device__ __forceinline__ int key_row_chunk(int i, int half) {
  constexpr int kPanelChunks = kKeyChunks / kPanels;  // a thread's chunks of one panel
  return i / kPanelChunks * kChunksPerRow + i % kPanelChunks * kThreadsPerKey + half;
}

// Copies this thread's chunks of one key row (`src`, the row's first element plus the thread's
// half, unread when !valid: zero-filled) to its places in a K or V tile (`dst`: the tile plus
// the row's swizzled offsets, `chunk_offsets`).
template <typename T>
__device__ __forceinline__ void copy_key_row(unsigned char* dst, const T* src, bool valid,
                                             const int (&chunk_offsets)[kKeyChunks]) {
  constexpr int kChunkElems = kChunkBytes / static_cast<int>(sizeof(T));
#pragma unroll
  for (int i = 0; i < kKeyChunks; ++i) {
    // src already holds the thread's half: its chunk i starts key_row_chunk(i, 0) chunks on.
    attn::cp_async_16(dst + chunk_offsets[i], src + key_row_chunk(i, 0) * kChunkElems, valid);
  }
}

// Warpgroup 0. Thread t copies chunk t % 16 of query rows t / 16 + 8 i once, then key row t / 2
// of each K and V tile (copy_key_row). Tiles go in the order the consumers read them, K_{t+1}
// before V_t (S_{t+1} is issued with P_t V_t): a stage is taken (empty) for its K and gets its V
// one tile later, from the block-table lookup its K made.
template <typename T>
__device__ __forceinline__ void produce(const Smem& smem, const T* q, const PackedRows& rows, int first_row,
                                        const PagedKV<T, kHeadDim>& kv, int key_end, int num_tiles) {
  {
    const int chunk = threadIdx.x % kRowChunks, first = threadIdx.x / kRowChunks;
    const int col = chunk * kChunkBytes / static_cast<int>(sizeof(T));
    const int q_offset = panel_offset(kBlockRows, first, chunk);
#pragma unroll
    for (int i = 0; i < kBlockRows / kCopyRows; ++i) {
      const int row = first_row + first + i * kCopyRows;
      const bool valid = row < rows.count();
      attn::cp_async_16(smem.q() + q_offset + i * kCopyRows * kRowBytes,
                        valid ? q + rows.offset(row, kHeadDim) + col : q, valid);
    }
  }
  mbarrier_arrive_on_copies(smem.q_full());

  const int key_row = threadIdx.x / kThreadsPerKey, half = threadIdx.x % kThreadsPerKey;
  int chunk_offsets[kKeyChunks];
#pragma unroll
  for (int i = 0; i < kKeyChunks; ++i) chunk_offsets[i] = panel_offset(kKeys, key_row, key_row_chunk(i, half));
  const int col = half * kChunkBytes / static_cast<int>(sizeof(T));
  KeyCursor cursor(key_row, kv.block_size);
  RingPosition<kStages> k_pos, v_pos;  // the stage K is copied to next, and V
  long long v_offset = 0;              // V_t's row: the element offset K_t's lookup found
  bool v_valid = false;
  for (int tile = -1; tile < num_tiles; ++tile) {
    long long k_offset = 0;
    bool k_valid = false;
    if (tile + 1 < num_tiles) {
      // The lookup goes out before the wait, so its latency hides behind it.
      k_valid = (tile + 1) * kKeys + key_row < key_end;
      if (k_valid) k_offset = kv.offset(cursor.block, cursor.slot) + col;
      cursor.advance();
      mbarrier_wait(smem.empty(k_pos.stage), k_pos.phase ^ 1);
      copy_key_row(smem.k(k_pos.stage), kv.k + k_offset, k_valid, chunk_offsets);
      mbarrier_arrive_on_copies(smem.k_full(k_pos.stage));
      k_pos.advance();
    }
    if (tile >= 0) {
      copy_key_row(smem.v(v_pos.stage), kv.v + v_offset, v_valid, chunk_offsets);
      mbarrier_arrive_on_copies(smem.v_full(v_pos.stage));
      v_pos.advance();
    }
    v_offset = k_offset;
    v_valid = k_valid;
  }
  cp_async_wait_all();  // leave no copy in flight past the thread's exit
}

#endif  // SPARKD_HAS_WGMMA

}  // namespace sparkd::prefill_wgmma
