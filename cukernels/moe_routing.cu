// Mixture of experts around the expert GEMMs (moe_gemm.cu): routing, alignment
// and the weighted combine, the CUDA twins of moe_route, group_by_expert and the
// final sum of sparkd/backend/cpu/moe.py.
//
// Shapes: T tokens, E experts, k = top_k, H hidden, P = T * k (token, expert)
// pairs; pair p = t * k + j is token t's j-th choice. A "row" is a pair's place
// in expert order: the rows of expert e are offsets[e] .. offsets[e + 1] - 1.
// Every output has a size fixed by (T, k, E) and no launch waits on the host,
// so the launches can be captured in a CUDA graph.
//
// An alignment writes, from expert_ids [P] int32 (moe_route's [T, k], flat):
//   offsets [E + 1]     exclusive prefix sum of the pairs per expert;
//   sorted_pairs [P]    the pair ids in expert order, ascending within an expert
//                       (a stable sort: exactly group_by_expert's order);
//   row_of_pair [P]     the inverse: the row of each pair;
//   active_experts [min(E, P)]  the experts with pairs, ascending; num_active [1] of them.
// A pair whose id is outside [0, E) (moe_route never writes one) gets row -1 and no
// row: the combine skips it, and offsets[E] counts only the others.
// Five ways to run it: one block (moe_align_kernel), a count and a scatter kernel
// over many blocks for large P, fused behind the routing (moe_route_align_kernel),
// with the routing by one warp for a decode step's few pairs (moe_route_align_warp_kernel),
// or that warp's work behind the router GEMV in the same launch
// (moe_router_route_align_kernel, moe_router.cu).
// The routing's and the alignment's device functions live in moe_route.cuh and moe_align.cuh,
// the one warp's in moe_route_align_warp.cuh.
#include "moe_align.cuh"
#include "moe_combine.cuh"
#include "moe_route_align_warp.cuh"

using namespace sparkd;

constexpr int kRouteWarps = 4;            // tokens per routing block
constexpr int kMaxFusedTokens = 16;       // moe_route_align_kernel's limit: one token per routing warp
constexpr int kFusedThreads = 512;        // 16 routing warps; the first kRankWarps then rank

// ---- routing ----

// weights [T, k'] float32, expert_ids [T, k'] int32 <- router_logits [T, E] (row stride
// ld_logits), as route_token: k' = k, or k + 1 with `shared` (then the logits have a column E,
// the shared expert's gate, and each token's last pair is expert E).
// Launch: ceil(T / kRouteWarps) blocks of 32 * kRouteWarps threads, a warp per token.
// E + shared <= kMaxExperts, 1 <= k <= min(E, kMaxTopK - shared).
template <typename T>
__global__ void __launch_bounds__(32 * kRouteWarps)
    moe_route_kernel(float* __restrict__ weights, int* __restrict__ expert_ids, const T* __restrict__ router_logits,
                     int num_tokens, int num_experts, int top_k, long long ld_logits, int renormalize, int shared) {
  const int lane = threadIdx.x & 31;
  const int token = blockIdx.x * kRouteWarps + threadIdx.x / 32;
  if (token >= num_tokens) return;  // the whole warp: no block-wide sync follows
  int expert;
  float weight;
  route_token(RouterLogits<T>{router_logits, ld_logits}, token, num_experts, top_k, renormalize, shared, expert,
              weight);
  const int per_token = top_k + shared;
  if (lane < per_token) {
    weights[token * per_token + lane] = weight;
    expert_ids[token * per_token + lane] = expert;
  }
}

// ---- alignment kernels ----

// One block aligns all P pairs: for small P (a decode step).
// Launch: one block of kRankThreads threads; E <= kMaxExperts.
__global__ void __launch_bounds__(kRankThreads)
    moe_align_kernel(int* __restrict__ offsets, int* __restrict__ sorted_pairs, int* __restrict__ row_of_pair,
                     int* __restrict__ active_experts, int* __restrict__ num_active,
                     const int* __restrict__ expert_ids, int num_pairs, int num_experts) {
  __shared__ RankShared s;
  __shared__ int s_scratch[32];
  clear_rank_shared(s, num_experts);
  align_in_block(offsets, sorted_pairs, row_of_pair, active_experts, num_active, expert_ids, num_pairs, num_experts,
                 s, s_scratch);
}

// Large P, first of two launches: block b ranks the pairs [b * chunk, (b + 1) * chunk)
// within its chunk (parked in row_of_pair) and writes its counts to block_counts[b, :E].
// Launch: ceil(P / chunk) blocks of kRankThreads threads; E <= kMaxExperts.
__global__ void __launch_bounds__(kRankThreads)
    moe_align_count_kernel(int* __restrict__ block_counts, int* __restrict__ row_of_pair,
                           const int* __restrict__ expert_ids, int num_pairs, int num_experts, int chunk) {
  __shared__ RankShared s;
  clear_rank_shared(s, num_experts);
  const int begin = blockIdx.x * chunk;
  rank_pairs(expert_ids, begin, min(num_pairs, begin + chunk), num_experts, row_of_pair, s);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) block_counts[blockIdx.x * num_experts + e] = s.count[e];
}

