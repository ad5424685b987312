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

// E = -log(u) for vocab ids 4 * group + j, j = 0..3.
__device__ __forceinline__ void arrival_times(unsigned long long seed, unsigned long long step, int group,
                                              float (&arrival)[4]) {
  const uint4 w = philox4x32_10(make_uint4(group, static_cast<unsigned>(step), static_cast<unsigned>(step >> 32), 0u),
                                static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32));
  const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) arrival[j] = -logf((static_cast<float>(words[j] >> 9) + 0.5f) * 0x1p-23f);
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
