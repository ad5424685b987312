// A MoE layer's router at decode in one launch: the router GEMV
// router_logits [T, E] = router_input [T, K] @ router [E, K]^T, fp32 accumulation, then the
// routing and alignment of moe_route_align_warp_kernel (moe_routing.cu) on those logits, bit
// for bit, by the block that finishes last (with all its threads: moe_route_block.cuh).
//
// In a bf16 / fp16 model router_input is [y | y_lo] and router [W | W] (CudaOps.add_rmsnorm_for_router,
// router_weight), in an fp32 one y and W; the kernel computes the product whatever K holds.
// At batch 1 both halves are pure latency (1 MB of weights at E 128, K 4096 bf16, and a few
// hundred instructions of ranking), so the GEMV issues every load of a thread before it uses
// any, in one wave of blocks (router_grid): its whole cost is about one round trip to memory,
// and the routing follows without a kernel boundary.
#include "gemv_common.cuh"
#include "moe_route_block.cuh"

using namespace sparkd;

constexpr int kRouterChunks = 4;       // 16-byte chunks of a router row a thread loads per pass, at most
constexpr int kRouterOrderChunks = 2;  // chunks of a row an order thread adds up (below)
constexpr int kRouterTokens = 4;       // tokens a pass multiplies by them
constexpr int kRouterMaxWarps = 16;    // warps per block, and order warps per expert
constexpr int kRouterMaxFolds = 2;     // order warps a warp plays

// Arrivals of the launch's blocks (arrive_last). Zero when the module loads, and zero again
// after every launch. Launches must therefore not run concurrently: sparkd runs all work on
// one stream.
__device__ unsigned router_arrivals;

// The order of a logit's sums depends on K alone, not on the grid: the row's chunks are split
// over O = 32 * router_order_warps(K / chunk) order threads, order thread o adding chunks o,
// o + O, o + 2 O, ... in turn (fmaf, the elements in order), then the lanes of each order warp
// (butterfly), then the order warps in turn. A grid of W = order_warps / kFolds warps an expert
// (router_grid's, when E * order_warps warps would not fit in one wave) gives the same logits bit
// for bit: its thread t plays order threads t + 32 W s (s < kFolds), since its n-th chunk,
// t + 32 W n, is order thread t + 32 W (n % kFolds)'s; so it adds that into accumulator n % kFolds.
__device__ __forceinline__ int router_order_warps(int num_chunks) {
  return min(kRouterMaxWarps, max(1, (num_chunks + 32 * kRouterOrderChunks - 1) / (32 * kRouterOrderChunks)));
}

// partial[the block's order warp][m] for tokens first_token + m: this thread's share of its
// expert's row w_row . x rows, summed over its warp's lanes.
template <typename T, int kFolds>
__device__ __forceinline__ void router_partials(float (*partial)[kRouterTokens], const T* w_row,
                                                const GlobalRows<T>& x, int first_token, int num_tokens,
                                                int num_chunks, int warps_per_expert) {
  static_assert(kRouterChunks % kFolds == 0, "a pass's chunk u goes to accumulator u % kFolds");
  using C = Chunk<T>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int group_threads = 32 * warps_per_expert;  // the threads of one expert
  float acc[kRouterTokens][kFolds] = {};
  for (int first = threadIdx.x % group_threads; first < num_chunks; first += group_threads * kRouterChunks) {
    // Every load of the pass is issued before the first use, so that the pass costs one
    // round trip to memory: the router row streams past L1, x (read by every block) stays there.
    // Zeroed, so that the chunks a pass skips are defined: otherwise ptxas for sm_120 keeps the
    // arrays on the stack.
    uint4 w_raw[kRouterChunks] = {}, x_raw[kRouterTokens][kRouterChunks] = {};
#pragma unroll
    for (int u = 0; u < kRouterChunks; ++u) {
      const int chunk = first + u * group_threads;
      if (chunk < num_chunks) w_raw[u] = load_streaming(w_row + static_cast<long long>(chunk) * C::kSize);
    }
#pragma unroll
    for (int m = 0; m < kRouterTokens; ++m) {
#pragma unroll
      for (int u = 0; u < kRouterChunks; ++u) {
        const int chunk = first + u * group_threads;
        if (first_token + m < num_tokens && chunk < num_chunks) x_raw[m][u] = x.chunk(first_token + m, chunk);
      }
    }
#pragma unroll
    for (int u = 0; u < kRouterChunks; ++u) {
      if (first + u * group_threads >= num_chunks) break;
      float w_vals[C::kSize];
      C::unpack(w_raw[u], w_vals);
#pragma unroll
      for (int m = 0; m < kRouterTokens; ++m) {
        if (first_token + m >= num_tokens) break;
        float x_vals[C::kSize];
        C::unpack(x_raw[m][u], x_vals);
#pragma unroll
        for (int i = 0; i < C::kSize; ++i) acc[m][u % kFolds] = fmaf(x_vals[i], w_vals[i], acc[m][u % kFolds]);
      }
    }
  }
  const int slot = warp / warps_per_expert, order_warps = warps_per_expert * kFolds;
#pragma unroll
  for (int m = 0; m < kRouterTokens; ++m) {
    if (first_token + m >= num_tokens) break;  // for the whole block
#pragma unroll
    for (int s = 0; s < kFolds; ++s) {
      const float sum = warp_reduce(acc[m][s], SumOp());
      if (lane == 0) partial[slot * order_warps + warp % warps_per_expert + warps_per_expert * s][m] = sum;
    }
  }
}