// Large P, second launch, on moe_align_count_kernel's grid: every block sums the
// counts of all blocks (the offsets) and of the blocks before it (where its chunk
// starts in each expert), then moves its chunk's pairs to their rows. Block 0 writes
// offsets, active_experts and num_active.
__global__ void __launch_bounds__(kRankThreads)
    moe_align_scatter_kernel(int* __restrict__ offsets, int* __restrict__ sorted_pairs, int* __restrict__ row_of_pair,
                             int* __restrict__ active_experts, int* __restrict__ num_active,
                             const int* __restrict__ block_counts, const int* __restrict__ expert_ids, int num_pairs,
                             int num_experts, int chunk) {
  __shared__ int s_offset[kMaxExperts];  // pairs per expert, then the offsets
  __shared__ int s_before[kMaxExperts];  // pairs per expert in the chunks before this block's
  __shared__ int s_scratch[32];
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) s_offset[e] = s_before[e] = 0;
  __syncthreads();
  // Integer sums: the same whatever order the atomics land in.
  for (int i = threadIdx.x; i < gridDim.x * num_experts; i += blockDim.x) {
    const int count = block_counts[i];
    if (count == 0) continue;
    const int block = i / num_experts, expert = i - block * num_experts;
    atomicAdd(&s_offset[expert], count);
    if (block < blockIdx.x) atomicAdd(&s_before[expert], count);
  }
  __syncthreads();
  int total, active;
  scan_experts(s_offset, num_experts, blockIdx.x == 0 ? active_experts : nullptr, s_scratch, total, active);
  if (blockIdx.x == 0) write_offsets(offsets, num_active, s_offset, num_experts, total, active);
  const int begin = blockIdx.x * chunk, end = min(num_pairs, begin + chunk);
  for (int pair = begin + threadIdx.x; pair < end; pair += blockDim.x) {
    const int rank = row_of_pair[pair];
    if (rank < 0) continue;
    const int expert = expert_ids[pair];
    const int row = s_offset[expert] + s_before[expert] + rank;
    row_of_pair[pair] = row;
    sorted_pairs[row] = pair;
  }
}

// ---- routing and alignment in one launch ----

// moe_route_kernel's outputs, then the alignment of its expert_ids, for T <= kMaxFusedTokens:
// one launch instead of two for a decode step. The routing warps keep the ids in
// shared memory for the alignment.
// Launch: one block of kFusedThreads threads; limits as moe_route_kernel.
template <typename T>
__global__ void __launch_bounds__(kFusedThreads)
    moe_route_align_kernel(float* __restrict__ weights, int* __restrict__ expert_ids, int* __restrict__ offsets,
                           int* __restrict__ sorted_pairs, int* __restrict__ row_of_pair,
                           int* __restrict__ active_experts, int* __restrict__ num_active,
                           const T* __restrict__ router_logits, int num_tokens, int num_experts, int top_k,
                           long long ld_logits, int renormalize, int shared) {
  __shared__ RankShared s;
  __shared__ int s_ids[kMaxFusedTokens * kMaxTopK];
  __shared__ int s_scratch[32];
  const int lane = threadIdx.x & 31, per_token = top_k + shared;
  for (int token = threadIdx.x / 32; token < num_tokens; token += kFusedThreads / 32) {
    int expert;
    float weight;
    route_token(RouterLogits<T>{router_logits, ld_logits}, token, num_experts, top_k, renormalize, shared, expert,
                weight);
    if (lane < per_token) {
      weights[token * per_token + lane] = weight;
      expert_ids[token * per_token + lane] = expert;
      s_ids[token * per_token + lane] = expert;
    }
  }
  clear_rank_shared(s, num_experts + shared);  // its barrier also publishes s_ids
  align_in_block(offsets, sorted_pairs, row_of_pair, active_experts, num_active, s_ids, num_tokens * per_token,
                 num_experts + shared, s, s_scratch);
}

// ---- routing and alignment by one warp ----

// moe_route_align_kernel's outputs for a decode step's few pairs (T * k' <= 32) by one warp:
// route_align_warp.
// Launch: one block of 32 threads; limits as moe_route_kernel, and T * k' <= 32.
template <typename T>
__global__ void __launch_bounds__(32)
    moe_route_align_warp_kernel(float* __restrict__ weights, int* __restrict__ expert_ids,
                                int* __restrict__ offsets, int* __restrict__ sorted_pairs,
                                int* __restrict__ row_of_pair, int* __restrict__ active_experts,
                                int* __restrict__ num_active, const T* __restrict__ router_logits, int num_tokens,
                                int num_experts, int top_k, long long ld_logits, int renormalize, int shared) {
  route_align_warp(weights, expert_ids, offsets, sorted_pairs, row_of_pair, active_experts, num_active,
                   RouterLogits<T>{router_logits, ld_logits}, num_tokens, num_experts, top_k, renormalize, shared);
}

// ---- combine ----

// out [T, H] in T = combine_columns (moe_combine.cuh) rounded to T: the MoE block's output on its
// own. add_rmsnorm's combine_add_rmsnorm_kernel (norm.cu) takes the same sums in the next norm.
// Launch: grid (T, ceil(H / (W * blockDim.x))), each thread W consecutive columns; W is 1 or
// 16 / sizeof(T), and then H % W == 0 and expert_out and out are 16-byte aligned.
template <typename T, int W>
__global__ void moe_combine_kernel(T* __restrict__ out, const T* __restrict__ expert_out,
                                   const float* __restrict__ weights, const int* __restrict__ row_of_pair,
                                   int hidden, int top_k) {
  const int token = blockIdx.x;
  const int col = (blockIdx.y * blockDim.x + threadIdx.x) * W;
  if (col >= hidden) return;
  float acc[W];
  combine_columns<T, W>(acc, expert_out, weights, row_of_pair, token, col, hidden, top_k);
  store_floats<W>(out + static_cast<long long>(token) * hidden + col, acc);
}
