// Expert GEMMs of a mixture-of-experts layer at prefill-sized batches on Hopper's warpgroup
// tensor cores (wgmma, sm_90a; wgmma.cuh). The operands, outputs and tile plan are those of
// moe_grouped_gemm.cu (its header gives the shapes and the alignment's outputs): a tile is
// kTileM = 128 sorted rows of one expert against kTileN = 256 weight rows, M-tiles numbered by
// moe_tile_plan_kernel's tile_starts. What differs is how a tile is computed, and that the
// grid is persistent.
//
// A block is 3 warpgroups. Warpgroup 0, the producer, streams 64-wide K slices of the tile's
// activation rows (gathered through sorted_pairs for gate_up: TMA cannot gather) and weight
// rows into a kStages-deep ring of shared-memory stages with cp.async; each stage's copies
// complete on its `full` mbarrier. Warpgroups 1 and 2, the consumers, own 64 rows each: per
// slice, 4 wgmma m64n256k16 reading both operands from shared memory through descriptors, the
// 64 x 256 fp32 accumulators in registers (128 a thread). One slice's wgmmas stay in flight
// while the next are issued; a stage goes back to the producer (`empty` mbarrier) once the
// wgmmas reading it have completed. setmaxnreg gives the producer 56 registers a thread and
// the consumers 224. A consumer whose 64 rows all lie past its expert's skips its wgmmas, so
// an expert's last M-tile of at most 64 rows costs about half a tile.
//
// Persistent: gridDim.x is at most the number of SMs, and block b takes tiles b, b + gridDim.x,
// ... of the tile_starts[E] * (weight tiles) tiles, in groups of kGroupM M-tiles, M fastest
// within a group (so the blocks running together share a few experts' weight tiles in L2).
// Producer and consumers walk the same tiles, so the producer fills the next tile's stages
// while the consumers store the last one's outputs. The grid depends on (P, E, N) and the SM
// count only, so launches are graph-capturable.
//
// A stage is A [kTileM rows] then B [kTileN rows] of 128-byte rows (64 K elements) in the
// 128-byte swizzle, each stage on a 1024-byte boundary: the layout a wgmma descriptor with
// swizzle mode 1 describes. Rows past the expert's, weight rows past N and K past its end are
// zero-filled, never read.
#include "attention_mma.cuh"
#include "wgmma.cuh"

using namespace sparkd;
using namespace sparkd::wgmma;
using attn::cp_async_16;
using attn::pack_pair;
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

// A tile: sorted rows [row0, row_end) of `expert`, row_end - row0 <= kTileM, against weight tile n_block.
struct Tile {
  int expert, row0, row_end, n_block;
};

// The tiles of one launch, from moe_tile_plan_kernel's plan.
struct TileWalk {
  const int* tile_starts;
  const int* offsets;
  int num_experts, num_n, num_tiles;

  // The index-th tile in raster order: groups of kGroupM M-tiles times the num_n weight tiles,
  // M fastest within a group.
  __device__ Tile tile(int index) const {
    const int m_tiles = num_tiles / num_n;
    const int group = index / (kGroupM * num_n), in_group = index % (kGroupM * num_n);
    const int group_m = min(m_tiles - group * kGroupM, kGroupM);
    const int m_tile = group * kGroupM + in_group % group_m;
    // The owner is the last expert starting at or before m_tile (experts with no rows start
    // where the next one does, so they come first).
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (__ldg(tile_starts + mid) <= m_tile) lo = mid;
      else hi = mid - 1;
    }
    Tile tile;
    tile.expert = lo;
    tile.row0 = __ldg(offsets + lo) + (m_tile - __ldg(tile_starts + lo)) * kTileM;
    tile.row_end = min(__ldg(offsets + lo + 1), tile.row0 + kTileM);
    tile.n_block = in_group / group_m;
    return tile;
  }
};

