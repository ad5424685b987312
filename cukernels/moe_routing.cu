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
// Three ways to run it: one block (moe_align_kernel), a count and a scatter kernel
// over many blocks for large P, or fused behind the routing (moe_route_align_kernel).
#include "common.cuh"

using namespace sparkd;

constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 16;
constexpr int kSlots = kMaxExperts / 32;  // experts per lane in the routing warp
constexpr int kRouteWarps = 4;            // tokens per routing block
constexpr int kRankWarps = 8;             // warps that rank pairs, a pair per thread per round
constexpr int kRankThreads = 32 * kRankWarps;
constexpr int kMaxFusedTokens = 16;       // moe_route_align_kernel's limit: one token per routing warp
constexpr int kFusedThreads = 512;        // 16 routing warps; the first kRankWarps then rank
constexpr int kCombineBatch = 8;          // rows a combine thread loads before it adds

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

// One token's routing by one warp, from its logits [E]: lane j < k gets the j-th
// choice (its expert and weight). The softmax over E in fp32, its k largest
// probabilities in descending order, ties to the lower expert id; divided by their
// sum when renormalize. Selection compares the logits (softmax is monotonic), as
// order-preserving uint keys so that one redux.sync finds the warp's maximum; equal
// logits are exactly the equal probabilities of the numpy twin.
template <typename T>
__device__ __forceinline__ void route_token(const T* logits, int num_experts, int top_k, bool renormalize,
                                            int& chosen_expert, float& weight) {
  const int lane = threadIdx.x & 31;
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
  chosen_expert = 0;
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
  weight = lane < top_k ? expf(chosen_logit - max_logit) / sum : 0.f;
  if (renormalize) weight /= warp_reduce(weight, SumOp());
}

// weights [T, k] float32, expert_ids [T, k] int32 <- router_logits [T, E] (row stride
// ld_logits), as route_token.
// Launch: ceil(T / kRouteWarps) blocks of 32 * kRouteWarps threads, a warp per token.
// E <= kMaxExperts, 1 <= k <= min(E, kMaxTopK).
template <typename T>
__global__ void __launch_bounds__(32 * kRouteWarps)
    moe_route_kernel(float* __restrict__ weights, int* __restrict__ expert_ids, const T* __restrict__ router_logits,
                     int num_tokens, int num_experts, int top_k, long long ld_logits, int renormalize) {
  const int lane = threadIdx.x & 31;
  const int token = blockIdx.x * kRouteWarps + threadIdx.x / 32;
  if (token >= num_tokens) return;  // the whole warp: no block-wide sync follows
  int expert;
  float weight;
  route_token(router_logits + token * ld_logits, num_experts, top_k, renormalize, expert, weight);
  if (lane < top_k) {
    weights[token * top_k + lane] = weight;
    expert_ids[token * top_k + lane] = expert;
  }
}

// ---- alignment: ranking pairs within their experts ----

struct RankShared {
  // A round's pairs per (ranking warp, expert), then that warp's first rank there.
  // Zero between rounds: the one lane that reads an entry resets it.
  int warp_count[kRankWarps][kMaxExperts];
  int count[kMaxExperts];  // pairs of each expert ranked so far
};

// Every thread of the block calls it; the block holds at least kRankThreads threads.
__device__ void clear_rank_shared(RankShared& s, int num_experts) {
  for (int i = threadIdx.x; i < (kRankWarps + 1) * num_experts; i += blockDim.x) {
    const int row = i / num_experts, expert = i - row * num_experts;
    (row < kRankWarps ? s.warp_count[row] : s.count)[expert] = 0;
  }
  __syncthreads();
}

