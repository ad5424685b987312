// A decode step's routing and alignment by a whole block (the block of moe_router.cu that
// finishes last): the same results, bit for bit, as route_align_warp (moe_route_align_warp.cuh),
// without its one warp's long serial chain (for E 128, k 8 it ran 1,333 dependent instructions,
// 4.3 us on the H200). A token's k best are among its candidates, the keys at or above a
// threshold that at least k of its keys reach (from the maxima of segments of 16 experts), and
// the block ranks only those: ranking every key against all E took 1,024 comparisons a thread
// at E 512 (256 threads), the launch 21.0 us on the H200 against 11.8 us. Then a warp per
// token sums route_token's softmax terms (every thread computed them beside the candidates), one
// warp orders the pairs, and every thread writes offsets for a few experts: one warp counting the
// pairs below each of all E experts took ~3 us of those 11.8 at E 512, k 10 (session 10).
#pragma once

#include "moe_route_align_warp.cuh"

namespace sparkd {

constexpr int kBlockRouteLogits = 4096;  // T * E a block ranks in shared memory (16 KB of keys)
constexpr int kRouteSegment = 16;        // experts of a segment: a half-warp's
constexpr int kRouteLoads = 4;           // logits a thread loads before it uses any: an L2 round trip
constexpr int kMinRouteThreads = 128;    // the fewest threads a routing block has (the router's: 160)
// Segments of T tokens of E experts, ceil(E / 16) a token: at most T * E / 16, plus a partial
// last segment per token, of at most 32 tokens (T * k <= 32).
constexpr int kBlockRouteSegments = kBlockRouteLogits / kRouteSegment + 32;

struct BlockRouteShared {
  unsigned keys[kBlockRouteLogits];               // ordered_key of logits [T][E]
  float terms[kBlockRouteLogits];                 // [T][E]: route_token's expf(logit - the token's largest)
  unsigned segment_max[kBlockRouteSegments];      // [T][ceil(E / 16)]: the largest key of experts 16 g to 16 g + 15
  unsigned short candidates[kBlockRouteLogits];   // [T][E]: token t's num_candidates[t] candidates, in no order
  unsigned tau[32];                               // [T]: the lowest key a candidate has
  unsigned top[32];                               // [T]: the largest key
  int num_candidates[32];                         // [T]
  alignas(16) int chosen[kMaxPairs];              // pair p = t * k' + j: the expert of token t's j-th pair
};

// weights [T, k'] float32, expert_ids [T, k'] int32 and the alignment of the T * k' <= 32 pairs
// of E' experts from logits (a RouterLogits over [T, E], or [T, E + 1] with `shared`), T * E <=
// kBlockRouteLogits, k <= kMaxTopK; k' and E' as route_align_warp's (with `shared`, each token's
// last pair is expert E, weighted as route_token weighs it).
// Every thread of the block calls it (blockDim.x a multiple of 32, at least kMinRouteThreads).
template <typename Logits>
__device__ void route_align_block(float* weights, int* expert_ids, int* offsets, int* sorted_pairs, int* row_of_pair,
                                  int* active_experts, int* num_active, const Logits& logits, int num_tokens,
                                  int num_experts, int top_k, bool renormalize, bool shared,
                                  BlockRouteShared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
  const int per_token = top_k + shared;
  const int count = num_tokens * num_experts;
  const int num_segments = (num_experts + kRouteSegment - 1) / kRouteSegment;
  const int padded = num_segments * kRouteSegment;  // a token's experts, its last segment filled out
  const int padded_count = num_tokens * padded;
  // Thread i loads expert i % padded of token i / padded: blockDim.x and padded are multiples
  // of 16, so a half-warp holds one segment whole and one redux takes its maximum. Experts past
  // E count as key 0, below or equal to every key: the maximum is the real experts'.
  const unsigned half_warp = 0xffffu << (threadIdx.x & 16);
  for (int first = threadIdx.x; first < padded_count; first += kRouteLoads * blockDim.x) {
    unsigned keys[kRouteLoads];
#pragma unroll
    for (int u = 0; u < kRouteLoads; ++u) {
      const int i = first + u * blockDim.x, token = i / padded, expert = i - token * padded;
      keys[u] = i < padded_count && expert < num_experts ? ordered_key(logits(token, expert)) : 0u;
    }
#pragma unroll
    for (int u = 0; u < kRouteLoads; ++u) {
      const int i = first + u * blockDim.x, token = i / padded, expert = i - token * padded;
      if (i >= padded_count) break;  // for a whole half-warp: padded_count is a multiple of 16
      if (expert < num_experts) s.keys[token * num_experts + expert] = keys[u];
      const unsigned segment_max = __reduce_max_sync(half_warp, keys[u]);
      if (i % kRouteSegment == 0) s.segment_max[i / kRouteSegment] = segment_max;
    }
  }
  __syncthreads();

  // A warp per token finds its threshold tau: the k-th largest segment maximum (the largest
  // maximum that k maxima reach). k segments hold a key >= tau, so at least k keys are >= tau
  // and no key below it is among the k best; and a key that beats one >= tau (larger, or
  // equal with a lower id) is >= tau too. So the keys >= tau, the candidates, rank among
  // themselves as among all E. Fewer than k segments: tau 0, every key a candidate. The largest
  // maximum is the token's largest key, route_token's max_logit.
  for (int token = warp; token < num_tokens; token += num_warps) {
    const unsigned* maxima = s.segment_max + token * num_segments;
    unsigned tau = 0, top = 0;
    for (int g = lane; g < num_segments; g += 32) {
      const unsigned segment_max = maxima[g];
      top = max(top, segment_max);
      if (num_segments < top_k) continue;
      int reach = 0;  // maxima >= this one; all lanes read the same maximum: a broadcast
#pragma unroll 8
      for (int h = 0; h < num_segments; ++h) reach += maxima[h] >= segment_max;
      if (reach >= top_k) tau = max(tau, segment_max);
    }
    tau = __reduce_max_sync(kFullMask, tau);
    top = __reduce_max_sync(kFullMask, top);
    if (lane == 0) {
      s.tau[token] = tau;
      s.top[token] = top;
      s.num_candidates[token] = 0;
    }
  }
  __syncthreads();
  // Every thread lists its candidates, in no order (the ranking compares ids, not places): a
  // warp per token listing them by ballots, one barrier fewer, took 0.4 us longer at E 512.
  // Beside them, the softmax terms, which route_token computes the same way once it has the
  // largest logit, so that a token's warp only sums them after the ranking.
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int token = i / num_experts;
    const unsigned key = s.keys[i];
    s.terms[i] = expf(key_value(key) - key_value(s.top[token]));
    if (key >= s.tau[token]) {
      s.candidates[token * num_experts + atomicAdd(&s.num_candidates[token], 1)] = i - token * num_experts;
    }
  }
  __syncthreads();