// A producer thread's sources for one tile: A rows first_row + i * kCopyRowStep (nullptr past
// the tile's rows); B row r is row r % kHalfN of half r / kHalfN, which starts at b_half[half]
// and has b_rows[half] rows (<= 0: none).
template <typename T>
struct TileSources {
  const T* a[kTileM / kCopyRowStep];
  const T* b_half[2];
  int b_rows[2];
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

// Stores one row of a consumer's outputs in T, 8 bytes a lane: word(g) is this lane's packed pair
// of column group g (columns 8g + 2 (lane % 4) and the next), g < kGroups, and store(col, v)
// writes columns col .. col + 3 of the row. Lanes c and c ^ 1 of a quad trade one word of each
// two groups, so that a quad's four stores cover columns 8g .. 8g + 15: whole 32-byte sectors,
// where a lane's own 4-byte pairs would fill half sectors (measured slower: run 45). Every lane
// of the warp calls it (the trade is a shuffle); store decides what is in bounds.
template <int kGroups, typename Word, typename Store>
__device__ __forceinline__ void store_row_words(const Word& word, const Store& store) {
  const int c = threadIdx.x % 4;
  const bool even = c % 2 == 0;
#pragma unroll
  for (int g = 0; g < kGroups; g += 2) {
    const unsigned first = word(g), second = word(g + 1);
    const unsigned got = __shfl_xor_sync(kFullMask, even ? second : first, 1);
    // Even lanes keep group g's columns 2c .. 2c + 3, odd lanes take group g + 1's 2c - 2 .. 2c + 1.
    store(8 * g + (even ? 2 * c : 8 + 2 * (c - 1)), even ? make_uint2(first, got) : make_uint2(got, second));
  }
}

// A consumer's outputs of one tile, both accumulator row halves through store_row_words: out
// points at the tile's first output column of sorted row 0, rows ld elements apart; word(half,
// group) is the lane's packed pair of column group `group` in row half `half`. Columns at or past
// cols (a multiple of 8 past the tile's first, so a column below it has its next three below it
// too) and rows past the tile's are not stored.
template <int kGroups, typename T, typename Word>
__device__ __forceinline__ void store_tile_rows(const Tile& tile, int consumer, T* out, long long ld, int cols,
                                                const Word& word) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = tile.row0 + consumer * kConsumerRows + accumulator_row(2 * half);
    T* row_out = out + static_cast<long long>(row) * ld;
    store_row_words<kGroups>([&](int group) { return word(half, group); }, [&](int col, uint2 v) {
      if (row < tile.row_end && col < cols) *reinterpret_cast<uint2*>(row_out + col) = v;
    });
  }
}

// hidden[row, c] = silu(x[tok] . gate[e, c]) * (x[tok] . up[e, c]) for every sorted row of
// expert e, tok = sorted_pairs[row] / top_k; silu(g) = g / (1 + exp(-g)).
// hidden [P, I] contiguous, x [T, H] (row stride ld_x), gate_up [E, 2I, H] contiguous.
template <typename T>
struct GateUpProblem {
  T* hidden;
  const T* x;
  const T* gate_up;
  const int* sorted_pairs;
  int top_k, hidden_size, inter_size;
  long long ld_x;

  __device__ int k_size() const { return hidden_size; }
  __device__ int weight_tiles() const { return (inter_size + kHalfN - 1) / kHalfN; }
  __device__ const T* any_valid() const { return x; }

  // B's halves are gate rows c0 .. c0 + 127 and the same up rows, c0 = n_block * kHalfN.
  __device__ void sources(const Tile& tile, int first_row, TileSources<T>& src) const {
#pragma unroll
    for (int i = 0; i < kTileM / kCopyRowStep; ++i) {
      const int row = tile.row0 + first_row + i * kCopyRowStep;
      src.a[i] = row < tile.row_end ? x + static_cast<long long>(__ldg(sorted_pairs + row) / top_k) * ld_x : nullptr;
    }
    const int col0 = tile.n_block * kHalfN;
    const T* gate = gate_up + (static_cast<long long>(tile.expert) * 2 * inter_size + col0) * hidden_size;
    src.b_half[0] = gate;
    src.b_half[1] = gate + static_cast<long long>(inter_size) * hidden_size;
    src.b_rows[0] = src.b_rows[1] = inter_size - col0;
  }

  // A consumer's accumulator column groups 0-15 are gate columns, 16-31 the matching up columns,
  // so SiLU-and-mul pairs elements i and i + kM64N256Outputs / 2 of one thread.
  __device__ void store(const Tile& tile, int consumer, const float (&acc)[kM64N256Outputs]) const {
    const int col0 = tile.n_block * kHalfN;
    store_tile_rows<kHalfN / 8>(tile, consumer, hidden + col0, inter_size, inter_size - col0, [&](int half, int group) {
      const int i = 4 * group + 2 * half;
      float value[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float gate = acc[i + j], up = acc[i + j + kM64N256Outputs / 2];
        value[j] = gate / (1.f + expf(-gate)) * up;
      }
      return pack_pair<T>(value[0], value[1]);
    });
  }
};

