// The gated delta net's other kernels (Qwen3-Next's linear-attention layers): the causal conv
// + SiLU, the decay and write gates, the gated RMSNorm and x * sigmoid(gate). The delta rule is
// in delta_rule.cu and delta_rule_chunked.cu; shared parts and the sequence layout in
// delta_net_common.cuh.
#include "delta_net_common.cuh"

using namespace sparkd;

// out [T, C] = silu(depthwise causal conv of x over each sequence's window and new tokens).
// x: [T, C] at row stride ld_x; weight: [C, W]; conv_state: [slots, C, W - 1] in S, left
// holding each sequence's last W - 1 inputs (and each snapshot's window).
// Launch: grid (ceil(C / (kVec blockDim.x)), ceil(max query length / kConvTile), B): a thread per
// (kVec channels, tile of kConvTile tokens), its window read from x (or, before the first new
// token, from the state). kVec 4 (one 8- or 16-byte access a token) needs C and ld_x multiples
// of 4 and x and out so aligned; else kVec 1. The first tile's blocks, the only ones that read the
// state, also write the snapshots' windows and the state's, from x and what they read.
constexpr int kConvTile = 64;

template <typename T, typename S, int kWidth, int kVec>
__global__ void causal_conv1d_silu_kernel(T* __restrict__ out, const T* __restrict__ x, long long ld_x,
                                          const T* __restrict__ weight, S* __restrict__ conv_state,
                                          const int* query_start, const int* seq_lens, const int* state_slots,
                                          const int* snapshot_start, const int* snapshot_offsets,
                                          const int* snapshot_slots, int channels) {
  constexpr int kWindow = kWidth - 1;
  const Segments seg{query_start, seq_lens, state_slots, snapshot_start, snapshot_offsets, snapshot_slots};
  const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * kVec, tile = blockIdx.y, b = blockIdx.z;
  const int start = seg.query_start[b], length = seg.query_start[b + 1] - start, t0 = tile * kConvTile;
  if (c0 >= channels || (tile > 0 && t0 >= length)) return;
  const bool cached = seg.seq_lens[b] > length;
  S* own = conv_state + (static_cast<long long>(seg.state_slots[b]) * channels + c0) * kWindow;
  float w[kVec][kWidth];
#pragma unroll
  for (int v = 0; v < kVec; ++v) {
#pragma unroll
    for (int j = 0; j < kWidth; ++j) w[v][j] = to_float(weight[(c0 + v) * kWidth + j]);
  }
  // Channel c0 + v's input at new-token offset t >= -kWindow (below 0: the cached window, read
  // from the state where needed rather than held in registers across the token loop).
  auto input = [&](int t, int v) {
    if (t >= 0) return to_float(x[(start + t) * ld_x + c0 + v]);
    return tile == 0 && cached ? to_float(own[v * kWindow + t + kWindow]) : 0.f;
  };
  float window[kVec][kWindow];
#pragma unroll
  for (int v = 0; v < kVec; ++v) {
#pragma unroll
    for (int j = 0; j < kWindow; ++j) window[v][j] = input(t0 - kWindow + j, v);
  }
  const int end = min(length, t0 + kConvTile);
  // kAhead tokens' loads are issued before any of their math: the SiLU's division has a slow-path
  // branch, across which the compiler does not hoist the next token's load. They stay packed until
  // used, so that the registers leave room for 3 blocks an SM (24 warps, not 16: more loads in flight).
  constexpr int kAhead = 8;
  for (int base = t0; base < end; base += kAhead) {
    Pack<T, kVec> in[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      if (base + u < end) in[u] = *reinterpret_cast<const Pack<T, kVec>*>(x + (start + base + u) * ld_x + c0);
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      if (base + u >= end) break;
      float result[kVec];
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        const float value = to_float(in[u].v[v]);
        float acc = w[v][kWindow] * value;
#pragma unroll
        for (int j = 0; j < kWindow; ++j) acc += w[v][j] * window[v][j];
        result[v] = silu(acc);
#pragma unroll
        for (int j = 0; j + 1 < kWindow; ++j) window[v][j] = window[v][j + 1];
        window[v][kWindow - 1] = value;
      }
      store_floats<kVec>(out + static_cast<long long>(start + base + u) * channels + c0, result);
    }
  }
  if (tile > 0) return;
  for (int next = seg.snapshot_start[b]; next < seg.snapshot_start[b + 1]; ++next) {
    S* snap = conv_state + (static_cast<long long>(seg.snapshot_slots[next]) * channels + c0) * kWindow;
    const int t = seg.snapshot_offsets[next];
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
#pragma unroll
      for (int j = 0; j < kWindow; ++j) snap[v * kWindow + j] = from_float<S>(input(t - kWindow + j, v));
    }
  }
  float last[kVec][kWindow];
