// The gated delta rule over each sequence of a step token by token (decode), on the CUDA cores;
// the chunked form for prefill is delta_rule_chunked.cu, the decode tail with the gates and the
// gated norm fused in delta_rule_decode.cu. The token loop: delta_rule_recurrent.cuh; shared
// parts and the sequence layout: delta_net_common.cuh.
#include "delta_rule_recurrent.cuh"

using namespace sparkd;

// o [T, Hv dv] = the gated delta rule over each sequence. mixed_qkv: [T, 2 Hk dk + Hv dv] =
// [q | k | v] at row stride ld_qkv; g, beta [T, Hv] float; state [slots, Hv, dk, dv] in S (float,
// bf16 or fp16; computed in float, rounded to S where stored).
// Launch: recurrent_delta_rule's (delta_rule_recurrent.cuh).
template <typename T, typename S, int kMaxDk>
__global__ void __launch_bounds__(kDeltaThreads)
    gated_delta_rule_kernel(T* __restrict__ out, const T* __restrict__ mixed_qkv, long long ld_qkv,
                            const float* __restrict__ g, const float* __restrict__ beta, S* __restrict__ state,
                            const int* query_start, const int* seq_lens, const int* state_slots,
                            const int* snapshot_start, const int* snapshot_offsets, const int* snapshot_slots,
                            int num_k_heads, int num_v_heads, int dk, int dv) {
  const Segments seg{query_start, seq_lens, state_slots, snapshot_start, snapshot_offsets, snapshot_slots};
  const int h = blockIdx.x;
  recurrent_delta_rule<T, S, kMaxDk>(
      mixed_qkv, ld_qkv, state, seg, num_k_heads, num_v_heads, dk, dv,
      [&](long long row) { return DeltaGates{expf(g[row * num_v_heads + h]), beta[row * num_v_heads + h]}; },
      [&](long long row, const DeltaColumn<kMaxDk>& column, float o) {
        if (column.valid && column.row0 == 0) out[row * num_v_heads * dv + h * dv + column.j] = from_float<T>(o);
      });
}