// weights [T, k] float32, expert_ids [T, k] int32 and the alignment (moe_routing.cu's header)
// of router_input [T, K] (row stride ld_x) and router [E, K], through router_logits [T, E]
// float32 (contiguous), which the blocks write and the last one routes.
// Launch: ceil(E / R) blocks of 32 * W * R threads, R * W <= kRouterMaxWarps, at least
// kMinRouteThreads: the block's R experts have W warps each (warps_per_expert), which split K,
// each thread up to kRouterChunks chunks of it a pass; W is router_order_warps(K / chunk) divided
// by 1, 2 or 4. Preconditions (checked by the launcher): K and ld_x are multiples of a 16-byte
// chunk, router_input and router are 16-byte aligned, E <= kMaxExperts, 1 <= k <= min(E, kMaxTopK),
// T * k <= 32. With `shared`, the router's last row is a shared expert's gate: the routing takes
// the first E - 1 logits and adds each token's pair of expert E - 1 (route_align_warp), so k + 1
// <= kMaxTopK and T * (k + 1) <= 32.
// The minimum of one block an SM is said outright: without it ptxas for sm_120 holds the
// kernel to 64 registers and spills; with it, 124 (sm_90) and 124 to 128 (sm_120) (NVRTC 13.5)
// and no spills. So an SM holds 16 of its warps, which router_grid counts on for one wave.
template <typename T>
__global__ void __launch_bounds__(32 * kRouterMaxWarps, 1)
    moe_router_route_align_kernel(float* __restrict__ weights, int* __restrict__ expert_ids,
                                  int* __restrict__ offsets, int* __restrict__ sorted_pairs,
                                  int* __restrict__ row_of_pair, int* __restrict__ active_experts,
                                  int* __restrict__ num_active, float* __restrict__ router_logits,
                                  const T* __restrict__ router_input, const T* __restrict__ router, int num_tokens,
                                  int num_experts, int top_k, int K, long long ld_x, int warps_per_expert,
                                  int renormalize, int shared) {
  const int warp = threadIdx.x / 32;
  const int experts_per_block = blockDim.x / (32 * warps_per_expert);
  const int first_expert = blockIdx.x * experts_per_block;
  // An expert past E (in the last block) re-reads row E - 1; its sums are never stored.
  const T* w_row = router + static_cast<long long>(min(first_expert + warp / warps_per_expert, num_experts - 1)) * K;
  const GlobalRows<T> x{router_input, ld_x};
  const int num_chunks = K / Chunk<T>::kSize;
  const int order_warps = router_order_warps(num_chunks), folds = order_warps / warps_per_expert;
  __shared__ float partial[kRouterMaxWarps * kRouterMaxFolds][kRouterTokens];

  for (int first_token = 0; first_token < num_tokens; first_token += kRouterTokens) {
    if (folds == 1) {
      router_partials<T, 1>(partial, w_row, x, first_token, num_tokens, num_chunks, warps_per_expert);
    } else {
      router_partials<T, kRouterMaxFolds>(partial, w_row, x, first_token, num_tokens, num_chunks, warps_per_expert);
    }
    __syncthreads();
    if (threadIdx.x < experts_per_block * kRouterTokens) {
      const int slot = threadIdx.x / kRouterTokens, m = threadIdx.x % kRouterTokens;
      const int expert = first_expert + slot, token = first_token + m;
      if (expert < num_experts && token < num_tokens) {
        float sum = 0.f;
        for (int w = 0; w < order_warps; ++w) sum += partial[slot * order_warps + w][m];
        router_logits[token * num_experts + expert] = sum;
      }
    }
    __syncthreads();  // the next tokens overwrite partial
  }

  if (!arrive_last(&router_arrivals, gridDim.x)) return;
  // The last block routes: with all its threads while the logits fit its shared memory.
  const RouterLogits<float, true> logits{router_logits, num_experts};
  if (num_tokens * num_experts <= kBlockRouteLogits) {
    __shared__ BlockRouteShared route;
    route_align_block(weights, expert_ids, offsets, sorted_pairs, row_of_pair, active_experts, num_active, logits,
                      num_tokens, num_experts - shared, top_k, renormalize, shared, route);
  } else if (warp == 0) {
    route_align_warp(weights, expert_ids, offsets, sorted_pairs, row_of_pair, active_experts, num_active, logits,
                     num_tokens, num_experts - shared, top_k, renormalize, shared);
  }
}
