// Top-k / top-p draws from a short candidate list instead of radix descents
// over the whole row, for sampling.cu and sampling_split.cu.
//
// One pass bins every scaled value v by d = max - v (1/16 nat a bin, d < 16
// nats; the rest is not binned). From the bin counts alone (and, for top-p, the
// row's total mass) plan_candidates finds the fewest top bins that surely hold
// every id the filters can keep: the top k ids (top-k, which then also bounds
// top-p), or, for top-p alone, mass >= top_p of the total even if every value
// sat at its bin's far edge. Those bins' ids (a few thousand at most, usually
// far fewer) are collected, sorted by (value desc, id asc), and the cuts read
// off the sorted list exactly as the reference reads them off its sorted row;
// the race then runs over the kept candidates only. When the candidates do not
// fit, the caller falls back to its radix descents (same results, slower).
#pragma once

#include "sampling_common.cuh"

namespace sparkd {

constexpr int kCandidateBins = 256;
constexpr float kBinsPerNat = 16.f;

// The bin of a scaled value v <= shift (the row's max), or kCandidateBins when
// v lies 16 nats or more below it (or is -inf). Monotone: a larger v never
// gets a larger bin, so bins split the row in value order.
__device__ __forceinline__ int candidate_bin(float v, float shift) {
  const float scaled = __fmul_rn(__fsub_rn(shift, v), kBinsPerNat);
  return scaled < static_cast<float>(kCandidateBins) ? static_cast<int>(scaled) : kCandidateBins;
}

// A row's filters; top_k 0 and top_p >= 1 are off (top_k >= V is off too).
struct Filters {
  int top_k;
  float top_p, min_p;
};

__device__ __forceinline__ Filters row_filters(int top_k, float top_p, float min_p, int vocab) {
  return {top_k > 0 && top_k < vocab ? top_k : 0, top_p, min_p};
}

// Whether the filters need a cut (min-p alone is applied in the race).
__device__ __forceinline__ bool needs_cut(const Filters& f) { return f.top_k > 0 || f.top_p < 1.f; }

// Whether binning must also sum the row's mass (top-p without top-k).
__device__ __forceinline__ bool needs_total(const Filters& f) { return f.top_k == 0 && f.top_p < 1.f; }

struct CandidatePlan {
  int last_bin;    // candidates: the ids in bins 0..last_bin
  unsigned count;  // how many there are
  bool fits;       // count <= the caller's capacity
};

// Run by warp 0: the plan from the row's bin counts [kCandidateBins] and its
// total fixed-point mass (read only for top-p without top-k). Deterministic:
// every block that plans from the same counts gets the same plan.
__device__ void plan_candidates(const unsigned* counts, unsigned long long total, const Filters& f,
                                unsigned capacity, CandidatePlan& plan) {
  constexpr int kPerLane = kCandidateBins / 32;
  const int lane = threadIdx.x & 31, first = lane * kPerLane;
  const bool by_count = f.top_k > 0;
  // Top-p: ids tied or above a cut weigh >= the target, so bins whose far-edge
  // weights reach it hold the cut (the margin covers expf and rounding).
  const double needed = by_count ? static_cast<double>(f.top_k)
                                 : static_cast<double>(__double2ull_ru(static_cast<double>(f.top_p) *
                                                                       static_cast<double>(total)));
  const auto least_weight = [&](int b) {
    return by_count ? static_cast<double>(counts[b])
                    : static_cast<double>(counts[b]) * exp(-(b + 1) / static_cast<double>(kBinsPerNat)) *
                          (kMassScale * (1.0 - 1e-5));
  };
  double segment = 0.0;
  for (int b = first; b < first + kPerLane; ++b) segment += least_weight(b);
  double inclusive = segment;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const double other = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  double run = inclusive - segment;
  int found = 0x7fffffff;
  for (int b = first; b < first + kPerLane && found == 0x7fffffff; ++b) {
    run += least_weight(b);
    if (run >= needed) found = b;
  }
  for (int offset = 16; offset > 0; offset >>= 1) found = min(found, __shfl_xor_sync(kFullMask, found, offset));
  unsigned count = 0;
  for (int b = first; b < first + kPerLane && b <= found; ++b) count += counts[b];
  count = warp_reduce(count, SumOp{});
  if (lane == 0) plan = {found, count, found != 0x7fffffff && count <= capacity};
}

// Appends key to list[*size] for the threads that take it, one atomic a warp.
// size: shared or global; the caller sized list for every taker. Every thread
// of the warp calls it.
__device__ __forceinline__ void append_candidate(bool take, unsigned long long key, unsigned long long* list,
                                                 unsigned* size) {
  const unsigned takers = __ballot_sync(kFullMask, take);
  if (takers == 0) return;
  const int lane = threadIdx.x & 31, leader = __ffs(takers) - 1;
  unsigned base = 0;
  if (lane == leader) base = atomicAdd(size, static_cast<unsigned>(__popc(takers)));
  base = __shfl_sync(kFullMask, base, leader);
  if (take) list[base + __popc(takers & ((1u << lane) - 1u))] = key;
}

// Appends best_candidate(ordered_key(v), first + i) of the ids i of [0, n)
// with candidate_bin(v, shift) <= last_bin, v = value(i), to list[*size]. Every
// thread of the block calls it (the loop is uniform across warps).
template <int kBatch, typename Value>
__device__ void collect_candidates(int n, int first, Value value, float shift, int last_bin,
                                   unsigned long long* list, unsigned* size) {
  for (int base = 0; base < n; base += kBatch * blockDim.x) {
    float v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * blockDim.x + threadIdx.x;
      v[u] = i < n ? value(i) : -infinity();
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * blockDim.x + threadIdx.x;
      append_candidate(i < n && candidate_bin(v[u], shift) <= last_bin, best_candidate(ordered_key(v[u]), first + i),
                       list, size);
    }
  }
}