// expert_out[row, h] = hidden[row] . down[e, h] for every sorted row of expert e, summed in fp32
// and rounded to T. expert_out [P, H], hidden [P, I], down [E, H, I], all in T and contiguous.
template <typename T>
struct DownProblem {
  T* expert_out;
  const T* hidden;
  const T* down;
  int hidden_size, inter_size;

  __device__ int k_size() const { return inter_size; }
  __device__ int weight_tiles() const { return (hidden_size + kTileN - 1) / kTileN; }
  __device__ const T* any_valid() const { return hidden; }

  // B is down rows h0 .. h0 + 255 of the expert, h0 = n_block * kTileN, in two halves.
  __device__ void sources(const Tile& tile, int first_row, TileSources<T>& src) const {
#pragma unroll
    for (int i = 0; i < kTileM / kCopyRowStep; ++i) {
      const int row = tile.row0 + first_row + i * kCopyRowStep;
      src.a[i] = row < tile.row_end ? hidden + static_cast<long long>(row) * inter_size : nullptr;
    }
    const int h0 = tile.n_block * kTileN;
    src.b_half[0] = down + (static_cast<long long>(tile.expert) * hidden_size + h0) * inter_size;
    src.b_half[1] = src.b_half[0] + static_cast<long long>(kHalfN) * inter_size;
    src.b_rows[0] = hidden_size - h0;
    src.b_rows[1] = hidden_size - h0 - kHalfN;
  }

  __device__ void store(const Tile& tile, int consumer, const float (&acc)[kM64N256Outputs]) const {
    const int h0 = tile.n_block * kTileN;
    store_tile_rows<kTileN / 8>(tile, consumer, expert_out + h0, hidden_size, hidden_size - h0,
                                [&](int half, int group) {
                                  const int i = 4 * group + 2 * half;
                                  return pack_pair<T>(acc[i], acc[i + 1]);
                                });
  }
};

#if defined(SPARKD_HAS_WGMMA)

// Warpgroup 0: fills the ring, one K slice of the tile's A and B rows per stage. Thread t
// copies 16-byte chunk t % 8 of rows t / 8 + i * kCopyRowStep of A and of B.
template <typename T, typename Problem>
__device__ __forceinline__ void produce(const Problem& problem, const Ring& ring, const TileWalk& walk) {
  constexpr int kChunkElems = kChunkBytes / static_cast<int>(sizeof(T));
  constexpr int kHalfRows = kHalfN / kCopyRowStep;  // a thread's rows in one half of B
  const int chunk = threadIdx.x % kChunksPerRow, first_row = threadIdx.x / kChunksPerRow;
  const int offset = swizzled_offset(first_row, chunk);
  const int k_size = problem.k_size(), num_slices = (k_size + kTileK - 1) / kTileK;
  RingPosition<kStages> pos;
  for (int index = blockIdx.x; index < walk.num_tiles; index += gridDim.x) {
    TileSources<T> src;
    problem.sources(walk.tile(index), first_row, src);
    for (int slice = 0; slice < num_slices; ++slice) {
      const int col = slice * kTileK + chunk * kChunkElems;
      const bool k_valid = col < k_size;
      mbarrier_wait(ring.empty(pos.stage), pos.phase ^ 1);
      unsigned char* a_dst = ring.a_tile(pos.stage) + offset;
#pragma unroll
      for (int i = 0; i < kTileM / kCopyRowStep; ++i) {
        const bool valid = k_valid && src.a[i] != nullptr;
        cp_async_16(a_dst + i * kCopyRowStep * kRowBytes, valid ? src.a[i] + col : problem.any_valid(), valid);
      }
      unsigned char* b_dst = ring.b_tile(pos.stage) + offset;
#pragma unroll
      for (int i = 0; i < kTileN / kCopyRowStep; ++i) {
        const int half = i / kHalfRows, row = first_row + (i % kHalfRows) * kCopyRowStep;
        const bool valid = k_valid && row < src.b_rows[half];
        const T* from = src.b_half[half] + static_cast<long long>(row) * k_size + col;
        cp_async_16(b_dst + i * kCopyRowStep * kRowBytes, valid ? from : problem.any_valid(), valid);
      }
      mbarrier_arrive_on_copies(ring.full(pos.stage));
      pos.advance();
    }
  }
  cp_async_wait_all();  // leave no copy in flight past the thread's exit
}

// The stage's wgmmas have completed for this warp: one of the stage's kConsumers * 4 arrivals.
__device__ __forceinline__ void release(const Ring& ring, int stage) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) mbarrier_arrive(ring.empty(stage));
}

