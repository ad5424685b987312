// The MoE combine's sums: a token's output columns as the weighted sum of its k expert rows
// (the CUDA twin of the final sum in sparkd/backend/cpu/moe.py). moe_combine_kernel
// (moe_routing.cu) stores them on their own; combine_add_rmsnorm_kernel (norm.cu) adds them to
// the residual stream in the next layer's norm, which saves a decode step's launch per MoE layer.
#pragma once

#include "common.cuh"

namespace sparkd {

constexpr int kCombineBatch = 8;  // rows a combine thread loads before it adds

// Marks a loaded pack as changed here, so that its elements are widened to fp32 at their add,
// not as soon as they arrive: ptxas otherwise holds a batch's bf16 rows as fp32 (96 registers
// at W = 8, two blocks an SM; the 4096-token prefill's combine then ran at 0.70 of the copy rate,
// run 45) where the packed rows need 64.
template <typename T, int W>
__device__ __forceinline__ void keep_packed(Pack<T, W>& pack) {
  if constexpr (sizeof(pack) % 4 == 0) {
    unsigned* words = reinterpret_cast<unsigned*>(&pack);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(pack) / 4); ++i) asm volatile("" : "+r"(words[i]));
  } else {
    unsigned short* halves = reinterpret_cast<unsigned short*>(&pack);  // one 16-bit element
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(pack) / 2); ++i) asm volatile("" : "+h"(halves[i]));
  }
}

// acc[c] = sum over j = 0 .. k-1 of weights[t, j] * expert_out[row_of_pair[t * k + j], col + c]
// for token t, c < W: expert_out [P, H] in T (the expert GEMMs' rounded rows), weights [T, k]
// fp32, row_of_pair [P] (a MoeAlignment's). Products and sums are fp32, rounded separately (no
// FMA), in order of j, as the numpy twin computes them; the caller rounds the sum to T. Rows of
// -1 add nothing. W > 1: expert_out's rows are W-element aligned at col.
template <typename T, int W>
__device__ __forceinline__ void combine_columns(float (&acc)[W], const T* __restrict__ expert_out,
                                                const float* __restrict__ weights,
                                                const int* __restrict__ row_of_pair, int token, int col,
                                                int hidden, int top_k) {
#pragma unroll
  for (int c = 0; c < W; ++c) acc[c] = 0.f;
  for (int first = 0; first < top_k; first += kCombineBatch) {
    // All of a batch's loads are in flight before the first add: at decode each one
    // is a trip to L2, and k of them in sequence would be the kernel's whole time.
    // The rows stay in T until their adds (keep_packed), which keeps fewer registers live
    // while the loads are in flight.
    int rows[kCombineBatch];
    float batch_weights[kCombineBatch];
    Pack<T, W> values[kCombineBatch];
#pragma unroll
    for (int i = 0; i < kCombineBatch; ++i) {
      const int pair = token * top_k + first + i;
      rows[i] = first + i < top_k ? row_of_pair[pair] : -1;
      batch_weights[i] = first + i < top_k ? weights[pair] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kCombineBatch; ++i) {
      if (rows[i] >= 0) {
        values[i] = *reinterpret_cast<const Pack<T, W>*>(expert_out + static_cast<long long>(rows[i]) * hidden + col);
      }
    }
#pragma unroll
    for (int i = 0; i < kCombineBatch; ++i) {
      if (rows[i] < 0) continue;
      keep_packed(values[i]);
#pragma unroll
      for (int c = 0; c < W; ++c) {
        acc[c] = __fadd_rn(acc[c], __fmul_rn(batch_weights[i], to_float(values[i].v[c])));
      }
    }
  }
}

}  // namespace sparkd
