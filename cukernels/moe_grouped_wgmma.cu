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
#include "cluster.cuh"
#include "moe_grouped_wgmma_problems.cuh"

using namespace sparkd;
using namespace sparkd::moe_wgmma;
using attn::cp_async_16;

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
  for (int index = cluster_index(); index < walk.num_tiles; index += cluster_count()) {
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
  for (int index = cluster_index(); index < walk.num_tiles; index += cluster_count()) {
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
                                cluster_starts[num_experts] * num_n, cluster_rank()};
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
