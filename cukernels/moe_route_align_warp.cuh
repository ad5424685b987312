// A decode step's routing and alignment by one warp (moe_route_align_warp_kernel in
// moe_routing.cu, and the block of moe_router.cu that finishes last): moe_route_kernel's
// outputs, then the alignment of its expert ids (moe_routing.cu's header says what an
// alignment holds), for T * k <= 32 pairs.
#pragma once

#include "moe_route.cuh"

namespace sparkd {

// The alignment of a decode step's T * k <= 32 pairs (moe_routing.cu's header says what it
// holds) from their experts, lane p holding pair p's (my_expert; kMaxExperts past the pairs,
// which sorts them after every expert). No block barrier. A pair's rank among its expert's
// pairs is the number of lower lanes that share the expert (the stable order), its expert's
// offset the number of pairs of lower experts; each expert's lowest lane places it among the
// active ones. Every lane of one warp calls it.
__device__ __forceinline__ void align_pairs_warp(int my_expert, int* offsets, int* sorted_pairs, int* row_of_pair,
                                                 int* active_experts, int* num_active, int num_pairs,
                                                 int num_experts) {
  const int lane = threadIdx.x & 31;
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

// weights [T, k] float32, expert_ids [T, k] int32 and the alignment of the T * k pairs from
// logits (a RouterLogits over [T, E]): route_token per token, lane p keeping pair p, then
// align_pairs_warp. Every lane of one warp calls it; limits as moe_route_kernel.
template <typename Logits>
__device__ __forceinline__ void route_align_warp(float* weights, int* expert_ids, int* offsets, int* sorted_pairs,
                                                 int* row_of_pair, int* active_experts, int* num_active,
                                                 const Logits& logits, int num_tokens, int num_experts, int top_k,
                                                 bool renormalize) {
  const int lane = threadIdx.x & 31;
  int my_expert = kMaxExperts;
  for (int token = 0; token < num_tokens; ++token) {
    int expert;
    float weight;
    route_token(logits, token, num_experts, top_k, renormalize, expert, weight);
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
  align_pairs_warp(my_expert, offsets, sorted_pairs, row_of_pair, active_experts, num_active, num_tokens * top_k,
                   num_experts);
}

}  // namespace sparkd
