// The gated delta net's decode tail in one launch: the gates, the token-by-token delta rule and
// the gated RMSNorm by z, otherwise three (delta_net.cu's gates and gated norm around
// delta_rule.cu's rule); at a batch-1 decode step each launch's ramp and drain cost more than its
// work. The token loop: delta_rule_recurrent.cuh; the cluster's reduction: cluster.cuh.
#include "cluster.cuh"
#include "delta_rule_recurrent.cuh"

using namespace sparkd;

constexpr int kDecodeWarps = kDeltaThreads / 32;

// out [T, Hv dv] = the gated RMSNorm by z of o, the delta rule over each sequence (as
// gated_delta_rule_kernel's) with g = decay_gate(a, dt_bias, a_log) and beta = write_gate(b)
// computed by each block for its head, in float as delta_net_gates_kernel computes them.
// mixed_qkv: [T, 2 Hk dk + Hv dv] at row stride ld_qkv; a, b: [T, Hv] at row stride ld_ab;
// a_log, dt_bias: [Hv]; z: [T, Hv dv] at row stride ld_z; norm_weight: [dv] (a group of the norm
// is a head); state: [slots, Hv, dk, dv] in S. o is rounded to T before the norm and the norm
// rounds as gated_rmsnorm_kernel does, so the output is the three launches' but for the order in
// which the sum of squares is added up.
// Launch: recurrent_delta_rule's grid (Hv, B, nz = ceil(dv / columns)) as clusters of (1, 1, nz)
// blocks, nz <= 8: a (sequence, head)'s nz blocks hold its dv outputs between them and add up
// their squares through distributed shared memory, a cluster barrier a token.
template <typename T, typename S, int kMaxDk>
__global__ void __launch_bounds__(kDeltaThreads)
    gated_delta_net_decode_kernel(T* __restrict__ out, const T* __restrict__ mixed_qkv, long long ld_qkv,
                                  const T* __restrict__ a, const T* __restrict__ b, long long ld_ab,
                                  const T* __restrict__ a_log, const T* __restrict__ dt_bias,
                                  const T* __restrict__ z, long long ld_z, const T* __restrict__ norm_weight,
                                  float eps, S* __restrict__ state, const int* query_start, const int* seq_lens,
                                  const int* state_slots, const int* snapshot_start, const int* snapshot_offsets,
                                  const int* snapshot_slots, int num_k_heads, int num_v_heads, int dk, int dv) {
  // Each warp's sum of squares, by token parity: a block may write the next token's while another
  // block still reads this one's; the next token's barrier keeps the one after from overwriting it.
  __shared__ float partial_sums[2][kDecodeWarps];
  const Segments seg{query_start, seq_lens, state_slots, snapshot_start, snapshot_offsets, snapshot_slots};
  const int h = blockIdx.x;
  const float head_a_log = to_float(a_log[h]), head_dt_bias = to_float(dt_bias[h]);
  int parity = 0;
  recurrent_delta_rule<T, S, kMaxDk>(
      mixed_qkv, ld_qkv, state, seg, num_k_heads, num_v_heads, dk, dv,
      [&](long long row) {
        const float g = decay_gate(to_float(a[row * ld_ab + h]), head_dt_bias, head_a_log);
        return DeltaGates{expf(g), write_gate(to_float(b[row * ld_ab + h]))};
      },
      [&](long long row, const DeltaColumn<kMaxDk>& column, float o) {
        const bool writes = column.valid && column.row0 == 0;  // a thread a column
        const float gate = column.valid ? to_float(z[row * ld_z + h * dv + column.j]) : 0.f;
        const float weight = column.valid ? to_float(norm_weight[column.j]) : 0.f;
        const float value = to_float(from_float<T>(o));  // o as the rule's launch would store it
        const float sum_sq = cluster_sum(writes ? value * value : 0.f, partial_sums[parity]);
        parity ^= 1;
        if (writes) {
          out[row * num_v_heads * dv + h * dv + column.j] =
              from_float<T>(gated_norm<T>(value, inv_rms(sum_sq, dv, eps), weight, gate));
        }
      });
  cluster_barrier();  // no block may leave while another can still read its partial sums
}
