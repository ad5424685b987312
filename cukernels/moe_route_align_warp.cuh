// A decode step's routing and alignment by one warp (moe_route_align_warp_kernel in
// moe_routing.cu, and the block of moe_router.cu that finishes last): moe_route_kernel's
// outputs, then the alignment of its expert ids (moe_routing.cu's header says what an
// alignment holds), for T * k <= 32 pairs.
#pragma once

#include "moe_route.cuh"

namespace sparkd {

constexpr int kMaxPairs = 32;    // a decode step's T * k: a pair a lane
constexpr int kExpertBits = 11;  // the bits of an id up to kMaxExperts, which the lanes past the pairs hold

// The alignment of a decode step's T * k <= 32 pairs but offsets [0, E) (write_pair_offsets),
// lane p holding pair p's expert (my_expert; kMaxExperts past the pairs, which sorts them after
// every expert). No block barrier. A pair's row is the number of pairs of lower experts plus the
// number of lower lanes that share its expert (the stable order); each expert's lowest lane
// places it among the active ones. Every lane of one warp calls it.
__device__ __forceinline__ void order_pairs_warp(int my_expert, int* offsets, int* sorted_pairs, int* row_of_pair,
                                                 int* active_experts, int* num_active, int num_pairs,
                                                 int num_experts) {
  const int lane = threadIdx.x & 31;
  // The lanes of lower experts (below) and of this lane's (peers), from the ids' bits, high to
  // low: a lane leaves the peers at the first bit where the two ids differ, and is below when its
  // bit is 0 there. kExpertBits ballots, however many pairs there are (not a shuffle a pair).
  unsigned below = 0, peers = kFullMask;
#pragma unroll
  for (int bit = kExpertBits - 1; bit >= 0; --bit) {
    const bool one = (my_expert >> bit) & 1;
    const unsigned ones = __ballot_sync(kFullMask, one);
    if (one) below |= peers & ~ones;
    peers &= one ? ones : ~ones;
  }
  const unsigned lower_lanes = (1u << lane) - 1u;
  const bool leader = lane < num_pairs && (peers & lower_lanes) == 0;  // the expert's first pair
  const unsigned leaders = __ballot_sync(kFullMask, leader);
  if (lane < num_pairs) {
    const int row = __popc(below) + __popc(peers & lower_lanes);
    row_of_pair[lane] = row;
    sorted_pairs[row] = lane;
  }
  if (leader) active_experts[__popc(below & leaders)] = my_expert;
  if (lane == 0) {
    offsets[num_experts] = num_pairs;
    *num_active = __popc(leaders);
  }
}

// offsets[e] = the pairs of lower experts than e, for the experts e = first + stride * i < E
// (i < kPerThread): a warp's lane of stride 32, or a block's thread of stride blockDim.x.
// experts: pair q's expert at q < num_pairs, in shared memory, kMaxPairs long and 16-byte aligned,
// read four pairs a load.
template <int kPerThread>
__device__ __forceinline__ void write_pair_offsets(int* offsets, const int* experts, int num_pairs, int num_experts,
                                                   int first, int stride) {
  int counts[kPerThread] = {};
  for (int q = 0; q < num_pairs; q += 4) {
    const int4 four = *reinterpret_cast<const int4*>(experts + q);
    const int others[4] = {four.x, four.y, four.z, four.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const bool pair = q + u < num_pairs;
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        if (stride * i >= num_experts) break;
        counts[i] += pair && others[u] < first + stride * i;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    if (stride * i >= num_experts) break;
    if (first + stride * i < num_experts) offsets[first + stride * i] = counts[i];
  }
}

// weights [T, k'] float32, expert_ids [T, k'] int32 and the alignment of the T * k' pairs of E'
// experts from logits (a RouterLogits over [T, E], or [T, E + 1] with `shared`): route_token per
// token, lane p keeping pair p, then order_pairs_warp and write_pair_offsets. k' = k and E' = E,
// or with `shared` k + 1 and E + 1 (each token's last pair its shared expert, E). Every lane of
// one warp calls it; limits as moe_route_kernel, and T * k' <= 32.
template <typename Logits>
__device__ __forceinline__ void route_align_warp(float* weights, int* expert_ids, int* offsets, int* sorted_pairs,
                                                 int* row_of_pair, int* active_experts, int* num_active,
                                                 const Logits& logits, int num_tokens, int num_experts, int top_k,
                                                 bool renormalize, bool shared) {
  const int lane = threadIdx.x & 31;
  const int per_token = top_k + shared;  // a token's pairs: its choices, then its shared expert's
  __shared__ alignas(16) int pair_experts[kMaxPairs];
  int my_expert = kMaxExperts;
  for (int token = 0; token < num_tokens; ++token) {
    int expert;
    float weight;
    route_token(logits, token, num_experts, top_k, renormalize, shared, expert, weight);
    // Lane j of the routing warp holds choice j; it belongs to pair (lane) token * per_token + j.
    const int choice = lane - token * per_token;
    const bool mine = choice >= 0 && choice < per_token;
    expert = __shfl_sync(kFullMask, expert, mine ? choice : 0);
    weight = __shfl_sync(kFullMask, weight, mine ? choice : 0);
    if (mine) {
      my_expert = expert;
      weights[lane] = weight;
      expert_ids[lane] = expert;
    }
  }
  const int num_pairs = num_tokens * per_token, aligned_experts = num_experts + shared;
  pair_experts[lane] = my_expert;
  __syncwarp();
  order_pairs_warp(my_expert, offsets, sorted_pairs, row_of_pair, active_experts, num_active, num_pairs,
                   aligned_experts);
  write_pair_offsets<kSlots>(offsets, pair_experts, num_pairs, aligned_experts, lane, 32);
}

}  // namespace sparkd
