// What the blocks of a split row (sampling_split.cu) share and how they meet:
// per-row state in global memory, row barriers, and the departure after which
// the last block owns the row's results.
#pragma once

#include "sampling_candidates.cuh"

namespace sparkd {

constexpr int kMaxSplitRows = 64;   // MAX_SPLIT_ROWS in sampling.py
constexpr int kRegions = 3;         // histogram regions a row's descent levels cycle through
constexpr int kSplitCandidates = 4096;  // SPLIT_CANDIDATES in sampling.py; a power of two

// Per-row state shared by the row's blocks. Zero when the module loads; the
// block that departs last zeroes it again, so a graph replay starts clean.
// Launches that split must therefore not run concurrently (sparkd runs all
// work on one stream).
struct RowSync {
  unsigned arrived;          // barrier arrivals, cumulative over the launch
  unsigned departed;         // blocks done with the row
  unsigned max_key;          // ordered_key of the row's largest value
  unsigned num_candidates;   // entries of split_candidates[row] so far
  unsigned long long best;   // best_candidate() of the winner so far; 0: none
  unsigned long long total;  // the row's fixed-point mass (top-p without top-k)
};
__device__ RowSync split_rows[kMaxSplitRows];

// The candidate path (sampling_candidates.cuh): the row's bin counts and its
// candidates; the block that departs last draws from them and zeroes the bins.
__device__ unsigned split_bins[kMaxSplitRows][kCandidateBins];
__device__ unsigned long long split_candidates[kMaxSplitRows][kSplitCandidates];

// Level j of a row's descents adds into region j % kRegions and zeroes region
// (j + 1) % kRegions, which every block finished reading two barriers earlier.
__device__ unsigned split_counts[kMaxSplitRows][kRegions][kRadixBins];
__device__ unsigned long long split_masses[kMaxSplitRows][kRegions][kRadixBins];

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every block of the row waits until all `splits` of them have arrived; what
// each wrote to global memory before it is visible to all after it.
__device__ void row_barrier(RowSync& sync, unsigned splits) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned target = (atomicAdd(&sync.arrived, 1u) / splits + 1) * splits;
    while (load_acquire(&sync.arrived) < target) {
    }
  }
  __syncthreads();
}

// Shared memory besides the chunk (~25 KB).
struct SplitShared {
  unsigned counts[kRadixBins];
  unsigned long long masses[kRadixBins];
  unsigned long long wide[32];
  float floats[32];
  unsigned long long target;  // top-p's target mass
  unsigned prefix;
  unsigned above;             // count above the chosen bin (top-k)
  unsigned long long mass_above;
  bool done;
  bool last;                  // this block departs last
  CandidatePlan plan;
  CandidateScratch candidates;
};

// Offers this block's best (after a block reduction) to the row. True in every
// thread of the block that departs last, which then owns the row's results:
// every other block is done with the row and its writes are visible.
__device__ bool departs_last(RowSync& sync, unsigned splits, unsigned long long best, SplitShared& s) {
  __threadfence();  // this block's candidates, before the departure that publishes them
  best = row_group_reduce(best, MaxU64Op{}, 0ull, s.wide);
  if (threadIdx.x == 0) {
    if (best) atomicMax(&sync.best, best);
    __threadfence();
    s.last = atomicAdd(&sync.departed, 1u) == splits - 1;  // every block has passed every barrier
    if (s.last) __threadfence();
  }
  __syncthreads();
  return s.last;
}

// Run by the block that departs last once it has read the row's state: zero
// for the next launch.
__device__ void reset_row(RowSync& sync, int row) {
  __syncthreads();
  for (int b = threadIdx.x; b < kCandidateBins; b += blockDim.x) split_bins[row][b] = 0u;
  if (threadIdx.x == 0) {
    sync.arrived = sync.departed = sync.max_key = sync.num_candidates = 0u;
    sync.best = sync.total = 0ull;
  }
}

}  // namespace sparkd
