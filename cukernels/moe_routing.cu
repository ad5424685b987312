// Mixture of experts around the expert GEMMs (moe_gemm.cu): routing, alignment
// and the weighted combine, the CUDA twins of moe_route, group_by_expert and the
// final sum of sparkd/backend/cpu/moe.py.
//
// Shapes: T tokens, E experts, k = top_k, H hidden, P = T * k (token, expert)
// pairs; pair p = t * k + j is token t's j-th choice. A "row" is a pair's place
// in expert order: the rows of expert e are offsets[e] .. offsets[e + 1] - 1.
// Every output has a size fixed by (T, k, E) and no launch waits on the host,
// so the three launches can be captured in a CUDA graph.
#include "common.cuh"

using namespace sparkd;

constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 16;
constexpr int kSlots = kMaxExperts / 32;  // experts per lane in the routing warp
constexpr int kRouteWarps = 4;            // tokens per routing block
constexpr int kAlignThreads = 1024;       // >= kMaxExperts: one thread per expert in the scans

// ---- routing ----

// The best (largest key, then lowest expert id) of a lane's experts lane + 32 * i
// whose bit i in `taken` is clear; {0, INT_MAX} when none is left.
__device__ __forceinline__ void lane_best(const unsigned (&keys)[kSlots], unsigned taken, int num_experts, int lane,
                                          unsigned& best_key, int& best_expert) {
  best_key = 0;
  best_expert = 0x7fffffff;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    if (32 * i >= num_experts) break;
    // Ascending i visits ascending ids, so a strict > keeps the lowest id of equal keys.
    if (!((taken >> i) & 1u) && (best_expert == 0x7fffffff || keys[i] > best_key)) {
      best_key = keys[i];
      best_expert = lane + 32 * i;
    }
  }
}

// weights [T, k] float32, expert_ids [T, k] int32 <- router_logits [T, E] (row stride ld_logits):
// the softmax over E in fp32, its k largest probabilities per row in descending
// order, ties to the lower expert id; divided by their sum when renormalize.
// Selection compares the logits (softmax is monotonic), as order-preserving uint
// keys so that one redux.sync finds the warp's maximum; equal logits are exactly
// the equal probabilities of the numpy twin.
// Launch: ceil(T / kRouteWarps) blocks of 32 * kRouteWarps threads, a warp per token.
// E <= kMaxExperts, 1 <= k <= min(E, kMaxTopK).
template <typename T>
__global__ void __launch_bounds__(32 * kRouteWarps)
    moe_route_kernel(float* __restrict__ weights, int* __restrict__ expert_ids, const T* __restrict__ router_logits,
                     int num_tokens, int num_experts, int top_k, long long ld_logits, int renormalize) {
  const int lane = threadIdx.x & 31;
  const int token = blockIdx.x * kRouteWarps + threadIdx.x / 32;
  if (token >= num_tokens) return;  // the whole warp: no block-wide sync follows
  const T* logits = router_logits + token * ld_logits;

  unsigned keys[kSlots];  // lane's experts lane + 32 * i, in registers (the loops unroll)
  unsigned taken = 0;     // bit i: expert lane + 32 * i is chosen, or does not exist
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    if (32 * i >= num_experts) break;
    const int expert = lane + 32 * i;
    keys[i] = expert < num_experts ? ordered_key(to_float(logits[expert])) : 0u;
    if (expert >= num_experts) taken |= 1u << i;
  }

  unsigned best_key;
  int best_expert;
  lane_best(keys, taken, num_experts, lane, best_key, best_expert);
  // Round j picks the j-th expert; lane j keeps it.
  float max_logit = 0.f, chosen_logit = 0.f;
  int chosen_expert = 0;
  for (int j = 0; j < top_k; ++j) {
    const unsigned top_key = __reduce_max_sync(kFullMask, best_key);
    const int winner = static_cast<int>(
        __reduce_min_sync(kFullMask, best_key == top_key ? static_cast<unsigned>(best_expert) : 0x7fffffffu));
    if (j == 0) max_logit = key_value(top_key);
    if (lane == j) {
      chosen_logit = key_value(top_key);
      chosen_expert = winner;
    }
    if (lane == (winner & 31)) {
      taken |= 1u << (winner / 32);
      lane_best(keys, taken, num_experts, lane, best_key, best_expert);
    }
  }

  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    if (32 * i >= num_experts) break;
    if (lane + 32 * i < num_experts) sum += expf(key_value(keys[i]) - max_logit);
  }
  sum = warp_reduce(sum, SumOp());
  float prob = lane < top_k ? expf(chosen_logit - max_logit) / sum : 0.f;
  if (renormalize) prob /= warp_reduce(prob, SumOp());
  if (lane < top_k) {
    weights[token * top_k + lane] = prob;
    expert_ids[token * top_k + lane] = chosen_expert;
  }
}