// ranks[p] = how many pairs of [begin, p) share pair p's expert, for p in [begin, end)
// (-1 for an id outside [0, E)); s.count[e] grows by the pairs of expert e. Rounds of
// kRankThreads consecutive pairs, a pair per thread of the first kRankWarps warps;
// the lanes of a warp that share an expert find each other with one match.
// Deterministic: a rank depends on the ids only. Every thread of the block calls it,
// with s cleared (clear_rank_shared) or left by an earlier call; s.count is complete
// when it returns.
__device__ void rank_pairs(const int* ids, int begin, int end, int num_experts, int* ranks, RankShared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const bool ranking = warp < kRankWarps;  // warp-uniform
  for (int first = begin; first < end; first += kRankThreads) {
    const int pair = first + threadIdx.x;
    const int id = ranking && pair < end ? ids[pair] : -1;
    const int expert = id >= 0 && id < num_experts ? id : -1;
    unsigned peers = 0;
    int leader = 0;
    if (ranking) {
      peers = __match_any_sync(kFullMask, expert);
      leader = __ffs(peers) - 1;
      if (expert >= 0 && lane == leader) s.warp_count[warp][expert] = __popc(peers);
    }
    __syncthreads();
    // Per expert, in warp order: each warp's count becomes its first rank.
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
      int run = s.count[e];
#pragma unroll
      for (int w = 0; w < kRankWarps; ++w) {
        const int pairs = s.warp_count[w][e];
        if (pairs) {
          s.warp_count[w][e] = run;
          run += pairs;
        }
      }
      s.count[e] = run;
    }
    __syncthreads();
    if (ranking) {
      int base = 0;
      if (expert >= 0 && lane == leader) {
        base = s.warp_count[warp][expert];
        s.warp_count[warp][expert] = 0;
      }
      base = __shfl_sync(kFullMask, base, leader);
      if (pair < end) ranks[pair] = expert >= 0 ? base + __popc(peers & ((1u << lane) - 1u)) : -1;
      __syncwarp();  // the reset lands before another lane of this warp writes the entry next round
    }
  }
  __syncthreads();
}

// In place: counts [E] in shared memory -> their exclusive prefix sum over experts.
// total: the sum; num_active: the experts with pairs, written ascending to
// active_experts unless it is null. Each thread scans a run of consecutive experts.
// Every thread of the block calls it; scratch: 32 ints of shared memory.
__device__ void scan_experts(int* counts, int num_experts, int* active_experts, int* scratch, int& total,
                             int& num_active) {
  const int per_thread = (num_experts + blockDim.x - 1) / blockDim.x;
  const int first = min(num_experts, static_cast<int>(threadIdx.x) * per_thread);
  const int last = min(num_experts, first + per_thread);
  int pairs = 0, active = 0;
  for (int e = first; e < last; ++e) {
    pairs += counts[e];
    active += counts[e] > 0;
  }
  int offset = block_exclusive_sum(pairs, scratch, total);  // its barriers order the reads before the writes
  int slot = block_exclusive_sum(active, scratch, num_active);
  for (int e = first; e < last; ++e) {
    const int count = counts[e];
    counts[e] = offset;
    offset += count;
    if (count > 0 && active_experts != nullptr) active_experts[slot++] = e;
  }
  __syncthreads();
}

__device__ void write_offsets(int* offsets, int* num_active, const int* s_offsets, int num_experts, int total,
                              int active) {
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) offsets[e] = s_offsets[e];
  if (threadIdx.x == 0) {
    offsets[num_experts] = total;
    *num_active = active;
  }
}

