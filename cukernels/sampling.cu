// Token sampling on the device: the CUDA twin of sparkd/backend/cpu/sampler.py.
// The chosen ids equal the reference's whenever no two candidates are within
// float rounding of each other (expf/logf differ from numpy by an ulp at most).
//
// One block of kThreads threads per row, for batches that fill the GPU
// (sampling_split.cu spreads the rows of small batches over many blocks); each
// step is a pass over the row (V <= 2^20):
//   1. penalties and banned ids (rows that have any) write the processed logit
//      of each listed id into work[id] and mark the id in a shared bitmap;
//      passes read work where marked, the raw logits elsewhere;
//   2. temperature 0: argmax, lowest id on ties; otherwise value = x / T and
//        top-k   keeps value >= the k-th largest value (ties at the edge stay),
//        top-p   keeps value >= the smallest v whose strictly-greater mass is
//                below top_p of the top-k mass (so ties at the edge stay),
//        min-p   zeroes weights exp(value - max) below min_p,
//      and the token is argmax weight / -log(u) with Philox uniforms u;
//   3. logprobs of the raw logits (log_softmax), the token's rank and the top
//      num_top ids by descending logprob, lower id first on ties.
// Both thresholds come from a short sorted candidate list
// (sampling_candidates.cuh), or when that does not fit from select_threshold, a
// radix select on order-preserving float keys weighted by counts (top-k) or
// mass (top-p) that finds the exact cut without sorting. Arithmetic that must match numpy bit
// for bit uses __f*_rn intrinsics, which the compiler never fuses into FMAs.
#include "sampling_candidates.cuh"

using namespace sparkd;

constexpr int kThreads = 1024;
constexpr int kMaxTop = 64;  // most top logprobs per row
constexpr int kRowCandidates = 4096;  // ROW_CANDIDATES in sampling.py; a power of two
constexpr int kRowBatch = 8;  // loads in flight per thread while streaming a row

struct RowParams {
  float temperature, top_p, min_p;
  int top_k;
  unsigned long long seed, step;
};

// Static shared memory of the kernel (~27 KB): radix histograms, reduction
// scratch and the top-logprob candidates.
struct SharedScratch {
  unsigned count_hist[kRadixBins];
  double mass_hist[kRadixBins];
  float floats[32];
  double doubles[32];
  int ints[32];
  ArgMax argmax[32];
  int top_ids[kMaxTop];
  int top_count;
  unsigned bins[kCandidateBins];
  CandidatePlan plan;
  unsigned num_candidates;
  CandidateScratch candidates;
};

// A row's logits after penalties and bans: work[i] where the bitmap marks i,
// raw[i] elsewhere (marked == nullptr: the raw row).
struct RowValues {
  const float* raw;
  const float* work;
  const unsigned* marked;

  __device__ __forceinline__ float operator()(int i) const {
    const float x = raw[i];
    return marked != nullptr && ((marked[i >> 5] >> (i & 31)) & 1u) ? work[i] : x;
  }
};

// The in-range ids of a row's three lists (prompt, output, banned; -1 padded, other
// out-of-range ids ignored), visited strided over the block's threads. (A struct with a
// template member, not a generic lambda: NVRTC 13.0's JIT mode rejects those.)
struct ListedIds {
  const int *prompt, *output, *banned;
  int prompt_len, output_len, banned_len, vocab;

  template <typename Visit>
  __device__ __forceinline__ void visit_list(const int* ids, int len, int bit, Visit& visit) const {
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
      if (ids[j] >= 0 && ids[j] < vocab) visit(ids[j], bit);
    }
  }

  // visit(id, bit): bit says the list (kInPrompt, kOutputCount or kBanned).
  template <typename Visit>
  __device__ __forceinline__ void for_each(Visit visit) const {
    visit_list(prompt, prompt_len, kInPrompt, visit);
    visit_list(output, output_len, kOutputCount, visit);
    visit_list(banned, banned_len, kBanned, visit);
  }
};

