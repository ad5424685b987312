// What the gated delta net's kernels share (delta_net.cu: conv, gates, gated norm; delta_rule.cu
// and delta_rule_chunked.cu: the delta rule; delta_rule_decode.cu: gates, rule and norm in one).
// The numpy twin is sparkd/backend/cpu/gdn.py, whose docstring states the recurrence.
//
// Every kernel walks the step's sequences as the varlen attention does (Segments): sequence b
// owns rows [query_start[b], query_start[b + 1]) of T, has seq_lens[b] - its query length cached
// tokens before them, and its state at state_slots[b] of the pool (read only when it has cached
// tokens: a fresh sequence starts from zeros). Snapshots: rows [snapshot_start[b],
// snapshot_start[b + 1]) of snapshot_offsets / snapshot_slots, offsets ascending, ask for the
// state after the sequence's first `offset` new tokens to be copied to that slot as well.
#pragma once

#include "common.cuh"

namespace sparkd {

// A step's sequences as the kernels read them (the kernels take the six arrays as arguments).
struct Segments {
  const int* query_start;       // [B + 1]
  const int* seq_lens;          // [B]
  const int* state_slots;       // [B]
  const int* snapshot_start;    // [B + 1]
  const int* snapshot_offsets;  // [S]
  const int* snapshot_slots;    // [S]
};

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// ---- the gates and the gated RMSNorm, element by element (delta_net.cu's kernels and the
// fused decode tail, delta_rule_decode.cu, compute them alike) ----

// A token's decay gate g = -exp(a_log) * softplus(a + dt_bias), softplus as torch's (linear above 20).
__device__ __forceinline__ float decay_gate(float a, float dt_bias, float a_log) {
  const float shifted = a + dt_bias;
  const float softplus = shifted > 20.f ? shifted : log1pf(expf(shifted));
  return -expf(a_log) * softplus;
}

// A token's write strength beta = sigmoid(b).
__device__ __forceinline__ float write_gate(float b) { return 1.f / (1.f + expf(-b)); }

// 1 / rms of a group of `dim` values whose squares sum to sum_sq.
__device__ __forceinline__ float inv_rms(float sum_sq, int dim, float eps) {
  return 1.f / sqrtf(sum_sq / static_cast<float>(dim) + eps);
}

// One output of the gated RMSNorm, before its rounding to T: value (as T holds it) normed by
// inv_scale, times weight, times silu(gate), with transformers' roundings in T of the normed
// value and of its product with the weight.
template <typename T>
__device__ __forceinline__ float gated_norm(float value, float inv_scale, float weight, float gate) {
  const float normed = to_float(from_float<T>(value * inv_scale));
  const float weighted = to_float(from_float<T>(weight * normed));
  return weighted * silu(gate);
}

// A thread's share of one value head's recurrent state S [dk, dv]: rows [row0, row0 + kRows) of
// column j, in registers. valid is false for the threads past dv (they join the shuffles only).
template <int kRows>
struct StateColumn {
  float s[kRows];
  int row0, j, dk, dv;
  bool valid;

  __device__ __forceinline__ StateColumn(int row0_, int j_, int dk_, int dv_)
      : row0(row0_), j(j_), dk(dk_), dv(dv_), valid(j_ < dv_) {}

  // head: the head's [dk, dv] state in the pool (S: its storage type); zeros for a sequence with
  // no cached tokens.
  template <typename S>
  __device__ __forceinline__ void load(const S* head, bool cached) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      s[r] = (cached && valid && row0 + r < dk) ? to_float(head[(row0 + r) * dv + j]) : 0.f;
    }
  }

  template <typename S>
  __device__ __forceinline__ void store(S* head) const {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (valid && row0 + r < dk) head[(row0 + r) * dv + j] = from_float<S>(s[r]);
    }
  }
};

// Value head h's [dk, dv] state in pool slot `slot`.
template <typename S>
__device__ __forceinline__ S* head_state(S* state, int slot, int num_v_heads, int h, int dk, int dv) {
  return state + (static_cast<long long>(slot) * num_v_heads + h) * dk * dv;
}

// Sequence b's new rows [start, start + length) and value head h's state in its slot (own), for a
// delta-rule block; kh is the key head h reads.
template <typename S>
struct HeadSegment {
  int start, length, kh;
  bool cached;
  S* own;
};

template <typename S>
__device__ __forceinline__ HeadSegment<S> head_segment(const Segments& seg, S* state, int b, int h, int num_k_heads,
                                                       int num_v_heads, int dk, int dv) {
  const int start = seg.query_start[b], length = seg.query_start[b + 1] - start;
  return {start, length, h / (num_v_heads / num_k_heads), seg.seq_lens[b] > length,
          head_state(state, seg.state_slots[b], num_v_heads, h, dk, dv)};
}

// head_segment for the column's head, with the column loaded from its slot.
template <int kRows, typename S>
__device__ __forceinline__ HeadSegment<S> load_head(StateColumn<kRows>& column, const Segments& seg, S* state, int b,
                                                    int h, int num_k_heads, int num_v_heads) {
  const HeadSegment<S> head = head_segment(seg, state, b, h, num_k_heads, num_v_heads, column.dk, column.dv);
  column.load(head.own, head.cached);
  return head;
}

// Writes the column to every snapshot of sequence b taken after `t` of its new tokens, from
// snapshot row `next` on (the snapshot rows are by offset); returns the first row past them.
template <int kRows, typename S>
__device__ __forceinline__ int store_snapshots(const StateColumn<kRows>& column, const Segments& seg, int b, int t,
                                               int next, S* state, int num_v_heads, int h) {
  for (; next < seg.snapshot_start[b + 1] && seg.snapshot_offsets[next] == t; ++next) {
    column.store(head_state(state, seg.snapshot_slots[next], num_v_heads, h, column.dk, column.dv));
  }
  return next;
}

}  // namespace sparkd
