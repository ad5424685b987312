// A decode step's routing and alignment by a whole block (the block of moe_router.cu that
// finishes last): the same results, bit for bit, as route_align_warp (moe_route_align_warp.cuh),
// without its one warp's long serial chain (for E 128, k 8 it ran 1,333 dependent instructions,
// 4.3 us on the H200). Every thread ranks one (token, expert) at a time against the token's
// other logits in shared memory; then a warp per token takes route_token's softmax in
// route_token's order of sums, and one warp aligns the pairs.
#pragma once

#include "moe_route_align_warp.cuh"

namespace sparkd {

constexpr int kBlockRouteLogits = 4096;  // T * E a block ranks in shared memory (16 KB of keys)

struct BlockRouteShared {
  unsigned keys[kBlockRouteLogits];  // ordered_key of logits [T][E]
  int chosen[32];                    // pair p = t * k + j: the expert of token t's j-th choice
};

// weights [T, k] float32, expert_ids [T, k] int32 and the alignment of the T * k <= 32 pairs
// from logits (a RouterLogits over [T, E]), T * E <= kBlockRouteLogits, k <= kMaxTopK.
// Every thread of the block calls it (blockDim.x a multiple of 32).
template <typename Logits>
__device__ void route_align_block(float* weights, int* expert_ids, int* offsets, int* sorted_pairs, int* row_of_pair,
                                  int* active_experts, int* num_active, const Logits& logits, int num_tokens,
                                  int num_experts, int top_k, bool renormalize, BlockRouteShared& s) {
  const int count = num_tokens * num_experts;
  for (int i = threadIdx.x; i < count; i += blockDim.x) s.keys[i] = ordered_key(logits(i / num_experts, i % num_experts));
  __syncthreads();
  // Choice j of a token is the expert that exactly j others beat: a larger key, or an equal
  // one with a lower id (route_token's order). All lanes of a warp read the same key: a broadcast.
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int token = i / num_experts, expert = i - token * num_experts;
    const unsigned* row = s.keys + token * num_experts;
    const unsigned key = row[expert];
    int rank = 0;
#pragma unroll 8
    for (int other = 0; other < num_experts; ++other) {
      const unsigned other_key = row[other];
      rank += other_key > key || (other_key == key && other < expert);
    }
    if (rank < top_k) s.chosen[token * top_k + rank] = expert;
  }
  __syncthreads();

  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  for (int token = warp; token < num_tokens; token += blockDim.x / 32) {
    const unsigned* row = s.keys + token * num_experts;
    const float max_logit = key_value(row[s.chosen[token * top_k]]);
    float sum = 0.f;  // lane's experts lane + 32 * i in order of i, then the butterfly: route_token's sum
    for (int expert = lane; expert < num_experts; expert += 32) sum += expf(key_value(row[expert]) - max_logit);
    sum = warp_reduce(sum, SumOp());
    const int pair = token * top_k + lane;
    float weight = lane < top_k ? expf(key_value(row[s.chosen[pair]]) - max_logit) / sum : 0.f;
    if (renormalize) weight /= warp_reduce(weight, SumOp());
    if (lane < top_k) {
      weights[pair] = weight;
      expert_ids[pair] = s.chosen[pair];
    }
  }
  if (warp == 0) {
    const int num_pairs = num_tokens * top_k;
    align_pairs_warp(lane < num_pairs ? s.chosen[lane] : kMaxExperts, offsets, sorted_pairs, row_of_pair,
                     active_experts, num_active, num_pairs, num_experts);
  }
}

}  // namespace sparkd
