// Expert GEMMs of a mixture-of-experts layer at prefill-sized batches on Hopper's warpgroup
// tensor cores (wgmma, sm_90a; wgmma.cuh). The operands, outputs and tile plan are those of
// moe_grouped_gemm.cu (its header gives the shapes and the alignment's outputs): a tile is
// kTileM = 128 sorted rows of one expert against kTileN = 256 weight rows, M-tiles numbered by
// moe_tile_plan_kernel's tile_starts. What differs is how a tile is computed, that the grid is
// persistent, and that the blocks run in clusters of kCluster that share weight tiles.
//
// A block is 3 warpgroups. Warpgroup 0, the producer, streams 64-wide K slices of the tile's
// activation rows (gathered through sorted_pairs for gate_up: TMA cannot gather) with cp.async,
// and of its weight rows with TMA (tma.cuh), into a kStages-deep ring of shared-memory stages;
// each stage's copies complete on its `full` mbarrier. Warpgroups 1 and 2, the consumers, own 64
// rows each: per slice, 4 wgmma m64n256k16 reading both operands from shared memory through
// descriptors, the 64 x 256 fp32 accumulators in registers (128 a thread). One slice's wgmmas
// stay in flight while the next are issued; a stage goes back to the producers (`empty` mbarrier)
// once the wgmmas reading it have completed. setmaxnreg gives the producer 56 registers a thread
// and the consumers 224. A consumer whose 64 rows all lie past its expert's skips its wgmmas, so
// an expert's last M-tile of at most 64 rows costs about half a tile.
//
// Weight tiles shared by a cluster: the kCluster blocks of a cluster take kCluster consecutive
// M-tiles of one expert (a "cluster tile"; block r the r-th, none where the expert has fewer)
// against the same weight tile, so they need the same weight slices: with kCluster = 2, block r
// loads half r of each slice (128 weight rows) and multicasts it into both blocks' stages, so a
// weight byte leaves L2 once for two M-tiles; with kCluster = 1 the block loads both halves. A stage is therefore free only once every
// block of the cluster has consumed it: each consumer warp arrives on the `empty` barrier of every
// block of its cluster, and the producers wait for all of those arrivals.
//
// Persistent: gridDim.x is at most the number of SMs, and cluster c takes cluster tiles c, c +
// (clusters), ... of the cluster tiles times the weight tiles, in groups of kGroupM M-tiles, M
// fastest within a group (so the blocks running together share a few experts' weight tiles in
// L2). Producer and consumers walk the same tiles, so the producer fills the next tile's stages
// while the consumers store the last one's outputs. The grid depends on (P, E, N) and the SM
// count only, so launches are graph-capturable.
//
// A stage is A [kTileM rows] then B [kTileN rows] of 128-byte rows (64 K elements) in the
// 128-byte swizzle, each stage on a 1024-byte boundary: the layout a wgmma descriptor with
// swizzle mode 1 describes, and the one TMA writes with CU_TENSOR_MAP_SWIZZLE_128B. Rows past the
// expert's, weight rows past N and K past its end are zero-filled, never read.
#include "attention_mma.cuh"
#include "cluster.cuh"
#include "moe_route.cuh"  // kMaxExperts
#include "tma.cuh"
#include "wgmma.cuh"

using namespace sparkd;
using namespace sparkd::wgmma;
using sparkd::tma::TensorMap;
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
// hidden [P, I] contiguous, x [T, H] (row stride ld_x); the weights gate_up [E, 2I, H] contiguous,
// read through `weights`, a map of them as [2E, I, H] (a box: 128 rows of 64 elements).
template <typename T>
struct GateUpProblem {
  T* hidden;
  const T* x;
  const TensorMap* weights;
  const int* sorted_pairs;
  int top_k, hidden_size, inter_size;
  long long ld_x;

  __device__ int k_size() const { return hidden_size; }
  __device__ int weight_tiles() const { return (inter_size + kHalfN - 1) / kHalfN; }
  __device__ const T* any_valid() const { return x; }

  __device__ void sources(const Tile& tile, int first_row, TileSources<T>& src) const {
#pragma unroll
    for (int i = 0; i < kTileM / kCopyRowStep; ++i) {
      const int row = tile.row0 + first_row + i * kCopyRowStep;
      src.a[i] = row < tile.row_end ? x + static_cast<long long>(__ldg(sorted_pairs + row) / top_k) * ld_x : nullptr;
    }
  }