// Writes the processed logit of every id in the row's lists into work[id] and sets
// its bit in marked (ceil(V / 32) words, shared). work[id] first holds the id's marks
// (tally_marks's bits); the thread that sets the id's bit converts them. Every thread
// of the block calls it.
__device__ void process_listed_ids(float* work, unsigned* marked, const float* raw, int vocab,
                                   const Penalties& penalties, const int* prompt_ids, int prompt_len,
                                   const int* output_ids, int output_len, const int* banned_ids, int banned_len) {
  int* marks = reinterpret_cast<int*>(work);
  const ListedIds listed{prompt_ids, output_ids, banned_ids, prompt_len, output_len, banned_len, vocab};
  for (int w = threadIdx.x; w < (vocab + 31) / 32; w += blockDim.x) marked[w] = 0u;
  listed.for_each([&](int id, int) { marks[id] = 0; });
  __syncthreads();
  listed.for_each([&](int id, int bit) {
    if (bit == kOutputCount) atomicAdd(&marks[id], kOutputCount);
    else atomicOr(&marks[id], bit);
  });
  __syncthreads();
  listed.for_each([&](int id, int) {
    const unsigned bit = 1u << (id & 31);
    if (atomicOr(&marked[id >> 5], bit) & bit) return;  // another occurrence converts it
    work[id] = penalized(raw[id], marks[id], penalties);
  });
  __syncthreads();
}

// The token of a filtered row (top-k or top-p) drawn from its candidates
// (sampling_candidates.cuh), or -1 when they do not fit in `candidates`
// (kRowCandidates entries, shared). scaled(i): the row's value x / T.
template <typename Scaled>
__device__ int draw_from_row_candidates(Scaled scaled, int vocab, const Filters& filters, float shift,
                                        const RowParams& p, unsigned long long* candidates, SharedScratch& s) {
  for (int b = threadIdx.x; b < kCandidateBins; b += blockDim.x) s.bins[b] = 0u;
  if (threadIdx.x == 0) s.num_candidates = 0u;
  __syncthreads();
  const bool with_total = needs_total(filters);
  unsigned long long total = 0;
  for_each_in_row<kRowBatch>(vocab, scaled, [&](int, float v) {
    const int bin = candidate_bin(v, shift);
    if (bin < kCandidateBins) atomicAdd(&s.bins[bin], 1u);
    if (with_total) total += fixed_mass(expf(v - shift));
  });
  total = row_group_reduce(total, SumOp{}, 0ull, s.candidates.wide);  // its barrier also ends the binning
  if (threadIdx.x < 32) plan_candidates(s.bins, total, filters, kRowCandidates, s.plan);
  __syncthreads();
  const CandidatePlan plan = s.plan;
  if (!plan.fits) return -1;
  collect_candidates<kRowBatch>(vocab, 0, scaled, shift, plan.last_bin, candidates, &s.num_candidates);
  __syncthreads();
  return draw_from_candidates(candidates, static_cast<int>(plan.count), filters, shift, total, p.seed, p.step,
                              s.candidates);
}

// The exponential race over the filtered, temperature-scaled row (a row with
// temperature > 0): argmax of weight / -log(u). candidates: kRowCandidates
// entries of shared memory.
__device__ int draw_token(const RowValues& x, int vocab, const RowParams& p, unsigned long long* candidates,
                          SharedScratch& s) {
  const auto scaled = [&](int i) { return __fdiv_rn(x(i), p.temperature); };
  float max_value = -infinity();
  for_each_in_row<kRowBatch>(vocab, scaled, [&](int, float v) { max_value = fmaxf(max_value, v); });
  max_value = row_group_reduce(max_value, MaxOp{}, -infinity(), s.floats);
  // An all -inf row keeps weights 0 (and draws id 0), as the reference.
  const float shift = isfinite(max_value) ? max_value : 0.f;
  const Filters filters = row_filters(p.top_k, p.top_p, p.min_p, vocab);
  if (needs_cut(filters) && isfinite(max_value)) {
    const int token = draw_from_row_candidates(scaled, vocab, filters, shift, p, candidates, s);
    if (token >= 0) return token;
  }
  float threshold = -infinity();
  if (filters.top_k > 0) {
    const auto by_count = [&](int i) { return Candidate<unsigned>{scaled(i), 1u}; };
    threshold = select_threshold(vocab, by_count, static_cast<unsigned>(filters.top_k), s.count_hist).value;
  }
  if (p.top_p < 1.f && isfinite(max_value)) {
    const auto by_mass = [&](int i) {
      const float v = scaled(i);
      return Candidate<double>{v, v >= threshold ? static_cast<double>(expf(v - shift)) : 0.0};
    };
    double mass = 0.0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) mass += by_mass(i).weight;
    mass = row_group_reduce(mass, SumOp{}, 0.0, s.doubles);
    const float cut = select_threshold(vocab, by_mass, static_cast<double>(p.top_p) * mass, s.mass_hist).value;
    threshold = fmaxf(threshold, cut);
  }
  ArgMax best{-infinity(), 0x7fffffff};
  for (int group = threadIdx.x; 4 * group < vocab; group += blockDim.x) {
    float values[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) values[j] = 4 * group + j < vocab ? scaled(4 * group + j) : 0.f;
    float arrival[4];
    arrival_times(p.seed, p.step, group, arrival);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 4 * group + j;
      if (i >= vocab) break;
      float weight = values[j] >= threshold ? expf(values[j] - shift) : 0.f;
      if (weight < p.min_p) weight = 0.f;
      best = better(best, {__fdiv_rn(weight, arrival[j]), i});
    }
  }
  return block_argmax(best, s.argmax).index;
}

