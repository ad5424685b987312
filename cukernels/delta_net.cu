// The gated delta net's other kernels (Qwen3-Next's linear-attention layers): the causal conv
// + SiLU, the decay and write gates, the gated RMSNorm and x * sigmoid(gate). The delta rule is
// in delta_rule.cu and delta_rule_chunked.cu; shared parts and the sequence layout in
// delta_net_common.cuh.
#include "delta_net_common.cuh"

using namespace sparkd;

// out [T, C] = silu(depthwise causal conv of x over each sequence's window and new tokens).
// x: [T, C] at row stride ld_x; weight: [C, W]; conv_state: [slots, C, W - 1] in S, left
// holding each sequence's last W - 1 inputs (and each snapshot's window).
// Launch: grid (ceil(C / blockDim.x), ceil(max query length / kConvTile), B): a thread per
// (channel, tile of kConvTile tokens), its window read from x (or, before the first new token,
// from the state). The first tile's blocks, the only ones that read the state, also write the
// snapshots' windows and the state's, from x and what they read.
constexpr int kConvTile = 64;

template <typename T, typename S, int kWidth>
__global__ void causal_conv1d_silu_kernel(T* __restrict__ out, const T* __restrict__ x, long long ld_x,
                                          const T* __restrict__ weight, S* __restrict__ conv_state,
                                          const int* query_start, const int* seq_lens, const int* state_slots,
                                          const int* snapshot_start, const int* snapshot_offsets,
                                          const int* snapshot_slots, int channels) {
  constexpr int kWindow = kWidth - 1;
  const Segments seg{query_start, seq_lens, state_slots, snapshot_start, snapshot_offsets, snapshot_slots};
  const int c = blockIdx.x * blockDim.x + threadIdx.x, tile = blockIdx.y, b = blockIdx.z;
  const int start = seg.query_start[b], length = seg.query_start[b + 1] - start, t0 = tile * kConvTile;
  if (c >= channels || (tile > 0 && t0 >= length)) return;
  const bool cached = seg.seq_lens[b] > length;
  S* own = conv_state + (static_cast<long long>(seg.state_slots[b]) * channels + c) * kWindow;
  float w[kWidth], initial[kWindow];
#pragma unroll
  for (int j = 0; j < kWidth; ++j) w[j] = to_float(weight[c * kWidth + j]);
#pragma unroll
  for (int j = 0; j < kWindow; ++j) initial[j] = tile == 0 && cached ? to_float(own[j]) : 0.f;
  // The input at new-token offset t >= -kWindow (below 0: the cached window).
  auto input = [&](int t) {
    float value = 0.f;
#pragma unroll
    for (int j = 0; j < kWindow; ++j) value = t == j - kWindow ? initial[j] : value;
    return t >= 0 ? to_float(x[(start + t) * ld_x + c]) : value;
  };
  float window[kWindow];
#pragma unroll
  for (int j = 0; j < kWindow; ++j) window[j] = input(t0 - kWindow + j);
  const int end = min(length, t0 + kConvTile);
  for (int t = t0; t < end; ++t) {
    const float in = to_float(x[(start + t) * ld_x + c]);
    float acc = w[kWindow] * in;
#pragma unroll
    for (int j = 0; j < kWindow; ++j) acc += w[j] * window[j];
    out[static_cast<long long>(start + t) * channels + c] = from_float<T>(silu(acc));
#pragma unroll
    for (int j = 0; j + 1 < kWindow; ++j) window[j] = window[j + 1];
    window[kWindow - 1] = in;
  }
  if (tile > 0) return;
  for (int next = seg.snapshot_start[b]; next < seg.snapshot_start[b + 1]; ++next) {
    S* snap = conv_state + (static_cast<long long>(seg.snapshot_slots[next]) * channels + c) * kWindow;
    const int t = seg.snapshot_offsets[next];
#pragma unroll
    for (int j = 0; j < kWindow; ++j) snap[j] = from_float<S>(input(t - kWindow + j));
  }
  float last[kWindow];
#pragma unroll
  for (int j = 0; j < kWindow; ++j) last[j] = input(length - kWindow + j);
#pragma unroll
  for (int j = 0; j < kWindow; ++j) own[j] = from_float<S>(last[j]);
}