  // B's halves are gate rows c0 .. c0 + 127 and the same up rows, c0 = n_block * kHalfN: rows
  // c0.. of matrices 2e and 2e + 1 of the map.
  __device__ int2 b_box(const Tile& tile, int half) const {
    return make_int2(tile.n_block * kHalfN, 2 * tile.expert + half);
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
// and rounded to T. expert_out [P, H], hidden [P, I], all in T and contiguous; the weights down
// [E, H, I] contiguous, read through `weights`, a map of them as such (a box: 128 rows of 64).
template <typename T>
struct DownProblem {
  T* expert_out;
  const T* hidden;
  const TensorMap* weights;
  int hidden_size, inter_size;

  __device__ int k_size() const { return inter_size; }
  __device__ int weight_tiles() const { return (hidden_size + kTileN - 1) / kTileN; }
  __device__ const T* any_valid() const { return hidden; }

  __device__ void sources(const Tile& tile, int first_row, TileSources<T>& src) const {
#pragma unroll
    for (int i = 0; i < kTileM / kCopyRowStep; ++i) {
      const int row = tile.row0 + first_row + i * kCopyRowStep;
      src.a[i] = row < tile.row_end ? hidden + static_cast<long long>(row) * inter_size : nullptr;
    }
  }

  // B is down rows h0 .. h0 + 255 of the expert, h0 = n_block * kTileN, in two halves.
  __device__ int2 b_box(const Tile& tile, int half) const {
    return make_int2(tile.n_block * kTileN + half * kHalfN, tile.expert);
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

// The weight half `half` of a stage, into every block of the cluster (kCluster 2) or this one.
template <int kCluster, typename Problem>
__device__ __forceinline__ void load_weight_half(const Problem& problem, const Ring& ring, int stage, const Tile& tile,
                                                 int half, int k0) {
  const unsigned dst = smem_addr(ring.b_tile(stage)) + half * kHalfBytes;
  const int2 box = problem.b_box(tile, half);
  if constexpr (kCluster == 1) {
    tma::load_box_3d(dst, *problem.weights, ring.full(stage), k0, box.x, box.y);
  } else {
    tma::load_box_3d_multicast(dst, *problem.weights, ring.full(stage), k0, box.x, box.y, (1 << kCluster) - 1);
  }
}

// Warpgroup 0: fills the ring, one K slice of the tile's A and B rows per stage. Thread t copies
// 16-byte chunk t % 8 of A rows t / 8 + i * kCopyRowStep; thread 0 also expects the stage's B
// bytes and asks TMA for this block's share of them.
template <typename T, int kCluster, typename Problem>
__device__ __forceinline__ void produce(const Problem& problem, const Ring& ring, const TileWalk<kCluster>& walk) {
  constexpr int kChunkElems = kChunkBytes / static_cast<int>(sizeof(T));
  const int chunk = threadIdx.x % kChunksPerRow, first_row = threadIdx.x / kChunksPerRow;
  const int offset = swizzled_offset(first_row, chunk);
  const int k_size = problem.k_size(), num_slices = (k_size + kTileK - 1) / kTileK;
  if (threadIdx.x == 0) tma::prefetch_map(*problem.weights);
  RingPosition<kStages> pos;
  for (int index = tma::cluster_index(); index < walk.num_tiles; index += tma::cluster_count()) {
    const Tile tile = walk.tile(index);
    TileSources<T> src;
    problem.sources(tile, first_row, src);
    for (int slice = 0; slice < num_slices; ++slice) {
      const int col = slice * kTileK + chunk * kChunkElems;
      const bool k_valid = col < k_size;
      // Every block's consumers have freed the stage: its B lands in all of them.
      mbarrier_wait(ring.empty(pos.stage), pos.phase ^ 1);
      if (threadIdx.x == 0) {
        tma::mbarrier_arrive_expect_tx(ring.full(pos.stage), kTileN * kRowBytes);
        for (int half = walk.rank; half < 2; half += kCluster)
          load_weight_half<kCluster>(problem, ring, pos.stage, tile, half, slice * kTileK);
      }
      unsigned char* a_dst = ring.a_tile(pos.stage) + offset;
#pragma unroll
      for (int i = 0; i < kTileM / kCopyRowStep; ++i) {
        const bool valid = k_valid && src.a[i] != nullptr;
        cp_async_16(a_dst + i * kCopyRowStep * kRowBytes, valid ? src.a[i] + col : problem.any_valid(), valid);
      }
      mbarrier_arrive_on_copies(ring.full(pos.stage));
      pos.advance();
    }
  }
  cp_async_wait_all();  // leave no copy in flight past the thread's exit
}

// The stage's wgmmas have completed for this warp: one of the stage's kCluster * kConsumers * 4
// arrivals, on the stage's barrier in every block of the cluster (their producers fill it next).
template <int kCluster>
__device__ __forceinline__ void release(const Ring& ring, int stage) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int rank = 0; rank < kCluster; ++rank) tma::mbarrier_arrive_in_block(ring.empty(stage), rank);
  }
}

// Warpgroups 1 and 2: consumer c computes tile rows 64c .. 64c + 63 against all 256 weight rows.
template <typename T, int kCluster, typename Problem>
__device__ __forceinline__ void consume(const Problem& problem, const Ring& ring, const TileWalk<kCluster>& walk) {
  constexpr int kSteps = kTileK * 2 / kStepBytes;  // wgmmas per slice
  const int consumer = threadIdx.x / kWarpgroupThreads - 1;
  const int num_slices = (problem.k_size() + kTileK - 1) / kTileK;
  RingPosition<kStages> pos;
  float acc[kM64N256Outputs];
  for (int index = tma::cluster_index(); index < walk.num_tiles; index += tma::cluster_count()) {
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
      if (slice > 0) release<kCluster>(ring, previous);
      previous = pos.stage;
      pos.advance();
    }
    wgmma_wait<0>();
    fence_operands(acc);
    if (num_slices > 0) release<kCluster>(ring, previous);
    if (active) problem.store(tile, consumer, acc);
  }
}