__device__ int argmax_row(const RowValues& x, int vocab, SharedScratch& s) {
  ArgMax best{-infinity(), 0x7fffffff};
  for_each_in_row<kRowBatch>(vocab, x, [&](int i, float v) { best = better(best, {v, i}); });
  return block_argmax(best, s.argmax).index;
}

// Logprobs of the raw logits x for the chosen token: log_softmax, rank
// (1 + the number of larger logprobs) and the num_top largest (ids by
// descending logprob, lower id first on ties), as sampler._with_logprobs. A NaN
// logprob (a row of -inf or NaN logits) ranks among the top ids as -inf, below
// every number as numpy sorts NaN last, so such a row fills its num_top slots
// too and never reads an id it did not write.
__device__ void write_logprobs(const float* x, int vocab, int token, int num_top, float* out_logprob, int* out_rank,
                               int* out_top_ids, float* out_top_logprobs, SharedScratch& s) {
  float max_logit = -infinity();
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) max_logit = fmaxf(max_logit, x[i]);
  max_logit = row_group_reduce(max_logit, MaxOp{}, -infinity(), s.floats);
  float sum = 0.f;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) sum += expf(x[i] - max_logit);
  const float log_sum = logf(row_group_reduce(sum, SumOp{}, 0.f, s.floats));
  const auto logprob = [&](int i) { return __fsub_rn(__fsub_rn(x[i], max_logit), log_sum); };

  const float chosen = logprob(token);
  int larger = 0;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) larger += logprob(i) > chosen;
  larger = row_group_reduce(larger, SumOp{}, 0, s.ints);
  if (threadIdx.x == 0) {
    *out_logprob = chosen;
    *out_rank = larger + 1;
  }
  if (num_top == 0) return;

  const auto order_of = [&](int i) {
    const float lp = logprob(i);
    return isnan(lp) ? -infinity() : lp;
  };
  const auto by_count = [&](int i) { return Candidate<unsigned>{order_of(i), 1u}; };
  const Selection<unsigned> kth = select_threshold(vocab, by_count, static_cast<unsigned>(num_top), s.count_hist);
  // Ids above the k-th logprob all belong; ties at it fill the rest, lowest ids
  // first. When every tie fits, order does not matter and atomics collect them.
  const int ties_wanted = num_top - static_cast<int>(kth.above);
  const bool all_ties_fit = kth.at == static_cast<unsigned>(ties_wanted);
  if (threadIdx.x == 0) s.top_count = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float order = order_of(i);
    if (order > kth.value || (all_ties_fit && order == kth.value)) s.top_ids[atomicAdd(&s.top_count, 1)] = i;
  }
  if (!all_ties_fit) {
    // Each thread walks a contiguous span so that a block scan orders the ties by id.
    const int span = (vocab + blockDim.x - 1) / blockDim.x;
    const int begin = min(vocab, static_cast<int>(threadIdx.x) * span), end = min(vocab, begin + span);
    int ties = 0;
    for (int i = begin; i < end; ++i) ties += order_of(i) == kth.value;
    int total;
    int slot = block_exclusive_sum(ties, s.ints, total) + static_cast<int>(kth.above);
    for (int i = begin; i < end && slot < num_top; ++i) {
      if (order_of(i) == kth.value) s.top_ids[slot++] = i;
    }
  }
  __syncthreads();
  // Rank sort of the num_top ids: one thread each.
  if (threadIdx.x < num_top) {
    const int id = s.top_ids[threadIdx.x];
    const float order = order_of(id);
    int rank = 0;
    for (int j = 0; j < num_top; ++j) {
      const int other = s.top_ids[j];
      const float other_order = order_of(other);
      rank += other_order > order || (other_order == order && other < id);
    }
    out_top_ids[rank] = id;
    out_top_logprobs[rank] = logprob(id);
  }
}

