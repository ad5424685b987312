// Token sampling for small batches: each row is spread over `splits` blocks,
// so that a batch of one still uses the whole GPU (sampling.cu runs one block
// per row, for batches that fill it). Same semantics, draws and tie rules as
// sample_kernel and sparkd/backend/cpu/sampler.py.
//
// Each block keeps its chunk of the row in shared memory (penalised and, for
// temperature > 0, divided by the temperature) and the row's blocks meet at
// row barriers, through per-row state in global memory:
//   greedy rows: each block's best (value, lowest id) goes into the row's
//     atomicMax slot; the block that departs last writes the token. No barrier.
//   other rows: the row's max (atomicMax on order-preserving keys), barrier;
//     then, for top-k / top-p rows, the blocks add their chunks' bin counts
//     (sampling_candidates.cuh) in global memory, barrier, and every block
//     plans the same candidate bins from the same totals. When the candidates
//     fit, each block appends its own to the row's list and the block that
//     departs last sorts the list and draws the token from it. Otherwise (and
//     for temperature / min-p rows, with no cut) top-k, then top-p, each a
//     radix descent on the keys (11, 11, 10 bits, as select_threshold) whose
//     per-level histograms the blocks add up in global memory with integer
//     atomics, one barrier per level, every block then picking the same bin
//     from the same totals (early out once the chosen bin is wholly kept);
//     then each block races its kept ids (weight / -log u, as sample_kernel)
//     into the row's atomicMax slot, and the last to depart writes the token.
// Integer atomics make every total independent of arrival order, so results
// are deterministic. Top-p masses are fixed point (kMassScale per unit of
// weight exp(v - max) <= 1): the cut moves only if the mass above it lies
// within ~1e-11 of top_p times the total, where numpy's float64 cumsum is as
// uncertain.
//
// Row barriers wait for every block of the row, so all of them must be
// resident at once: the launcher keeps the grid within what the device holds
// at this kernel's occupancy (plan_split in sampling.py).
#include "sampling_split_rows.cuh"

using namespace sparkd;

constexpr int kSplitThreads = 256;

// The candidate path of a filtered row (sampling_candidates.cuh): bins the
// block's chunk values[0, n) (ids begin + i) into the row's counts (and mass),
// waits for the row's blocks, plans from the totals (the same plan in every
// block) and, when the candidates fit, adds the chunk's to split_candidates[row].
__device__ CandidatePlan collect_split_candidates(const float* values, int n, int begin, const Filters& f,
                                                  float shift, int row, unsigned splits, RowSync& sync,
                                                  SplitShared& s) {
  unsigned* counts = s.counts;  // its first kCandidateBins entries
  for (int b = threadIdx.x; b < kCandidateBins; b += blockDim.x) counts[b] = 0u;
  __syncthreads();
  const bool with_total = needs_total(f);
  unsigned long long mass = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int bin = candidate_bin(values[i], shift);
    if (bin < kCandidateBins) atomicAdd(&counts[bin], 1u);
    if (with_total) mass += fixed_mass(expf(values[i] - shift));
  }
  mass = row_group_reduce(mass, SumOp{}, 0ull, s.wide);  // its barrier also ends the binning
  for (int b = threadIdx.x; b < kCandidateBins; b += blockDim.x) {
    if (counts[b] != 0u) atomicAdd(&split_bins[row][b], counts[b]);
  }
  if (threadIdx.x == 0 && mass != 0ull) atomicAdd(&sync.total, mass);
  row_barrier(sync, splits);
  for (int b = threadIdx.x; b < kCandidateBins; b += blockDim.x) counts[b] = __ldcg(&split_bins[row][b]);
  __syncthreads();
  if (threadIdx.x < 32) plan_candidates(counts, __ldcg(&sync.total), f, kSplitCandidates, s.plan);
  __syncthreads();
  const CandidatePlan plan = s.plan;
  if (plan.fits) {
    collect_candidates<1>(n, begin, [&](int i) { return values[i]; }, shift, plan.last_bin, split_candidates[row],
                          &sync.num_candidates);
  }
  return plan;
}

// Where a descent stands: the key digits chosen so far and what lies above them.
struct Descent {
  unsigned prefix;
  int level;                  // the next digit to choose: 0..2
  unsigned above;             // top-k: candidates above the prefix's range
  unsigned long long mass_above;
};

__device__ __forceinline__ int level_bits(int level) { return level == 2 ? 10 : 11; }
__device__ __forceinline__ int level_shift(int level) { return level == 0 ? 21 : (level == 1 ? 10 : 0); }