#pragma unroll
  for (int v = 0; v < kVec; ++v) {
#pragma unroll
    for (int j = 0; j < kWindow; ++j) last[v][j] = input(length - kWindow + j, v);
  }
#pragma unroll
  for (int v = 0; v < kVec; ++v) {
#pragma unroll
    for (int j = 0; j < kWindow; ++j) own[v * kWindow + j] = from_float<S>(last[v][j]);
  }
}

// g = -exp(a_log) * softplus(a + dt_bias), beta = sigmoid(b) (decay_gate, write_gate): a, b [T, Hv]
// at row stride ld, a_log, dt_bias [Hv] -> g, beta [T, Hv] float.
// Launch: a 1-D grid over the T * Hv elements.
template <typename T>
__global__ void delta_net_gates_kernel(float* __restrict__ g, float* __restrict__ beta, const T* __restrict__ a,
                                       const T* __restrict__ b, long long ld, const T* __restrict__ a_log,
                                       const T* __restrict__ dt_bias, int tokens, int heads) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<long long>(tokens) * heads) return;
  const long long t = i / heads;
  const int h = static_cast<int>(i % heads);
  g[i] = decay_gate(to_float(a[t * ld + h]), to_float(dt_bias[h]), to_float(a_log[h]));
  beta[i] = write_gate(to_float(b[t * ld + h]));
}

// out [T, N] = rmsnorm(x) * weight * silu(z) over each group of D = dim columns, with
// transformers' roundings in T: the normed x, then its product with weight, then the output.
// x: [T, N] contiguous; z: [T, N] at row stride ld_z; weight: [D].
// Launch: blockDim 256, grid ceil(T * N / D / (8 * 32 / kLanes)): kLanes lanes a (token, group),
// each taking kVec consecutive columns an access. kVec 1: a warp a group. Else kVec is one 16-byte
// access (D and ld_z multiples of it and the pointers so aligned) and a half-warp takes a group:
// Qwen3-Next's 128 columns in one access a lane, x's and z's loads of two groups in flight a warp.
template <typename T, int kVec>
__global__ void gated_rmsnorm_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ z,
                                     long long ld_z, const T* __restrict__ weight, int tokens, int width, int dim,
                                     float eps) {
  constexpr int kLanes = kVec == 1 ? 32 : 16;
  const int lane = threadIdx.x % kLanes;
  const long long group = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) / kLanes;
  const int groups_per_row = width / dim;
  // A half-warp past the last group still joins its warp's shuffles; it loads and stores nothing.
  const bool valid = group < static_cast<long long>(tokens) * groups_per_row;
  if (kLanes == 32 && !valid) return;
  const long long t = valid ? group / groups_per_row : 0;
  const int col0 = valid ? static_cast<int>(group % groups_per_row) * dim : 0;
  const T* row = x + t * width + col0;
  const T* gate_row = z + t * ld_z + col0;
  const int first = valid ? kVec * lane : dim;
  // The lane's first kVec columns come with their gates and weights before the reduction: one round trip.
  float values[kVec] = {}, weights[kVec] = {}, gates[kVec] = {};
  if (first < dim) {
    load_floats<kVec>(row + first, values);
    load_floats<kVec>(weight + first, weights);
    load_floats<kVec>(gate_row + first, gates);
  }
  float sum_sq = 0.f;
#pragma unroll
  for (int v = 0; v < kVec; ++v) sum_sq += values[v] * values[v];
  for (int i = first + kLanes * kVec; i < dim; i += kLanes * kVec) {
    float more[kVec];
    load_floats<kVec>(row + i, more);
#pragma unroll
    for (int v = 0; v < kVec; ++v) sum_sq += more[v] * more[v];
  }
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) sum_sq += __shfl_xor_sync(kFullMask, sum_sq, offset);
  const float inv_scale = inv_rms(sum_sq, dim, eps);
  for (int i = first; i < dim; i += kLanes * kVec) {
    if (i > first) {
      load_floats<kVec>(row + i, values);
      load_floats<kVec>(weight + i, weights);
      load_floats<kVec>(gate_row + i, gates);
    }
    float result[kVec];
#pragma unroll
    for (int v = 0; v < kVec; ++v) result[v] = gated_norm<T>(values[v], inv_scale, weights[v], gates[v]);
    store_floats<kVec>(out + t * width + col0 + i, result);
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
