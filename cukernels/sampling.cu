// Token sampling on the device: the CUDA twin of sparkd/backend/cpu/sampler.py.
// The chosen ids equal the reference's whenever no two candidates are within
// float rounding of each other (expf/logf differ from numpy by an ulp at most).
//
// One block of kThreads threads per row, for batches that fill the GPU
// (sampling_split.cu spreads the rows of small batches over many blocks); each
// step is a pass over the row (L2-resident at these sizes), so V is limited
// only by the workspace:
//   1. penalties and banned ids (rows that have any) write the processed row
//      into work; other rows read the logits directly;
//   2. temperature 0: argmax, lowest id on ties; otherwise value = x / T and
//        top-k   keeps value >= the k-th largest value (ties at the edge stay),
//        top-p   keeps value >= the smallest v whose strictly-greater mass is
//                below top_p of the top-k mass (so ties at the edge stay),
//        min-p   zeroes weights exp(value - max) below min_p,
//      and the token is argmax weight / -log(u) with Philox uniforms u;
//   3. logprobs of the raw logits (log_softmax), the token's rank and the top
//      num_top ids by descending logprob, lower id first on ties.
// Both thresholds come from select_threshold, a radix select on
// order-preserving float keys weighted by counts (top-k) or mass (top-p); it
// finds the exact cut without sorting. Arithmetic that must match numpy bit
// for bit uses __f*_rn intrinsics, which the compiler never fuses into FMAs.
#include "sampling_common.cuh"

using namespace sparkd;

constexpr int kThreads = 1024;
constexpr int kMaxTop = 64;  // most top logprobs per row

struct RowParams {
  float temperature, top_p, min_p;
  int top_k;
  unsigned long long seed, step;
};

// Shared memory of the kernel (~25 KB): radix histograms, reduction scratch
// and the top-logprob candidates.
struct SharedScratch {
  unsigned count_hist[kRadixBins];
  double mass_hist[kRadixBins];
  float floats[32];
  double doubles[32];
  int ints[32];
  ArgMax argmax[32];
  int top_ids[kMaxTop];
  int top_count;
};

// The exponential race over the filtered, temperature-scaled row (a row with
// temperature > 0): argmax of weight / -log(u).
__device__ int draw_token(const float* x, int vocab, const RowParams& p, SharedScratch& s) {
  const auto scaled = [&](int i) { return __fdiv_rn(x[i], p.temperature); };
  float max_value = -infinity();
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) max_value = fmaxf(max_value, scaled(i));
  max_value = row_group_reduce(max_value, MaxOp{}, -infinity(), s.floats);
  // An all -inf row keeps weights 0 (and draws id 0), as the reference.
  const float shift = isfinite(max_value) ? max_value : 0.f;
  float threshold = -infinity();
  if (p.top_k > 0 && p.top_k < vocab) {
    const auto by_count = [&](int i) { return Candidate<unsigned>{scaled(i), 1u}; };
    threshold = select_threshold(vocab, by_count, static_cast<unsigned>(p.top_k), s.count_hist).value;
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
    float arrival[4];
    arrival_times(p.seed, p.step, group, arrival);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 4 * group + j;
      if (i >= vocab) break;
      const float v = scaled(i);
      float weight = v >= threshold ? expf(v - shift) : 0.f;
      if (weight < p.min_p) weight = 0.f;
      best = better(best, {__fdiv_rn(weight, arrival[j]), i});
    }
  }
  return block_argmax(best, s.argmax).index;
}

__device__ int argmax_row(const float* x, int vocab, SharedScratch& s) {
  ArgMax best{-infinity(), 0x7fffffff};
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) best = better(best, {x[i], i});
  return block_argmax(best, s.argmax).index;
}

// Logprobs of the raw logits x for the chosen token: log_softmax, rank
// (1 + the number of larger logprobs) and the num_top largest (ids by
// descending logprob, lower id first on ties), as sampler._with_logprobs.
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

  const auto by_count = [&](int i) { return Candidate<unsigned>{logprob(i), 1u}; };
  const Selection<unsigned> kth = select_threshold(vocab, by_count, static_cast<unsigned>(num_top), s.count_hist);
  // Ids above the k-th logprob all belong; ties at it fill the rest, lowest ids
  // first. When every tie fits, order does not matter and atomics collect them.
  const int ties_wanted = num_top - static_cast<int>(kth.above);
  const bool all_ties_fit = kth.at == static_cast<unsigned>(ties_wanted);
  if (threadIdx.x == 0) s.top_count = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float lp = logprob(i);
    if (lp > kth.value || (all_ties_fit && lp == kth.value)) s.top_ids[atomicAdd(&s.top_count, 1)] = i;
  }
  if (!all_ties_fit) {
    // Each thread walks a contiguous span so that a block scan orders the ties by id.
    const int span = (vocab + blockDim.x - 1) / blockDim.x;
    const int begin = min(vocab, static_cast<int>(threadIdx.x) * span), end = min(vocab, begin + span);
    int ties = 0;
    for (int i = begin; i < end; ++i) ties += logprob(i) == kth.value;
    int total;
    int slot = block_exclusive_sum(ties, s.ints, total) + static_cast<int>(kth.above);
    for (int i = begin; i < end && slot < num_top; ++i) {
      if (logprob(i) == kth.value) s.top_ids[slot++] = i;
    }
  }
  __syncthreads();
  // Rank sort of the num_top ids: one thread each.
  if (threadIdx.x < num_top) {
    const int id = s.top_ids[threadIdx.x];
    const float lp = logprob(id);
    int rank = 0;
    for (int j = 0; j < num_top; ++j) {
      const int other = s.top_ids[j];
      const float other_lp = logprob(other);
      rank += other_lp > lp || (other_lp == lp && other < id);
    }
    out_top_ids[rank] = id;
    out_top_logprobs[rank] = lp;
  }
}

// logits: [B, V] float32 raw. work: [B, V] float32 scratch (penalised rows).
// Per-row parameters [B] as SamplingTensors; prompt_ids [B, P], output_ids
// [B, L], banned_ids [B, S] int32 padded with -1. out_tokens: [B] int32.
// When num_top >= 0 (at most kMaxTop and V): out_logprobs [B] float32,
// out_ranks [B] int32, out_top_ids [B, num_top] int32, out_top_logprobs
// [B, num_top] float32; with num_top < 0 these pointers are not touched.
// Launch: grid = B blocks (one row each), block = kThreads threads.
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
  const int row = blockIdx.x;
  const long long row_offset = static_cast<long long>(row) * vocab;
  const float* raw = logits + row_offset;
  const Penalties penalties{repetition_penalty[row], presence_penalty[row], frequency_penalty[row]};
  const float* x = raw;
  if (row_is_penalized(penalties, banned_ids + static_cast<long long>(row) * banned_len, banned_len)) {
    float* row_work = work + row_offset;
    int* marks = reinterpret_cast<int*>(row_work);  // the marks, then the penalised logits in their place
    tally_marks(marks, 0, vocab, prompt_ids + static_cast<long long>(row) * prompt_len, prompt_len,
                output_ids + static_cast<long long>(row) * output_len, output_len,
                banned_ids + static_cast<long long>(row) * banned_len, banned_len);
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) row_work[i] = penalized(raw[i], marks[i], penalties);
    __syncthreads();
    x = row_work;
  }
  const RowParams params{temperature[row], top_p[row], min_p[row], top_k[row], seeds[row],
                         static_cast<unsigned long long>(steps[row])};
  const int token = params.temperature == 0.f ? argmax_row(x, vocab, scratch) : draw_token(x, vocab, params, scratch);
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