// Warpgroups 1 and 2: consumer c computes tile rows 64c .. 64c + 63 against all 256 weight rows.
template <typename T, typename Problem>
__device__ __forceinline__ void consume(const Problem& problem, const Ring& ring, const TileWalk& walk) {
  constexpr int kSteps = kTileK * 2 / kStepBytes;  // wgmmas per slice
  const int consumer = threadIdx.x / kWarpgroupThreads - 1;
  const int num_slices = (problem.k_size() + kTileK - 1) / kTileK;
  RingPosition<kStages> pos;
  float acc[kM64N256Outputs];
  for (int index = blockIdx.x; index < walk.num_tiles; index += gridDim.x) {
    const Tile tile = walk.tile(index);
    const bool active = tile.row0 + consumer * kConsumerRows < tile.row_end;
#pragma unroll
    for (int i = 0; i < kM64N256Outputs; ++i) acc[i] = 0.f;
    int previous = 0;
    for (int slice = 0; slice < num_slices; ++slice) {
      mbarrier_wait(ring.full(pos.stage), pos.phase);
      if (active) {
        const unsigned a = smem_addr(ring.a_tile(pos.stage) + consumer * kConsumerRows * kRowBytes);
        const unsigned b = smem_addr(ring.b_tile(pos.stage));
        fence_operands(acc);
        wgmma_fence();
#pragma unroll
        for (int step = 0; step < kSteps; ++step)
          wgmma_m64n256k16<T>(acc, tile_descriptor(a + step * kStepBytes), tile_descriptor(b + step * kStepBytes));
        wgmma_commit();
        wgmma_wait<1>();  // the previous slice's wgmmas are done
        fence_operands(acc);
      }
      if (slice > 0) release(ring, previous);
      previous = pos.stage;
      pos.advance();
    }
    wgmma_wait<0>();
    fence_operands(acc);
    if (num_slices > 0) release(ring, previous);
    if (active) problem.store(tile, consumer, acc);
  }
}

#endif  // SPARKD_HAS_WGMMA

// The body of both kernels: barriers, then one role per warpgroup.
template <typename T, typename Problem>
__device__ __forceinline__ void run_tiles(const Problem& problem, const int* tile_starts, const int* offsets,
                                          int num_experts) {
#if defined(SPARKD_HAS_WGMMA)
  const Ring ring = shared_ring();
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < kStages; ++stage) {
      mbarrier_init(ring.full(stage), kWarpgroupThreads);            // every producer thread's copies
      mbarrier_init(ring.empty(stage), kConsumers * kWarpsPerConsumer);  // every consumer warp
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  const int num_n = problem.weight_tiles();
  const TileWalk walk{tile_starts, offsets, num_experts, num_n, __ldg(tile_starts + num_experts) * num_n};
  if (threadIdx.x < kWarpgroupThreads) {
    setmaxnreg_dec<kProducerRegisters>();
    produce<T>(problem, ring, walk);
  } else {
    setmaxnreg_inc<kConsumerRegisters>();
    consume<T>(problem, ring, walk);
  }
#else
  __trap();  // built for another target: the host launches these on sm_90 only
#endif
}

// Launch (both kernels): grid min(SMs, num_slots * weight tiles) with num_slots = ceil(P / kTileM)
// + min(E, P), kThreads threads, dynamic shared memory kSwizzleBytes + kStages * kStageBytes +
// 16 * kStages (alignment slack, stages, barriers). Preconditions (checked by the launcher): H,
// I and ld_x are whole 16-byte chunks; the operands are 16-byte aligned; tile_starts is
// moe_tile_plan_kernel's plan of offsets.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    moe_grouped_gate_up_wgmma_kernel(T* __restrict__ hidden, const T* __restrict__ x, const T* __restrict__ gate_up,
                                     const int* __restrict__ sorted_pairs, const int* __restrict__ offsets,
                                     const int* __restrict__ tile_starts, int num_experts, int top_k, int hidden_size,
                                     int inter_size, long long ld_x) {
  const GateUpProblem<T> problem{hidden, x, gate_up, sorted_pairs, top_k, hidden_size, inter_size, ld_x};
  run_tiles<T>(problem, tile_starts, offsets, num_experts);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    moe_grouped_down_wgmma_kernel(T* __restrict__ expert_out, const T* __restrict__ hidden,
                                  const T* __restrict__ down, const int* __restrict__ offsets,
                                  const int* __restrict__ tile_starts, int num_experts, int hidden_size,
                                  int inter_size) {
  const DownProblem<T> problem{expert_out, hidden, down, hidden_size, inter_size};
  run_tiles<T>(problem, tile_starts, offsets, num_experts);
}