// The whole alignment of ids [P] by one block (ids in shared or global memory).
__device__ void align_in_block(int* offsets, int* sorted_pairs, int* row_of_pair, int* active_experts,
                               int* num_active, const int* ids, int num_pairs, int num_experts, RankShared& s,
                               int* scratch) {
  rank_pairs(ids, 0, num_pairs, num_experts, row_of_pair, s);  // ranks parked in row_of_pair
  int total, active;
  scan_experts(s.count, num_experts, active_experts, scratch, total, active);
  write_offsets(offsets, num_active, s.count, num_experts, total, active);
  // After rank_pairs' closing barrier every thread sees every parked rank.
  for (int pair = threadIdx.x; pair < num_pairs; pair += blockDim.x) {
    const int rank = row_of_pair[pair];
    if (rank < 0) continue;
    const int row = s.count[ids[pair]] + rank;
    row_of_pair[pair] = row;
    sorted_pairs[row] = pair;
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
                           long long ld_logits, int renormalize) {
  __shared__ RankShared s;
  __shared__ int s_ids[kMaxFusedTokens * kMaxTopK];
  __shared__ int s_scratch[32];
  const int lane = threadIdx.x & 31;
  for (int token = threadIdx.x / 32; token < num_tokens; token += kFusedThreads / 32) {
    int expert;
    float weight;
    route_token(router_logits + token * ld_logits, num_experts, top_k, renormalize, expert, weight);
    if (lane < top_k) {
      weights[token * top_k + lane] = weight;
      expert_ids[token * top_k + lane] = expert;
      s_ids[token * top_k + lane] = expert;
    }
  }
  clear_rank_shared(s, num_experts);  // its barrier also publishes s_ids
  align_in_block(offsets, sorted_pairs, row_of_pair, active_experts, num_active, s_ids, num_tokens * top_k,
                 num_experts, s, s_scratch);
}

// ---- routing and alignment by one warp ----

// moe_route_align_kernel's outputs for a decode step's few pairs (T * k <= 32) by one warp,
// with no block barrier: lane p holds pair p. Its rank among its expert's pairs is the
// number of lower lanes that share the expert (the stable order), its expert's offset the
// number of pairs of lower experts; each expert's lowest lane places it among the active ones.
// Launch: one block of 32 threads; limits as moe_route_kernel, and T * k <= 32.
template <typename T>
__global__ void __launch_bounds__(32)
    moe_route_align_warp_kernel(float* __restrict__ weights, int* __restrict__ expert_ids,
                                int* __restrict__ offsets, int* __restrict__ sorted_pairs,
                                int* __restrict__ row_of_pair, int* __restrict__ active_experts,
                                int* __restrict__ num_active, const T* __restrict__ router_logits, int num_tokens,
                                int num_experts, int top_k, long long ld_logits, int renormalize) {
  const int lane = threadIdx.x;
  const int num_pairs = num_tokens * top_k;
  int my_expert = kMaxExperts;  // lanes past the pairs sort after every expert
  for (int token = 0; token < num_tokens; ++token) {
    int expert;
    float weight;
    route_token(router_logits + token * ld_logits, num_experts, top_k, renormalize, expert, weight);
    // Lane j of the routing warp holds choice j; it belongs to pair (lane) token * k + j.
    const int choice = lane - token * top_k;
    const bool mine = choice >= 0 && choice < top_k;
    expert = __shfl_sync(kFullMask, expert, mine ? choice : 0);
    weight = __shfl_sync(kFullMask, weight, mine ? choice : 0);
    if (mine) {
      my_expert = expert;
      weights[lane] = weight;
      expert_ids[lane] = expert;
    }
  }

  const unsigned peers = __match_any_sync(kFullMask, my_expert);
  const bool leader = lane < num_pairs && __ffs(peers) - 1 == lane;  // the expert's first pair
  const unsigned leaders = __ballot_sync(kFullMask, leader);
  int lower_pairs = 0, lower_experts = 0;  // of lower experts than this lane's
  int counts[kSlots] = {};                 // offsets[lane + 32 * i]: the pairs of lower experts
  for (int q = 0; q < num_pairs; ++q) {
    const int other = __shfl_sync(kFullMask, my_expert, q);
    lower_pairs += other < my_expert;
    lower_experts += ((leaders >> q) & 1u) && other < my_expert;
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      if (32 * i >= num_experts) break;
      counts[i] += other < lane + 32 * i;
    }
  }
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    if (32 * i >= num_experts) break;
    if (lane + 32 * i < num_experts) offsets[lane + 32 * i] = counts[i];
  }
  if (lane < num_pairs) {
    const int row = lower_pairs + __popc(peers & ((1u << lane) - 1u));
    row_of_pair[lane] = row;
    sorted_pairs[row] = lane;
  }
  if (leader) active_experts[lower_experts] = my_expert;
  if (lane == 0) {
    offsets[num_experts] = num_pairs;
    *num_active = __popc(leaders);
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
  for (int first = 0; first < top_k; first += kCombineBatch) {
    // All of a batch's loads are in flight before the first add: at decode each one
    // is a trip to L2, and k of them in sequence would be the kernel's whole time.
    int rows[kCombineBatch];
    float batch_weights[kCombineBatch];
    float values[kCombineBatch][W];
#pragma unroll
    for (int i = 0; i < kCombineBatch; ++i) {
      const int pair = token * top_k + first + i;
      rows[i] = first + i < top_k ? row_of_pair[pair] : -1;
      batch_weights[i] = first + i < top_k ? weights[pair] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kCombineBatch; ++i) {
      if (rows[i] >= 0) {
        load_floats<W>(expert_out + static_cast<long long>(rows[i]) * hidden + col, values[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kCombineBatch; ++i) {
      if (rows[i] < 0) continue;
#pragma unroll
      for (int c = 0; c < W; ++c) acc[c] = __fadd_rn(acc[c], __fmul_rn(batch_weights[i], values[i][c]));
    }
  }
  store_floats<W>(out + static_cast<long long>(token) * hidden + col, acc);
}
