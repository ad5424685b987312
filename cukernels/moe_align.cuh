// Aligning (token, expert) pairs by expert within one block (moe_routing.cu's alignment
// kernels): each pair's rank among its expert's pairs, the experts' prefix sums, and the
// whole alignment by one block. moe_routing.cu's header says what an alignment holds.
#pragma once

#include "moe_route.cuh"  // kMaxExperts

namespace sparkd {

constexpr int kRankWarps = 8;  // warps that rank pairs, a pair per thread per round
constexpr int kRankThreads = 32 * kRankWarps;

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

}  // namespace sparkd