#endif  // SPARKD_HAS_WGMMA

// The body of both kernels: barriers and the cluster tiles' starts, then one role per warpgroup.
template <typename T, int kCluster, typename Problem>
__device__ __forceinline__ void run_tiles(const Problem& problem, const int* tile_starts, const int* offsets,
                                          int num_experts) {
#if defined(SPARKD_HAS_WGMMA)
  __shared__ int cluster_starts[kMaxExperts + 1];
  const Ring ring = shared_ring();
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < kStages; ++stage) {
      // Every producer thread's copies and thread 0's expected weight bytes.
      mbarrier_init(ring.full(stage), kWarpgroupThreads + 1);
      mbarrier_init(ring.empty(stage), kCluster * kConsumers * kWarpsPerConsumer);  // every consumer warp of the cluster
    }
    mbarrier_init_fence();
  }
  scan_cluster_starts<kCluster>(tile_starts, num_experts, cluster_starts);
  // The other blocks' barriers are initialised before anything arrives on them or lands in them.
  cluster_barrier();
  const int num_n = problem.weight_tiles();
  const TileWalk<kCluster> walk{tile_starts, cluster_starts, offsets, num_experts, num_n,
                                cluster_starts[num_experts] * num_n, tma::cluster_rank()};
  if (threadIdx.x < kWarpgroupThreads) {
    setmaxnreg_dec<kProducerRegisters>();
    produce<T, kCluster>(problem, ring, walk);
  } else {
    setmaxnreg_inc<kConsumerRegisters>();
    consume<T, kCluster>(problem, ring, walk);
  }
  // No block exits while another may still multicast into it or arrive on its barriers.
  cluster_barrier();
#else
  __trap();  // built for another target: the host launches these on sm_90 only
#endif
}

// Launch (both kernels): clusters of kCluster blocks along x, a grid of kCluster times at most
// the clusters the device holds at once and at most min(SMs, num_cluster_slots * weight tiles),
// num_cluster_slots = ceil(P / (kCluster * kTileM)) + min(E, P); kThreads threads, dynamic
// shared memory kSwizzleBytes + kStages * kStageBytes + 16 * kStages (alignment slack, stages,
// barriers). `weights`: a tensor map of the weights as each problem names, 128-byte swizzle, a
// box of 64 x 128 x 1. Preconditions (checked by the launcher): H, I and ld_x are whole 16-byte
// chunks; the operands are 16-byte aligned; tile_starts is moe_tile_plan_kernel's plan of
// offsets; E <= kMaxExperts.
template <typename T, int kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    moe_grouped_gate_up_wgmma_kernel(T* __restrict__ hidden, const T* __restrict__ x,
                                     const __grid_constant__ TensorMap weights, const int* __restrict__ sorted_pairs,
                                     const int* __restrict__ offsets, const int* __restrict__ tile_starts,
                                     int num_experts, int top_k, int hidden_size, int inter_size, long long ld_x) {
  const GateUpProblem<T> problem{hidden, x, &weights, sorted_pairs, top_k, hidden_size, inter_size, ld_x};
  run_tiles<T, kCluster>(problem, tile_starts, offsets, num_experts);
}

template <typename T, int kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    moe_grouped_down_wgmma_kernel(T* __restrict__ expert_out, const T* __restrict__ hidden,
                                  const __grid_constant__ TensorMap weights, const int* __restrict__ offsets,
                                  const int* __restrict__ tile_starts, int num_experts, int hidden_size,
                                  int inter_size) {
  const DownProblem<T> problem{expert_out, hidden, &weights, hidden_size, inter_size};
  run_tiles<T, kCluster>(problem, tile_starts, offsets, num_experts);
}