// The row's cut for top-k (by_mass false: the k-th largest value) or top-p
// (the smallest value whose strictly-greater mass is below top_p of the
// total), as the lowest key that stays: ids with ordered_key(value) >= it are
// kept. values: the block's n chunk values; kept_key: only values with a key
// at least this take part (top-p after top-k); shift: the row's max.
// `region` counts the row's levels so far. Every thread of the block calls it.
__device__ unsigned descend_cut(const float* values, int n, bool by_mass, unsigned k, float top_p, unsigned kept_key,
                                float shift, int row, unsigned splits, int& region, RowSync& sync, SplitShared& s) {
  Descent d{0u, 0, 0u, 0ull};
  for (;;) {
    const int bits = level_bits(d.level), shift_bits = level_shift(d.level), num_bins = 1 << bits;
    unsigned* g_counts = split_counts[row][region % kRegions];
    unsigned long long* g_masses = split_masses[row][region % kRegions];
    // This block's slice of the region the next level adds into.
    const int slice = (kRadixBins + splits - 1) / splits, first = blockIdx.x * slice;
    for (int b = first + threadIdx.x; b < min(kRadixBins, first + slice); b += blockDim.x) {
      split_counts[row][(region + 1) % kRegions][b] = 0u;
      split_masses[row][(region + 1) % kRegions][b] = 0ull;
    }
    for (int b = threadIdx.x; b < num_bins; b += blockDim.x) {
      s.counts[b] = 0u;
      s.masses[b] = 0ull;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const unsigned key = ordered_key(values[i]);
      if (key < kept_key || (d.level > 0 && (key >> (shift_bits + bits)) != d.prefix)) continue;
      const int bin = (key >> shift_bits) & (num_bins - 1);
      if (by_mass) {
        const unsigned long long mass = fixed_mass(expf(values[i] - shift));
        if (mass == 0) continue;
        atomicAdd(&s.masses[bin], mass);
      }
      atomicAdd(&s.counts[bin], 1u);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < num_bins; b += blockDim.x) {
      if (s.counts[b] == 0) continue;
      atomicAdd(&g_counts[b], s.counts[b]);
      if (by_mass) atomicAdd(&g_masses[b], s.masses[b]);
    }
    row_barrier(sync, splits);

    // Every block reads the row's totals and picks the same bin.
    for (int b = threadIdx.x; b < num_bins; b += blockDim.x) {
      s.counts[b] = __ldcg(&g_counts[b]);
      if (by_mass) s.masses[b] = __ldcg(&g_masses[b]);
    }
    if (by_mass && d.level == 0) {
      unsigned long long total = 0;
      for (int b = threadIdx.x; b < num_bins; b += blockDim.x) total += __ldcg(&g_masses[b]);
      total = row_group_reduce(total, SumOp{}, 0ull, s.wide);
      if (threadIdx.x == 0) s.target = __double2ull_ru(static_cast<double>(top_p) * static_cast<double>(total));
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      int bin;
      if (by_mass) {
        unsigned long long mass_above;
        pick_bin(s.masses, num_bins, d.mass_above, s.target, bin, mass_above);
        if (threadIdx.x == 0) {
          s.above = 0u;
          s.mass_above = mass_above;
          s.done = s.counts[bin] == 1;  // one id in the bin: it is the cut
        }
      } else {
        unsigned above;
        pick_bin(s.counts, num_bins, d.above, k, bin, above);
        if (threadIdx.x == 0) {
          s.above = above;
          s.mass_above = 0ull;
          s.done = above + s.counts[bin] <= k;  // every id of the bin is among the top k
        }
      }
      if (threadIdx.x == 0) s.prefix = (d.prefix << bits) | bin;
    }
    __syncthreads();
    d = Descent{s.prefix, d.level + 1, s.above, s.mass_above};
    const bool done = s.done || d.level == 3;
    ++region;
    __syncthreads();  // s is rewritten by the next level or descent
    if (done) return d.prefix << shift_bits;
  }
}

// values: this block's processed logits (greedy) or scaled values (x / T).
// Returns the block's best candidate: (value, id) for greedy rows, else
// (weight / -log u, id) over its kept ids.
__device__ unsigned long long race_chunk(const float* values, int n, int begin, unsigned cut, float shift,
                                         float min_p, unsigned long long seed, unsigned long long step) {
  unsigned long long best = 0;
  for (int group = threadIdx.x; 4 * group < n; group += blockDim.x) {
    float weights[4];
    bool any = false;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 4 * group + j;
      float weight = 0.f;
      if (i < n && ordered_key(values[i]) >= cut) weight = expf(values[i] - shift);
      if (weight < min_p) weight = 0.f;
      weights[j] = weight;
      any |= weight > 0.f;
    }
    if (!any) continue;  // no draw can pick these ids: skip their Philox block
    float arrival[4];
    arrival_times(seed, step, begin / 4 + group, arrival);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (weights[j] > 0.f) {
        best = max(best, best_candidate(ordered_key(__fdiv_rn(weights[j], arrival[j])), begin + 4 * group + j));
      }
    }
  }
  return best;
}

