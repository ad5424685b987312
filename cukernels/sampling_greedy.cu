// Greedy sampling with nothing to process first (temperature 0, no penalty, no
// ban): each row's token is its largest logit, the lowest id among ties, as
// sample_kernel and sample_split_kernel draw such a row (best_candidate's order)
// and as numpy's argmax picks it. It reads no per-row parameters, so the step
// uploads none, and its blocks never wait for each other: each offers its best
// to the row's atomicMax slot, and the block that departs last writes the token
// and zeroes the slot for the next launch. A row takes as many blocks as the
// launcher gives it, so one row still reads its logits with the whole GPU.
#include "sampling_common.cuh"

using namespace sparkd;

constexpr int kGreedyThreads = 256;
constexpr int kMaxGreedyRows = 4096;  // MAX_GREEDY_ROWS in sampling.py

// Per-row state: zero when the module loads, zero again after every launch.
// Launches must therefore not run concurrently (sparkd runs all work on one stream).
__device__ unsigned long long greedy_best[kMaxGreedyRows];
__device__ unsigned greedy_departed[kMaxGreedyRows];

// logits: [B, V] float32 raw; out_tokens: [B] int32. B <= kMaxGreedyRows.
// Launch: grid = (splits, B), block = kGreedyThreads; block x takes ids
// [x * chunk, (x + 1) * chunk) of its row.
__global__ void __launch_bounds__(kGreedyThreads)
    sample_greedy_kernel(int* __restrict__ out_tokens, const float* __restrict__ logits, int vocab, int chunk) {
  __shared__ unsigned long long scratch[32];
  const int row = blockIdx.y, begin = blockIdx.x * chunk, end = min(vocab, begin + chunk);
  const float* raw = logits + static_cast<long long>(row) * vocab;
  unsigned long long best = 0;
  for (int i = begin + threadIdx.x; i < end; i += kGreedyThreads) {
    best = max(best, best_candidate(ordered_key(raw[i]), i));
  }
  best = row_group_reduce(best, MaxU64Op{}, 0ull, scratch);
  if (threadIdx.x != 0) return;
  atomicMax(&greedy_best[row], best);
  __threadfence();  // the offer is in before the departure that may end the row
  if (atomicAdd(&greedy_departed[row], 1u) != gridDim.x - 1) return;
  __threadfence();
  out_tokens[row] = candidate_id(atomicExch(&greedy_best[row], 0ull));
  greedy_departed[row] = 0u;
}
