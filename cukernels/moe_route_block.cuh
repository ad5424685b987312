// A decode step's routing and alignment by a whole block (the block of moe_router.cu that
// finishes last): the same results, bit for bit, as route_align_warp (moe_route_align_warp.cuh),
// without its one warp's long serial chain (for E 128, k 8 it ran 1,333 dependent instructions,
// 4.3 us on the H200). A token's k best are among its candidates, the keys at or above a
// threshold that at least k of its keys reach (from the maxima of segments of 16 experts), and
// the block ranks only those: ranking every key against all E took 1,024 comparisons a thread
// at E 512 (256 threads), the launch 21.0 us on the H200 against 11.8 us. Then a warp per
// token takes route_token's softmax in route_token's order of sums, and one warp aligns the pairs.
#pragma once

#include "moe_route_align_warp.cuh"

namespace sparkd {

constexpr int kBlockRouteLogits = 4096;  // T * E a block ranks in shared memory (16 KB of keys)
constexpr int kRouteSegment = 16;        // experts of a segment: a half-warp's
// Segments of T tokens of E experts, ceil(E / 16) a token: at most T * E / 16, plus a partial
// last segment per token, of at most 32 tokens (T * k <= 32).
constexpr int kBlockRouteSegments = kBlockRouteLogits / kRouteSegment + 32;

struct BlockRouteShared {
  unsigned keys[kBlockRouteLogits];               // ordered_key of logits [T][E]
  unsigned segment_max[kBlockRouteSegments];      // [T][ceil(E / 16)]: the largest key of experts 16 g to 16 g + 15
  unsigned short candidates[kBlockRouteLogits];   // [T][E]: token t's num_candidates[t] candidates, in no order
  unsigned tau[32];                               // [T]: the lowest key a candidate has
  int num_candidates[32];                         // [T]
  int chosen[32];                                 // pair p = t * k + j: the expert of token t's j-th choice
};

// weights [T, k] float32, expert_ids [T, k] int32 and the alignment of the T * k <= 32 pairs
// from logits (a RouterLogits over [T, E]), T * E <= kBlockRouteLogits, k <= kMaxTopK.
// Every thread of the block calls it (blockDim.x a multiple of 32).
template <typename Logits>
__device__ void route_align_block(float* weights, int* expert_ids, int* offsets, int* sorted_pairs, int* row_of_pair,
                                  int* active_experts, int* num_active, const Logits& logits, int num_tokens,
                                  int num_experts, int top_k, bool renormalize, BlockRouteShared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int count = num_tokens * num_experts;
  const int num_segments = (num_experts + kRouteSegment - 1) / kRouteSegment;
  const int padded = num_segments * kRouteSegment;  // a token's experts, its last segment filled out
  // Thread i loads expert i % padded of token i / padded: blockDim.x and padded are multiples
  // of 16, so a half-warp holds one segment whole and one redux takes its maximum. Experts past
  // E count as key 0, below or equal to every key: the maximum is the real experts'.
  const unsigned half_warp = 0xffffu << (threadIdx.x & 16);
  for (int i = threadIdx.x; i < num_tokens * padded; i += blockDim.x) {
    const int token = i / padded, expert = i - token * padded;
    unsigned key = 0;
    if (expert < num_experts) {
      key = ordered_key(logits(token, expert));
      s.keys[token * num_experts + expert] = key;
    }
    const unsigned segment_max = __reduce_max_sync(half_warp, key);
    if (i % kRouteSegment == 0) s.segment_max[i / kRouteSegment] = segment_max;
  }
  __syncthreads();

  // A warp per token finds its threshold tau: the k-th largest segment maximum (the largest
  // maximum that k maxima reach). k segments hold a key >= tau, so at least k keys are >= tau
  // and no key below it is among the k best; and a key that beats one >= tau (larger, or
  // equal with a lower id) is >= tau too. So the keys >= tau, the candidates, rank among
  // themselves as among all E. Fewer than k segments: tau 0, every key a candidate.
  for (int token = warp; token < num_tokens; token += blockDim.x / 32) {
    const unsigned* maxima = s.segment_max + token * num_segments;
    unsigned tau = 0;
    if (num_segments >= top_k) {
      for (int g = lane; g < num_segments; g += 32) {
        const unsigned segment_max = maxima[g];
        int reach = 0;  // maxima >= this one; all lanes read the same maximum: a broadcast
#pragma unroll 8
        for (int h = 0; h < num_segments; ++h) reach += maxima[h] >= segment_max;
        if (reach >= top_k) tau = max(tau, segment_max);
      }
      tau = __reduce_max_sync(kFullMask, tau);
    }
    if (lane == 0) {
      s.tau[token] = tau;
      s.num_candidates[token] = 0;
    }
  }
  __syncthreads();
  // Every thread lists its candidates, in no order (the ranking compares ids, not places): a
  // warp per token listing them by ballots, one barrier fewer, took 0.4 us longer at E 512.
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int token = i / num_experts;
    if (s.keys[i] >= s.tau[token]) {
      s.candidates[token * num_experts + atomicAdd(&s.num_candidates[token], 1)] = i - token * num_experts;
    }
  }
  __syncthreads();

  // Choice j of a token is the candidate that exactly j other candidates beat: a larger key,
  // or an equal one with a lower id (route_token's order). Thread i takes candidate i % E of
  // token i / E; all lanes of a warp read the same candidate: a broadcast.
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int token = i / num_experts, slot = i - token * num_experts;
    const int num_candidates = s.num_candidates[token];
    if (slot >= num_candidates) continue;
    const unsigned short* candidates = s.candidates + token * num_experts;
    const unsigned* row = s.keys + token * num_experts;
    const int expert = candidates[slot];
    const unsigned key = row[expert];
    int rank = 0;
#pragma unroll 4
    for (int j = 0; j < num_candidates; ++j) {
      const int other = candidates[j];
      const unsigned other_key = row[other];
      rank += other_key > key || (other_key == key && other < expert);
    }
    if (rank < top_k) s.chosen[token * top_k + rank] = expert;
  }
  __syncthreads();

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