// Sum of v over the threads before this one in the block; total gets the sum over all.
__device__ unsigned long long block_exclusive_sum_u64(unsigned long long v, unsigned long long* scratch,
                                                      unsigned long long& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  unsigned long long inclusive = v;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const unsigned long long other = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  unsigned long long before = 0;
  total = 0;
  for (int w = 0; w < blockDim.x / 32; ++w) {
    before += w < warp ? scratch[w] : 0ull;
    total += scratch[w];
  }
  __syncthreads();
  return before + inclusive - v;
}

// Bitonic sort of keys[0, size) (size a power of two) into descending order.
__device__ void sort_descending(unsigned long long* keys, int size) {
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int pair = threadIdx.x; pair < size / 2; pair += blockDim.x) {
        const int i = ((pair & ~(j - 1)) << 1) | (pair & (j - 1)), partner = i + j;  // i has bit j clear
        const unsigned long long a = keys[i], b = keys[partner];
        if ((i & k) == 0 ? a < b : a > b) {
          keys[i] = b;
          keys[partner] = a;
        }
      }
      __syncthreads();
    }
  }
}

struct CandidateScratch {
  unsigned long long wide[32];
  int ints[32];
};

// The draw over the row's candidates keys[0, n) (best_candidate(ordered_key(v),
// id) of the scaled values v of every id in the plan's bins), which hold every
// id the filters keep. keys: shared memory of at least the power of two >= n
// entries (it is sorted in place). shift: the row's max; total: its fixed-point
// mass (top-p without top-k). Same cuts and race as sample_kernel's radix path
// (so as the reference); every thread of the block calls it and gets the id.
__device__ int draw_from_candidates(unsigned long long* keys, int n, const Filters& f, float shift,
                                    unsigned long long total, unsigned long long seed, unsigned long long step,
                                    CandidateScratch& s) {
  int size = 1;
  while (size < n) size <<= 1;
  for (int i = n + threadIdx.x; i < size; i += blockDim.x) keys[i] = 0ull;
  __syncthreads();
  sort_descending(keys, size);

  const auto value_of = [&](int i) { return key_value(candidate_key(keys[i])); };
  const auto mass_of = [&](int i) { return fixed_mass(expf(value_of(i) - shift)); };
  unsigned cut = 0;  // kept: candidate keys >= cut
  int kept = n;
  if (f.top_k > 0) {  // the k-th largest value; ids tied with it stay
    cut = candidate_key(keys[f.top_k - 1]);
    int at_least = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) at_least += candidate_key(keys[i]) >= cut;
    kept = row_group_reduce(at_least, SumOp{}, 0, s.ints);
  }
  if (f.top_p < 1.f) {
    // Exclusive prefix masses in sorted order: each thread a contiguous span.
    const int span = (kept + blockDim.x - 1) / blockDim.x;
    const int begin = min(kept, static_cast<int>(threadIdx.x) * span), end = min(kept, begin + span);
    unsigned long long mass = 0;
    for (int i = begin; i < end; ++i) mass += mass_of(i);
    unsigned long long kept_mass;
    unsigned long long before = block_exclusive_sum_u64(mass, s.wide, kept_mass);
    const unsigned long long target =
        __double2ull_ru(static_cast<double>(f.top_p) * static_cast<double>(f.top_k > 0 ? kept_mass : total));
    // The reference keeps the sorted prefix whose mass before each member is
    // below top_p (at least one id), then every id tied with its last member.
    int inside = 0;
    for (int i = begin; i < end; ++i) {
      inside += before < target;
      before += mass_of(i);
    }
    inside = max(row_group_reduce(inside, SumOp{}, 0, s.ints), 1);
    cut = max(cut, candidate_key(keys[inside - 1]));
  }
  unsigned long long best = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    if (candidate_key(keys[i]) < cut) continue;
    const float weight = expf(value_of(i) - shift);
    if (!(weight > 0.f) || weight < f.min_p) continue;
    const int id = candidate_id(keys[i]);
    best = max(best, best_candidate(ordered_key(__fdiv_rn(weight, arrival_time(seed, step, id))), id));
  }
  return candidate_id(row_group_reduce(best, MaxU64Op{}, 0ull, s.wide));
}

}  // namespace sparkd