// logits: [B, V] float32 raw; per-row parameters [B] and id lists [B, P|L|S]
// (-1 padded) as sample_kernel; out_tokens: [B] int32. B <= kMaxSplitRows.
// chunk: ids per block, a multiple of 4 (whole Philox groups). Dynamic shared
// memory: max(4 * chunk, 8 * kSplitCandidates) bytes (the chunk's values, or
// the row's candidates in the block that draws from them).
// Launch: grid = (splits = ceil(V / chunk), B), block = kSplitThreads threads,
// every block resident at once.
__global__ void __launch_bounds__(kSplitThreads)
sample_split_kernel(int* __restrict__ out_tokens, const float* __restrict__ logits, int vocab, int chunk,
                    const float* __restrict__ temperature, const int* __restrict__ top_k,
                    const float* __restrict__ top_p, const float* __restrict__ min_p,
                    const float* __restrict__ repetition_penalty, const float* __restrict__ presence_penalty,
                    const float* __restrict__ frequency_penalty, const int* __restrict__ prompt_ids, int prompt_len,
                    const int* __restrict__ output_ids, int output_len, const int* __restrict__ banned_ids,
                    int banned_len, const unsigned long long* __restrict__ seeds,
                    const long long* __restrict__ steps) {
  // The chunk (first the penalty marks in its place); in the block that draws
  // from the row's candidates, then those.
  extern __shared__ unsigned long long dynamic_shared[];
  float* values = reinterpret_cast<float*>(dynamic_shared);
  __shared__ SplitShared s;
  const int row = blockIdx.y;
  const unsigned splits = gridDim.x;
  const int begin = blockIdx.x * chunk, n = min(chunk, vocab - begin);
  const float* raw = logits + static_cast<long long>(row) * vocab + begin;
  RowSync& sync = split_rows[row];

  const Penalties penalties{repetition_penalty[row], presence_penalty[row], frequency_penalty[row]};
  const bool penalize = row_is_penalized(penalties, banned_ids + static_cast<long long>(row) * banned_len, banned_len);
  int* marks = reinterpret_cast<int*>(values);
  if (penalize) {
    tally_marks(marks, begin, n, prompt_ids + static_cast<long long>(row) * prompt_len, prompt_len,
                output_ids + static_cast<long long>(row) * output_len, output_len,
                banned_ids + static_cast<long long>(row) * banned_len, banned_len);
  }
  const float temp = temperature[row];
  float local_max = -infinity();
  unsigned long long best = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float x = raw[i];
    if (penalize) x = penalized(x, marks[i], penalties);  // the same thread reads the mark, then overwrites it
    const float v = temp == 0.f ? x : __fdiv_rn(x, temp);
    values[i] = v;
    local_max = fmaxf(local_max, v);
    best = max(best, best_candidate(ordered_key(v), begin + i));
  }

  const Filters filters = row_filters(top_k[row], top_p[row], min_p[row], vocab);
  float shift = 0.f;
  CandidatePlan plan{0, 0u, false};  // plan.fits: the row draws from its candidates
  if (temp != 0.f) {
    if (needs_cut(filters)) {  // zero the first descent level's region before anyone adds into it
      const int slice = (kRadixBins + splits - 1) / splits, first = blockIdx.x * slice;
      for (int b = first + threadIdx.x; b < min(kRadixBins, first + slice); b += blockDim.x) {
        split_counts[row][0][b] = 0u;
        split_masses[row][0][b] = 0ull;
      }
    }
    local_max = row_group_reduce(local_max, MaxOp{}, -infinity(), s.floats);
    if (threadIdx.x == 0) atomicMax(&sync.max_key, ordered_key(local_max));
    row_barrier(sync, splits);
    const float max_value = key_value(__ldcg(&sync.max_key));
    // An all -inf row keeps weights 0 (and draws id 0), as the reference.
    shift = isfinite(max_value) ? max_value : 0.f;
    if (needs_cut(filters) && isfinite(max_value)) {
      plan = collect_split_candidates(values, n, begin, filters, shift, row, splits, sync, s);
    }
    best = 0;
    if (!plan.fits) {  // radix descents over the row's chunks, then every block races its kept ids
      int region = 0;
      unsigned cut = 0;
      if (filters.top_k > 0) {
        cut = descend_cut(values, n, false, filters.top_k, filters.top_p, 0u, shift, row, splits, region, sync, s);
      }
      if (filters.top_p < 1.f && isfinite(max_value)) {
        cut = max(cut, descend_cut(values, n, true, 0u, filters.top_p, cut, shift, row, splits, region, sync, s));
      }
      best = race_chunk(values, n, begin, cut, shift, filters.min_p, seeds[row],
                        static_cast<unsigned long long>(steps[row]));
    }
  }
  if (!departs_last(sync, splits, best, s)) return;
  int winner;
  if (plan.fits) {
    unsigned long long* keys = dynamic_shared;
    for (int i = threadIdx.x; i < static_cast<int>(plan.count); i += blockDim.x) {
      keys[i] = __ldcg(&split_candidates[row][i]);
    }
    winner = draw_from_candidates(keys, static_cast<int>(plan.count), filters, shift, __ldcg(&sync.total), seeds[row],
                                  static_cast<unsigned long long>(steps[row]), s.candidates);
  } else {
    winner = candidate_id(__ldcg(&sync.best));
  }
  reset_row(sync, row);
  if (threadIdx.x == 0) out_tokens[row] = winner;
}
