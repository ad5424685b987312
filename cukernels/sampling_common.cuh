// What the two token samplers share: sampling.cu (one block per row) and
// sampling_split.cu (a row spread over many blocks). Both are twins of
// sparkd/backend/cpu/sampler.py + philox.py; arithmetic that must match numpy
// bit for bit uses __f*_rn intrinsics, which the compiler never fuses into FMAs.
#pragma once

#include "common.cuh"

namespace sparkd {

// ---- Philox4x32-10, in the layout of sparkd/backend/cpu/philox.py ----

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
  }
  return c;
}

__device__ __forceinline__ uint4 philox_group(unsigned long long seed, unsigned long long step, int group) {
  return philox4x32_10(make_uint4(group, static_cast<unsigned>(step), static_cast<unsigned>(step >> 32), 0u),
                       static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32));
}

// E = -log(u) of one Philox word.
__device__ __forceinline__ float arrival_of_word(unsigned word) {
  return -logf((static_cast<float>(word >> 9) + 0.5f) * 0x1p-23f);
}

// E = -log(u) for vocab ids 4 * group + j, j = 0..3.
__device__ __forceinline__ void arrival_times(unsigned long long seed, unsigned long long step, int group,
                                              float (&arrival)[4]) {
  const uint4 w = philox_group(seed, step, group);
  const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) arrival[j] = arrival_of_word(words[j]);
}

// E = -log(u) for one vocab id (the word arrival_times gives it).
__device__ __forceinline__ float arrival_time(unsigned long long seed, unsigned long long step, int id) {
  const uint4 w = philox_group(seed, step, id / 4);
  const int j = id & 3;
  return arrival_of_word(j == 0 ? w.x : (j == 1 ? w.y : (j == 2 ? w.z : w.w)));
}

// ---- race candidates and fixed-point masses ----

// Orders candidates by key, then by lower id; 0 is below every candidate.
__device__ __forceinline__ unsigned long long best_candidate(unsigned key, int id) {
  return (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - static_cast<unsigned>(id));
}

__device__ __forceinline__ int candidate_id(unsigned long long best) {
  return best == 0 ? 0 : static_cast<int>(0xffffffffu - static_cast<unsigned>(best));
}

__device__ __forceinline__ unsigned candidate_key(unsigned long long best) { return static_cast<unsigned>(best >> 32); }

struct MaxU64Op {
  __device__ __forceinline__ unsigned long long operator()(unsigned long long a, unsigned long long b) const {
    return a > b ? a : b;
  }
};

// Top-p masses are fixed point, kMassScale per unit of weight exp(v - max) <= 1,
// so that sums are exact and independent of order (V * 2^44 < 2^64 up to V = 2^20).
constexpr double kMassScale = 0x1p44;

__device__ __forceinline__ unsigned long long fixed_mass(float weight) {
  return __double2ull_rn(static_cast<double>(weight) * kMassScale);
}

// Calls visit(i, load(i)) for this thread's ids i of [0, n) (threadIdx.x, then
// every blockDim.x), in increasing order, issuing kBatch loads before using
// any so that enough memory requests are in flight to stream a row.
template <int kBatch, typename Load, typename Visit>
__device__ __forceinline__ void for_each_in_row(int n, Load load, Visit visit) {
  const int stride = blockDim.x;
  int i = threadIdx.x;
  for (; i + (kBatch - 1) * stride < n; i += kBatch * stride) {
    float v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) v[u] = load(i + u * stride);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) visit(i + u * stride, v[u]);
  }
  for (; i < n; i += stride) visit(i, load(i));
}

// ---- penalties and bans (sampler.apply_penalties + ban_tokens) ----

constexpr int kInPrompt = 1, kBanned = 2, kOutputCount = 4;  // mark bits; the count sits above bit 1

struct Penalties {
  float repetition, presence, frequency;
};

// Whether the row's logits change before sampling: a penalty or a banned id.
// Every thread of the block must call it. banned_ids: the row's [S] ids, -1 padded.
__device__ bool row_is_penalized(const Penalties& p, const int* banned_ids, int banned_len) {
  bool has_ban = false;
  for (int j = threadIdx.x; j < banned_len; j += blockDim.x) has_ban |= banned_ids[j] >= 0;
  return __syncthreads_or(has_ban) || p.repetition != 1.f || p.presence != 0.f || p.frequency != 0.f;
}

// marks[id - begin] for every id in [begin, begin + n) of the row's lists (each
// -1 padded; other ids are ignored): kInPrompt, kBanned, plus kOutputCount per
// occurrence in the output. marks: n ints, shared or global, zeroed here.
// Every thread of the block must call it.
__device__ void tally_marks(int* marks, int begin, int n, const int* prompt_ids, int prompt_len,
                            const int* output_ids, int output_len, const int* banned_ids, int banned_len) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) marks[i] = 0;
  __syncthreads();
  const auto tally = [&](const int* ids, int len, int bit) {
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
      const int slot = ids[j] - begin;
      if (ids[j] < 0 || slot < 0 || slot >= n) continue;
      if (bit == kOutputCount) atomicAdd(&marks[slot], kOutputCount);
      else atomicOr(&marks[slot], bit);
    }
  };
  tally(prompt_ids, prompt_len, kInPrompt);
  tally(output_ids, output_len, kOutputCount);
  tally(banned_ids, banned_len, kBanned);
  __syncthreads();
}

// The logit x of an id with `mark` after the repetition, presence and
// frequency penalties and the ban, in the reference's order.
__device__ __forceinline__ float penalized(float x, int mark, const Penalties& p) {
  const int count = mark / kOutputCount;
  if (p.repetition != 1.f && (count > 0 || (mark & kInPrompt))) {
    x = x > 0.f ? __fdiv_rn(x, p.repetition) : __fmul_rn(x, p.repetition);
  }
  if (count > 0) x = __fsub_rn(x, __fadd_rn(__fmul_rn(static_cast<float>(count), p.frequency), p.presence));
  if (mark & kBanned) x = -infinity();
  return x;
}

}  // namespace sparkd