// g = -exp(a_log) * softplus(a + dt_bias), beta = sigmoid(b): a, b [T, Hv] at row stride ld,
// a_log, dt_bias [Hv] -> g, beta [T, Hv] float. softplus as torch's (linear above 20).
// Launch: a 1-D grid over the T * Hv elements.
template <typename T>
__global__ void delta_net_gates_kernel(float* __restrict__ g, float* __restrict__ beta, const T* __restrict__ a,
                                       const T* __restrict__ b, long long ld, const T* __restrict__ a_log,
                                       const T* __restrict__ dt_bias, int tokens, int heads) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<long long>(tokens) * heads) return;
  const long long t = i / heads;
  const int h = static_cast<int>(i % heads);
  const float shifted = to_float(a[t * ld + h]) + to_float(dt_bias[h]);
  const float softplus = shifted > 20.f ? shifted : log1pf(expf(shifted));
  g[i] = -expf(to_float(a_log[h])) * softplus;
  beta[i] = 1.f / (1.f + expf(-to_float(b[t * ld + h])));
}

// out [T, N] = rmsnorm(x) * weight * silu(z) over each group of D = dim columns, with
// transformers' roundings in T: the normed x, then its product with weight, then the output.
// x: [T, N] contiguous; z: [T, N] at row stride ld_z; weight: [D].
// Launch: one warp per (token, group): blockDim 256, grid ceil(T * N / D / 8).
template <typename T>
__global__ void gated_rmsnorm_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ z,
                                     long long ld_z, const T* __restrict__ weight, int tokens, int width, int dim,
                                     float eps) {
  const int lane = threadIdx.x & 31;
  const long long group = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) / 32;
  const int groups_per_row = width / dim;
  if (group >= static_cast<long long>(tokens) * groups_per_row) return;
  const long long t = group / groups_per_row;
  const int col0 = static_cast<int>(group % groups_per_row) * dim;
  const T* row = x + t * width + col0;
  float sum_sq = 0.f;
  for (int i = lane; i < dim; i += 32) sum_sq += to_float(row[i]) * to_float(row[i]);
  const float inv_rms = 1.f / sqrtf(warp_reduce(sum_sq, SumOp()) / static_cast<float>(dim) + eps);
  for (int i = lane; i < dim; i += 32) {
    const float normed = to_float(from_float<T>(to_float(row[i]) * inv_rms));
    const float weighted = to_float(from_float<T>(to_float(weight[i]) * normed));
    out[t * width + col0 + i] = from_float<T>(weighted * silu(to_float(z[t * ld_z + col0 + i])));
  }
}

// out [T, N] = x * sigmoid(gate) (+ add_to [T, N], contiguous, when not null: the product rounded
// to T first, as two launches would): x [T, N] at row stride ld_x, gate [T, N] (gate_cols N) or
// [T, 1] (gate_cols 1) at row stride ld_gate. Launch: a 1-D grid over the T * N elements.
template <typename T>
__global__ void mul_sigmoid_kernel(T* __restrict__ out, const T* __restrict__ x, long long ld_x,
                                   const T* __restrict__ gate, long long ld_gate, const T* __restrict__ add_to,
                                   int gate_cols, int tokens, int width) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<long long>(tokens) * width) return;
  const long long t = i / width;
  const int col = static_cast<int>(i % width);
  const float gv = to_float(gate[t * ld_gate + (gate_cols == 1 ? 0 : col)]);
  const float sig = to_float(from_float<T>(1.f / (1.f + expf(-gv))));  // transformers rounds the sigmoid to T
  const T product = from_float<T>(to_float(x[t * ld_x + col]) * sig);
  out[i] = add_to == nullptr ? product : from_float<T>(to_float(add_to[i]) + to_float(product));
}