// ---- alignment ----

// From expert_ids [P] int32 (moe_route's [T, k], flat):
//   offsets [E + 1]     exclusive prefix sum of the pairs per expert;
//   sorted_pairs [P]    the pair ids in expert order (token order within a warp's
//                       32 pairs, arrival order across warps);
//   row_of_pair [P]     the inverse: the row of each pair;
//   active_experts [min(E, P)]  the experts with pairs, ascending; num_active [1] of them.
// A pair whose id is outside [0, E) (moe_route never writes one) gets row -1 and no
// row: the combine skips it, and offsets[E] counts only the others.
// Launch: one block of kAlignThreads threads; E <= kMaxExperts.
__global__ void __launch_bounds__(kAlignThreads)
    moe_align_kernel(int* __restrict__ offsets, int* __restrict__ sorted_pairs, int* __restrict__ row_of_pair,
                     int* __restrict__ active_experts, int* __restrict__ num_active,
                     const int* __restrict__ expert_ids, int num_pairs, int num_experts) {
  __shared__ int s_count[kMaxExperts];
  __shared__ int s_offset[kMaxExperts];
  __shared__ int s_scratch[32];
  const int lane = threadIdx.x & 31;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) s_count[e] = 0;
  __syncthreads();

  // Each pair's rank within its expert, parked in row_of_pair until the offsets
  // are known. The lanes of a warp that share an expert take one atomic for all,
  // so a few hot experts do not serialise the block.
  for (int first = 0; first < num_pairs; first += blockDim.x) {
    const int pair = first + threadIdx.x;
    const int id = pair < num_pairs ? expert_ids[pair] : -1;
    const int expert = id >= 0 && id < num_experts ? id : -1;
    const unsigned peers = __match_any_sync(kFullMask, expert);
    const int leader = __ffs(peers) - 1;
    int base = 0;
    if (expert >= 0 && lane == leader) base = atomicAdd(&s_count[expert], __popc(peers));
    base = __shfl_sync(kFullMask, base, leader);
    if (pair < num_pairs) row_of_pair[pair] = expert >= 0 ? base + __popc(peers & ((1u << lane) - 1u)) : -1;
  }
  __syncthreads();

  const int expert = threadIdx.x;  // one thread per expert: blockDim.x >= E
  const int count = expert < num_experts ? s_count[expert] : 0;
  int total, total_active;
  const int start = block_exclusive_sum(count, s_scratch, total);
  const int slot = block_exclusive_sum(count > 0 ? 1 : 0, s_scratch, total_active);
  if (expert < num_experts) {
    s_offset[expert] = start;
    offsets[expert] = start;
    if (count > 0) active_experts[slot] = expert;
  }
  if (threadIdx.x == 0) {
    offsets[num_experts] = total;
    *num_active = total_active;
  }
  __syncthreads();

  // The same thread revisits the pairs it ranked, so it reads its own writes.
  for (int pair = threadIdx.x; pair < num_pairs; pair += blockDim.x) {
    const int rank = row_of_pair[pair];
    if (rank < 0) continue;
    const int row = s_offset[expert_ids[pair]] + rank;
    row_of_pair[pair] = row;
    sorted_pairs[row] = pair;
  }
}

// ---- combine ----

// out [T, H] in T = sum over j = 0 .. k-1 of weights[t, j] * expert_out[row_of_pair[t * k + j], :],
// expert_out [P, H] float32. Products and sums are rounded separately (no FMA), in
// order of j, as the numpy twin computes them. Rows of -1 add nothing.
// Launch: grid (T, ceil(H / (W * blockDim.x))), each thread W consecutive columns;
// H % W == 0, expert_out 16-byte and out W-element aligned when W > 1.
template <typename T, int W>
__global__ void moe_combine_kernel(T* __restrict__ out, const float* __restrict__ expert_out,
                                   const float* __restrict__ weights, const int* __restrict__ row_of_pair,
                                   int hidden, int top_k) {
  const int token = blockIdx.x;
  const int col = (blockIdx.y * blockDim.x + threadIdx.x) * W;
  if (col >= hidden) return;
  float acc[W] = {};
  for (int j = 0; j < top_k; ++j) {
    const int pair = token * top_k + j;
    const int row = row_of_pair[pair];
    if (row < 0) continue;
    const float weight = weights[pair];
    float values[W];
    load_floats<W>(expert_out + static_cast<long long>(row) * hidden + col, values);
#pragma unroll
    for (int i = 0; i < W; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(weight, values[i]));
  }
  store_floats<W>(out + static_cast<long long>(token) * hidden + col, acc);
}