// logits: [B, V] float32 raw, V <= 2^20. work: [B, V] float32 scratch (the
// processed logits of listed ids, rows with penalties or bans only).
// Per-row parameters [B] as SamplingTensors; prompt_ids [B, P], output_ids
// [B, L], banned_ids [B, S] int32 padded with -1. out_tokens: [B] int32.
// When num_top >= 0 (at most kMaxTop and V): out_logprobs [B] float32,
// out_ranks [B] int32, out_top_ids [B, num_top] int32, out_top_logprobs
// [B, num_top] float32; with num_top < 0 these pointers are not touched.
// Launch: grid = B blocks (one row each), block = kThreads threads, dynamic
// shared memory 8 * kRowCandidates + 4 * ceil(V / 32) bytes.
__global__ void __launch_bounds__(kThreads)
sample_kernel(int* __restrict__ out_tokens, float* __restrict__ out_logprobs, int* __restrict__ out_ranks,
              int* __restrict__ out_top_ids, float* __restrict__ out_top_logprobs, float* work,
              const float* __restrict__ logits, int vocab, const float* __restrict__ temperature,
              const int* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ min_p,
              const float* __restrict__ repetition_penalty, const float* __restrict__ presence_penalty,
              const float* __restrict__ frequency_penalty, const int* __restrict__ prompt_ids, int prompt_len,
              const int* __restrict__ output_ids, int output_len, const int* __restrict__ banned_ids, int banned_len,
              const unsigned long long* __restrict__ seeds, const long long* __restrict__ steps, int num_top) {
  __shared__ SharedScratch scratch;
  extern __shared__ unsigned long long dynamic_shared[];  // candidates, then the bitmap of listed ids
  unsigned long long* candidates = dynamic_shared;
  unsigned* marked = reinterpret_cast<unsigned*>(dynamic_shared + kRowCandidates);
  const int row = blockIdx.x;
  const long long row_offset = static_cast<long long>(row) * vocab;
  const float* raw = logits + row_offset;
  const Penalties penalties{repetition_penalty[row], presence_penalty[row], frequency_penalty[row]};
  RowValues x{raw, nullptr, nullptr};
  if (row_is_penalized(penalties, banned_ids + static_cast<long long>(row) * banned_len, banned_len)) {
    process_listed_ids(work + row_offset, marked, raw, vocab, penalties,
                       prompt_ids + static_cast<long long>(row) * prompt_len, prompt_len,
                       output_ids + static_cast<long long>(row) * output_len, output_len,
                       banned_ids + static_cast<long long>(row) * banned_len, banned_len);
    x = RowValues{raw, work + row_offset, marked};
  }
  const RowParams params{temperature[row], top_p[row], min_p[row], top_k[row], seeds[row],
                         static_cast<unsigned long long>(steps[row])};
  const int token = params.temperature == 0.f ? argmax_row(x, vocab, scratch)
                                              : draw_token(x, vocab, params, candidates, scratch);
  if (threadIdx.x == 0) out_tokens[row] = token;
  if (num_top >= 0) {
    write_logprobs(raw, vocab, token, num_top, out_logprobs + row, out_ranks + row,
                   out_top_ids + static_cast<long long>(row) * num_top,
                   out_top_logprobs + static_cast<long long>(row) * num_top, scratch);
  }
}

// The logprobs of tokens already drawn (by sample_split_kernel), as sample_kernel
// writes them: tokens [B] int32 in, the other outputs as there.
// Launch: grid = B blocks (one row each), block = kThreads threads.
__global__ void __launch_bounds__(kThreads)
logprobs_kernel(const int* __restrict__ tokens, float* __restrict__ out_logprobs, int* __restrict__ out_ranks,
                int* __restrict__ out_top_ids, float* __restrict__ out_top_logprobs,
                const float* __restrict__ logits, int vocab, int num_top) {
  __shared__ SharedScratch scratch;
  const int row = blockIdx.x;
  write_logprobs(logits + static_cast<long long>(row) * vocab, vocab, tokens[row], num_top, out_logprobs + row,
                 out_ranks + row, out_top_ids + static_cast<long long>(row) * num_top,
                 out_top_logprobs + static_cast<long long>(row) * num_top, scratch);
}
