// The token-by-token gated delta rule of one block (its columns of one value head's state, along
// one sequence), which gated_delta_rule_kernel (delta_rule.cu) and the fused decode tail
// (delta_rule_decode.cu) both run: they differ only in where a token's gates come from and what
// becomes of its output.
#pragma once

#include "delta_net_common.cuh"

namespace sparkd {

// Launch: grid (Hv, B, ceil(dv / columns)), blockDim.x = kSplit * columns <= kDeltaThreads, columns
// a multiple of 32 / kSplit: kSplit neighbouring threads own one column of the head's state,
// S[:, j], in registers, kMaxDk / kSplit rows each (dk <= kMaxDk), and meet by shuffles.
// 16 rows a thread: a batch-1 decode step is one token, so its time is the state's one round
// trip, and short columns spread that over more blocks (Qwen3-Next's 32 heads of 128 x 128:
// 256 blocks, where 64 rows a thread gave 64 blocks and 8.3 us).
constexpr int kDeltaThreads = 128, kDeltaRows = 16;

// A thread's rows of a state column (kRows) and the threads that share the column (kSplit), for
// dk up to kMaxDk; DeltaColumn is that thread's StateColumn.
template <int kMaxDk>
struct DeltaSplit {
  static constexpr int kRows = kMaxDk < kDeltaRows ? kMaxDk : kDeltaRows;
  static constexpr int kSplit = kMaxDk / kRows;
};

template <int kMaxDk>
using DeltaColumn = StateColumn<DeltaSplit<kMaxDk>::kRows>;

// A token's decay exp(g) and write strength beta.
struct DeltaGates {
  float decay, write;
};

// Runs the delta rule over sequence blockIdx.y's new tokens for this block's columns of value
// head blockIdx.x (the launch above), from the state in the sequence's slot (zeros when it has no
// cached tokens) to the slot, writing the snapshots on the way. mixed_qkv: [T, 2 Hk dk + Hv dv] =
// [q | k | v] at row stride ld_qkv; state [slots, Hv, dk, dv] in S. q and k are L2-normalised
// (eps 1e-6 inside the root, as flash-linear-attention), q scaled by dk^-0.5; value head h reads
// key head h / (Hv / Hk). At each token (its row of T):
//   gates(row) -> DeltaGates;
//   emit(row, column, o): column is the thread's DeltaColumn<kMaxDk>, o column.j's output, on every
//   thread of the column (every thread of the block calls it, once a token).
template <typename T, typename S, int kMaxDk, typename Gates, typename Emit>
__device__ __forceinline__ void recurrent_delta_rule(const T* __restrict__ mixed_qkv, long long ld_qkv,
                                                     S* __restrict__ state, const Segments& seg, int num_k_heads,
                                                     int num_v_heads, int dk, int dv, Gates gates, Emit emit) {
  constexpr int kRows = DeltaSplit<kMaxDk>::kRows, kSplit = DeltaSplit<kMaxDk>::kSplit;
  __shared__ float q_s[kMaxDk], k_s[kMaxDk], inv_norms[2];
  const int h = blockIdx.x, b = blockIdx.y;
  DeltaColumn<kMaxDk> column((threadIdx.x % kSplit) * kRows, blockIdx.z * (blockDim.x / kSplit) + threadIdx.x / kSplit,
                            dk, dv);
  float (&s)[kRows] = column.s;
  const int j = column.j, row0 = column.row0;
  const HeadSegment<S> head = load_head(column, seg, state, b, h, num_k_heads, num_v_heads);
  const int kh = head.kh, start = head.start, length = head.length;
  int next = seg.snapshot_start[b];
  for (int t = 0; t <= length; ++t) {
    next = store_snapshots(column, seg, b, t, next, state, num_v_heads, h);
    if (t == length) break;
    const long long row = static_cast<long long>(start + t);
    const T* qkv = mixed_qkv + row * ld_qkv;
    __syncthreads();  // the previous token's q_s / k_s are read
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
      q_s[i] = to_float(qkv[kh * dk + i]);
      k_s[i] = to_float(qkv[(num_k_heads + kh) * dk + i]);
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // warp 0: the two L2 norms
      float qq = 0.f, kk = 0.f;
      for (int i = threadIdx.x; i < dk; i += 32) {
        qq += q_s[i] * q_s[i];
        kk += k_s[i] * k_s[i];
      }
      qq = warp_reduce(qq, SumOp());
      kk = warp_reduce(kk, SumOp());
      if (threadIdx.x == 0) {
        inv_norms[0] = rsqrtf(static_cast<float>(dk)) / sqrtf(qq + 1e-6f);  // q is scaled by dk^-0.5 too
        inv_norms[1] = 1.f / sqrtf(kk + 1e-6f);
      }
    }
    __syncthreads();
    const DeltaGates gate = gates(row);
    const float q_scale = inv_norms[0], k_scale = inv_norms[1];
    float predicted = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r < dk) {
        s[r] *= gate.decay;
        predicted += k_s[row0 + r] * k_scale * s[r];
      }
    }
#pragma unroll
    for (int offset = 1; offset < kSplit; offset <<= 1) predicted += __shfl_xor_sync(kFullMask, predicted, offset);
    const float v = column.valid ? to_float(qkv[2 * num_k_heads * dk + h * dv + j]) : 0.f;
    const float delta = (v - predicted) * gate.write;
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r < dk) {
        s[r] += k_s[row0 + r] * k_scale * delta;
        o += q_s[row0 + r] * q_scale * s[r];
      }
    }
#pragma unroll
    for (int offset = 1; offset < kSplit; offset <<= 1) o += __shfl_xor_sync(kFullMask, o, offset);
    emit(row, column, o);
  }
  column.store(head.own);
}

}  // namespace sparkd
