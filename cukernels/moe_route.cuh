// MoE routing by one warp per token (moe_routing.cu's and moe_router.cu's kernels): the
// top-k experts of a token's router logits, their softmax weights, optionally renormalised.
// The twin of moe_route in sparkd/backend/cpu/moe.py.
#pragma once

#include "common.cuh"

namespace sparkd {

constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 16;
constexpr int kSlots = kMaxExperts / 32;  // experts per lane in the routing warp

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

// router_logits [T, E] (row stride ld) as the routing reads them: logit(token, expert) in fp32.
// kFromL2: the logits were stored by other blocks of the same launch (moe_router.cu), so they
// are read from L2 (__ldcg), where those blocks' stores are, past this SM's L1.
template <typename T, bool kFromL2 = false>
struct RouterLogits {
  const T* logits;
  long long ld;

  __device__ __forceinline__ float operator()(int token, int expert) const {
    const T* p = logits + token * ld + expert;
    if constexpr (kFromL2) {
      return to_float(__ldcg(p));
    } else {
      return to_float(*p);
    }
  }
};

// The weight of a token's shared expert (`shared`: expert E, the router's logit column E):
// sigmoid of that logit, as the numpy twin computes it.
__device__ __forceinline__ float shared_expert_weight(float logit) { return 1.f / (1.f + expf(-logit)); }

// One token's routing by one warp, from its logits [E] (logits(token, e), a RouterLogits):
// lane j < k gets the j-th choice (its expert and weight). The softmax over E in fp32, its
// k largest probabilities in descending order, ties to the lower expert id; divided by their
// sum when renormalize. Selection compares the logits (softmax is monotonic), as
// order-preserving uint keys so that one redux.sync finds the warp's maximum; equal
// logits are exactly the equal probabilities of the numpy twin. With `shared`, lane k also
// gets expert E, weighted by shared_expert_weight(logit E), outside the softmax and the
// renormalisation (k + 1 <= 32).
template <typename Logits>
__device__ __forceinline__ void route_token(const Logits& logits, int token, int num_experts, int top_k,
                                            bool renormalize, bool shared, int& chosen_expert, float& weight) {
  const int lane = threadIdx.x & 31;
  unsigned keys[kSlots];  // lane's experts lane + 32 * i, in registers (the loops unroll)
  unsigned taken = 0;     // bit i: expert lane + 32 * i is chosen, or does not exist
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    if (32 * i >= num_experts) break;
    const int expert = lane + 32 * i;
    keys[i] = expert < num_experts ? ordered_key(logits(token, expert)) : 0u;
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
  if (shared && lane == top_k) {
    chosen_expert = num_experts;
    weight = shared_expert_weight(logits(token, num_experts));
  }
}

}  // namespace sparkd