  // Choice j of a token is the candidate that exactly j other candidates beat: a larger key,
  // or an equal one with a lower id (route_token's order). Thread i takes candidate i / T of
  // token i % T, so that the first pass holds every token's first candidates; all lanes of a
  // warp that rank one token's read the same candidate: a broadcast.
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int token = i % num_tokens, slot = i / num_tokens;
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
    if (rank < top_k) s.chosen[token * per_token + rank] = expert;
  }
  if (shared && static_cast<int>(threadIdx.x) < num_tokens) s.chosen[threadIdx.x * per_token + top_k] = num_experts;
  __syncthreads();

  // A warp per token sums its softmax; the warps past them (all, when they are too few) write the
  // offsets, a few experts a thread, and the last warp (free of tokens while T < its warps)
  // orders the pairs. The spare threads are counted signed: blockDim.x is unsigned, so with more
  // tokens than warps (T 16 or 32 on 8) the difference would wrap to a huge count, first_helper
  // would lie past every thread, and no thread would write offsets [0, E).
  const int num_pairs = num_tokens * per_token, aligned_experts = num_experts + shared;
  const int spare_threads = static_cast<int>(blockDim.x) - 32 * num_tokens;
  const int first_helper = spare_threads >= kMinRouteThreads ? 32 * num_tokens : 0;
  if (static_cast<int>(threadIdx.x) >= first_helper) {
    write_pair_offsets<kMaxExperts / kMinRouteThreads>(offsets, s.chosen, num_pairs, aligned_experts,
                                                       threadIdx.x - first_helper, blockDim.x - first_helper);
  }
  for (int token = warp; token < num_tokens; token += num_warps) {
    const float* terms = s.terms + token * num_experts;
    float sum = 0.f;  // lane's experts lane + 32 * i in order of i, then the butterfly: route_token's sum
    for (int expert = lane; expert < num_experts; expert += 32) sum += terms[expert];
    sum = warp_reduce(sum, SumOp());
    const int pair = token * per_token + lane;
    float weight = lane < top_k ? terms[s.chosen[pair]] / sum : 0.f;
    if (renormalize) weight /= warp_reduce(weight, SumOp());
    if (shared && lane == top_k) weight = shared_expert_weight(logits(token, num_experts));
    if (lane < per_token) {
      weights[pair] = weight;
      expert_ids[pair] = s.chosen[pair];
    }
  }
  if (warp == num_warps - 1) {
    order_pairs_warp(lane < num_pairs ? s.chosen[lane] : kMaxExperts, offsets, sorted_pairs, row_of_pair,
                     active_experts, num_active, num_pairs, aligned_experts);
  }
}

}  // namespace sparkd
