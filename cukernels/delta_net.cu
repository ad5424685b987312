// The gated delta net's sequence mixing (Qwen3-Next's linear-attention layers): the numpy
// twin is sparkd/backend/cpu/gdn.py, whose docstring states the recurrence.
//
// Every kernel walks the step's sequences as the varlen attention does (Segments): sequence b
// owns rows [query_start[b], query_start[b + 1]) of T, has seq_lens[b] - its query length cached
// tokens before them, and its state at state_slots[b] of the pool (read only when it has cached
// tokens: a fresh sequence starts from zeros). Snapshots: rows [snapshot_start[b],
// snapshot_start[b + 1]) of snapshot_offsets / snapshot_slots, offsets ascending, ask for the
// state after the sequence's first `offset` new tokens to be copied to that slot as well.
//
// A first CUDA form, not yet run on a GPU: the delta rule token by token for decode, and in
// the chunked WY form for prefill, both one block per (sequence, value head) on the CUDA cores.
#include "common.cuh"

using namespace sparkd;

namespace {

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

// A thread's share of one value head's recurrent state S [dk, dv]: rows [row0, row0 + kRows) of
// column j, in registers. valid is false for the threads past dv (they join the shuffles only).
template <int kRows>
struct StateColumn {
  float s[kRows];
  int row0, j, dk, dv;
  bool valid;

  __device__ __forceinline__ StateColumn(int row0_, int j_, int dk_, int dv_)
      : row0(row0_), j(j_), dk(dk_), dv(dv_), valid(j_ < dv_) {}

  // head: the head's [dk, dv] state in the pool; zeros for a sequence with no cached tokens.
  __device__ __forceinline__ void load(const float* head, bool cached) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] = (cached && valid && row0 + r < dk) ? head[(row0 + r) * dv + j] : 0.f;
  }

  __device__ __forceinline__ void store(float* head) const {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (valid && row0 + r < dk) head[(row0 + r) * dv + j] = s[r];
    }
  }
};

// Value head h's [dk, dv] state in pool slot `slot`.
__device__ __forceinline__ float* head_state(float* state, int slot, int num_v_heads, int h, int dk, int dv) {
  return state + (static_cast<long long>(slot) * num_v_heads + h) * dk * dv;
}

// Sequence b's new rows [start, start + length) and value head h's state in its slot (own), for a
// delta-rule block; kh is the key head h reads.
struct HeadSegment {
  int start, length, kh;
  bool cached;
  float* own;
};

__device__ __forceinline__ HeadSegment head_segment(const Segments& seg, float* state, int b, int h, int num_k_heads,
                                                    int num_v_heads, int dk, int dv) {
  const int start = seg.query_start[b], length = seg.query_start[b + 1] - start;
  return {start, length, h / (num_v_heads / num_k_heads), seg.seq_lens[b] > length,
          head_state(state, seg.state_slots[b], num_v_heads, h, dk, dv)};
}

// Writes the column to every snapshot of sequence b taken after `t` of its new tokens, from
// snapshot row `next` on (the snapshot rows are by offset); returns the first row past them.
template <int kRows>
__device__ __forceinline__ int store_snapshots(const StateColumn<kRows>& column, const Segments& seg, int b, int t,
                                               int next, float* state, int num_v_heads, int h) {
  for (; next < seg.snapshot_start[b + 1] && seg.snapshot_offsets[next] == t; ++next) {
    column.store(head_state(state, seg.snapshot_slots[next], num_v_heads, h, column.dk, column.dv));
  }
  return next;
}

}  // namespace

// out [T, C] = silu(depthwise causal conv of x over each sequence's window and new tokens).
// x: [T, C] at row stride ld_x; weight: [C, W]; conv_state: [slots, C, W - 1] float, left
// holding each sequence's last W - 1 inputs (and each snapshot's window).
// Launch: grid (ceil(C / blockDim.x), B), one thread per channel walking its sequence's tokens.
template <typename T, int kWidth>
__global__ void causal_conv1d_silu_kernel(T* __restrict__ out, const T* __restrict__ x, long long ld_x,
                                          const T* __restrict__ weight, float* __restrict__ conv_state,
                                          const int* query_start, const int* seq_lens, const int* state_slots,
                                          const int* snapshot_start, const int* snapshot_offsets,
                                          const int* snapshot_slots, int channels) {
  constexpr int kWindow = kWidth - 1;
  const Segments seg{query_start, seq_lens, state_slots, snapshot_start, snapshot_offsets, snapshot_slots};
  const int c = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.y;
  if (c >= channels) return;
  const int start = seg.query_start[b], length = seg.query_start[b + 1] - start;
  const bool cached = seg.seq_lens[b] > length;
  float* own = conv_state + (static_cast<long long>(seg.state_slots[b]) * channels + c) * kWindow;
  float w[kWidth], window[kWindow];
#pragma unroll
  for (int j = 0; j < kWidth; ++j) w[j] = to_float(weight[c * kWidth + j]);
#pragma unroll
  for (int j = 0; j < kWindow; ++j) window[j] = cached ? own[j] : 0.f;
  int next = seg.snapshot_start[b];
  const int last = seg.snapshot_start[b + 1];
  for (int t = 0; t <= length; ++t) {
    for (; next < last && seg.snapshot_offsets[next] == t; ++next) {
      float* snap = conv_state + (static_cast<long long>(seg.snapshot_slots[next]) * channels + c) * kWindow;
#pragma unroll
      for (int j = 0; j < kWindow; ++j) snap[j] = window[j];
    }
    if (t == length) break;
    const float input = to_float(x[(start + t) * ld_x + c]);
    float acc = w[kWindow] * input;
#pragma unroll
    for (int j = 0; j < kWindow; ++j) acc += w[j] * window[j];
    out[static_cast<long long>(start + t) * channels + c] = from_float<T>(silu(acc));
#pragma unroll
    for (int j = 0; j + 1 < kWindow; ++j) window[j] = window[j + 1];
    window[kWindow - 1] = input;
  }
#pragma unroll
  for (int j = 0; j < kWindow; ++j) own[j] = window[j];
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

// o [T, Hv dv] = the gated delta rule over each sequence. mixed_qkv: [T, 2 Hk dk + Hv dv] =
// [q | k | v] at row stride ld_qkv; g, beta [T, Hv] float; state [slots, Hv, dk, dv] float.
// q and k are L2-normalised (eps 1e-6 inside the root, as flash-linear-attention), q scaled by
// dk^-0.5; value head h reads key head h / (Hv / Hk).
// Launch: grid (Hv, B, ceil(dv / columns)), blockDim.x = kSplit * columns <= kDeltaThreads, columns
// a multiple of 32 / kSplit: kSplit neighbouring threads own one column of the head's state,
// S[:, j], in registers, kMaxDk / kSplit rows each (dk <= kMaxDk), and meet by shuffles.
constexpr int kDeltaThreads = 128;

template <typename T, int kMaxDk>
__global__ void __launch_bounds__(kDeltaThreads)
    gated_delta_rule_kernel(T* __restrict__ out, const T* __restrict__ mixed_qkv, long long ld_qkv,
                            const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
                            const int* query_start, const int* seq_lens, const int* state_slots,
                            const int* snapshot_start, const int* snapshot_offsets, const int* snapshot_slots,
                            int num_k_heads, int num_v_heads, int dk, int dv) {
  constexpr int kSplit = kMaxDk > 64 ? kMaxDk / 64 : 1;  // 64 rows a thread keep the state in registers
  constexpr int kRows = kMaxDk / kSplit;
  __shared__ float q_s[kMaxDk], k_s[kMaxDk], inv_norms[2];
  const Segments seg{query_start, seq_lens, state_slots, snapshot_start, snapshot_offsets, snapshot_slots};
  const int h = blockIdx.x, b = blockIdx.y;
  StateColumn<kRows> column((threadIdx.x % kSplit) * kRows, blockIdx.z * (blockDim.x / kSplit) + threadIdx.x / kSplit,
                            dk, dv);
  float (&s)[kRows] = column.s;
  const int j = column.j, row0 = column.row0;
  const bool valid = column.valid;
  const HeadSegment head = head_segment(seg, state, b, h, num_k_heads, num_v_heads, dk, dv);
  const int kh = head.kh, start = head.start, length = head.length;
  column.load(head.own, head.cached);
  const float scale = rsqrtf(static_cast<float>(dk));
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
        inv_norms[0] = scale / sqrtf(qq + 1e-6f);
        inv_norms[1] = 1.f / sqrtf(kk + 1e-6f);
      }
    }
    __syncthreads();
    const float decay = expf(g[row * num_v_heads + h]), write = beta[row * num_v_heads + h];
    const float q_scale = inv_norms[0], k_scale = inv_norms[1];
    float predicted = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r < dk) {
        s[r] *= decay;
        predicted += k_s[row0 + r] * k_scale * s[r];
      }
    }
#pragma unroll
    for (int offset = 1; offset < kSplit; offset <<= 1) predicted += __shfl_xor_sync(kFullMask, predicted, offset);
    const float v = valid ? to_float(qkv[2 * num_k_heads * dk + h * dv + j]) : 0.f;
    const float delta = (v - predicted) * write;
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
    if (valid && row0 == 0) out[row * num_v_heads * dv + h * dv + j] = from_float<T>(o);
  }
  column.store(head.own);
}

// The same delta rule 64 tokens at a time in the WY form (backend/cpu/gdn.py's
// chunked_delta_rule states it), for prefill: per chunk, A = strictly_lower((beta k) k^T * D)
// and P = (q k^T) * D (D[i, j] = exp(G_i - G_j) for j <= i), U = (I + A)^-1 (beta v) and
// W = (I + A)^-1 (beta k exp(G)) by forward substitution (a thread per column), v' = U - W S,
// o = (q exp(G)) S + P v', S = exp(G_last) S + (k exp(G_last - G))^T v'. A sequence's chunks
// end at its snapshot points too, so that each snapshot is the state there.
// Arguments as gated_delta_rule_kernel. Launch: grid (Hv, B), blockDim.x = 2 * kChunkDv = 256;
// dk, dv <= kChunkDk = kChunkDv = 128; dynamic shared memory as the arrays below lay it out
// (q and k [kChunk][kChunkDk + 1], U [kChunk][kChunkDv], W [kChunk][kChunkDk], A and P
// [kChunk][kChunk + 1], three [kChunk]: the launcher's _CHUNK_SMEM_BYTES).
// Thread t owns rows [64 (t % 2), 64 (t % 2) + 64) of state column t / 2, in registers.
constexpr int kChunk = 64;
constexpr int kChunkDk = 128, kChunkDv = 128;

template <typename T>
__global__ void __launch_bounds__(2 * kChunkDv)
    chunked_delta_rule_kernel(T* __restrict__ out, const T* __restrict__ mixed_qkv, long long ld_qkv,
                              const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
                              const int* query_start, const int* seq_lens, const int* state_slots,
                              const int* snapshot_start, const int* snapshot_offsets, const int* snapshot_slots,
                              int num_k_heads, int num_v_heads, int dk, int dv) {
  extern __shared__ float smem[];
  constexpr int kLd = kChunkDk + 1;  // padded rows of q and k: column reads hit distinct banks
  float* q_s = smem;                           // [kChunk][kLd], normed, scaled
  float* k_s = q_s + kChunk * kLd;             // [kChunk][kLd], normed
  float* u_s = k_s + kChunk * kLd;             // [kChunk][kChunkDv]: beta v, then U, then v'
  float* w_s = u_s + kChunk * kChunkDv;        // [kChunk][kChunkDk]: beta k exp(G), then W
  float* a_s = w_s + kChunk * kChunkDk;        // [kChunk][kChunk + 1]
  float* p_s = a_s + kChunk * (kChunk + 1);    // [kChunk][kChunk + 1]
  float* cum_s = p_s + kChunk * (kChunk + 1);  // [kChunk] cumulative g
  float* beta_s = cum_s + kChunk;              // [kChunk]
  float* norm_s = beta_s + kChunk;             // [kChunk] scratch

  const Segments seg{query_start, seq_lens, state_slots, snapshot_start, snapshot_offsets, snapshot_slots};
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  constexpr int kRows = kChunkDk / 2;
  StateColumn<kRows> column((tid % 2) * kRows, tid / 2, dk, dv);
  float (&s)[kRows] = column.s;
  const int j = column.j, row0 = column.row0;
  const bool valid = column.valid;
  const HeadSegment head = head_segment(seg, state, b, h, num_k_heads, num_v_heads, dk, dv);
  const int kh = head.kh, start = head.start, length = head.length;
  column.load(head.own, head.cached);
  const float scale = rsqrtf(static_cast<float>(dk));
  int next = seg.snapshot_start[b];
  const int last_snapshot = seg.snapshot_start[b + 1];

  for (int t0 = 0; t0 <= length;) {
    next = store_snapshots(column, seg, b, t0, next, state, num_v_heads, h);
    if (t0 == length) break;
    // This chunk: up to kChunk tokens, ending early at the next snapshot point.
    int n = min(kChunk, length - t0);
    if (next < last_snapshot) n = min(n, seg.snapshot_offsets[next] - t0);
    const long long row_base = static_cast<long long>(start + t0);

    __syncthreads();  // the previous chunk's shared arrays are read
    for (int idx = tid; idx < n * dk; idx += blockDim.x) {
      const int i = idx / dk, k = idx % dk;
      const T* qkv = mixed_qkv + (row_base + i) * ld_qkv;
      q_s[i * kLd + k] = to_float(qkv[kh * dk + k]);
      k_s[i * kLd + k] = to_float(qkv[(num_k_heads + kh) * dk + k]);
    }
    for (int idx = tid; idx < n * dv; idx += blockDim.x) {
      const int i = idx / dv, c = idx % dv;
      u_s[i * kChunkDv + c] = to_float(mixed_qkv[(row_base + i) * ld_qkv + 2 * num_k_heads * dk + h * dv + c]);
    }
    if (tid < n) {
      beta_s[tid] = beta[(row_base + tid) * num_v_heads + h];
      cum_s[tid] = g[(row_base + tid) * num_v_heads + h];
    }
    __syncthreads();
    if (tid == 0) {  // the chunk's cumulative decay, summed in token order as numpy's cumsum
      for (int i = 1; i < n; ++i) cum_s[i] += cum_s[i - 1];
    }
    __syncthreads();
    // L2-normalise each row of q (and scale it) and of k: a warp per row.
    const int lane = tid & 31, warp = tid / 32, num_warps = blockDim.x / 32;
    for (int i = warp; i < 2 * n; i += num_warps) {
      float* row = (i < n ? q_s : k_s) + (i % n) * kLd;
      float sum = 0.f;
      for (int k = lane; k < dk; k += 32) sum += row[k] * row[k];
      sum = warp_reduce(sum, SumOp());
      const float inv = (i < n ? scale : 1.f) / sqrtf(sum + 1e-6f);
      for (int k = lane; k < dk; k += 32) row[k] *= inv;
    }
    __syncthreads();
    // A and P, and the right-hand sides beta v (in place) and beta k exp(G).
    for (int idx = tid; idx < n * n; idx += blockDim.x) {
      const int i = idx / n, l = idx % n;
      float kk = 0.f, qk = 0.f;
      if (l <= i) {
        for (int k = 0; k < dk; ++k) {
          kk += k_s[i * kLd + k] * k_s[l * kLd + k];
          qk += q_s[i * kLd + k] * k_s[l * kLd + k];
        }
      }
      const float decay = l <= i ? expf(cum_s[i] - cum_s[l]) : 0.f;
      a_s[i * (kChunk + 1) + l] = l < i ? beta_s[i] * kk * decay : 0.f;
      p_s[i * (kChunk + 1) + l] = qk * decay;
    }
    for (int idx = tid; idx < n * dk; idx += blockDim.x) {
      const int i = idx / dk, k = idx % dk;
      w_s[i * kChunkDk + k] = beta_s[i] * k_s[i * kLd + k] * expf(cum_s[i]);
    }
    for (int idx = tid; idx < n * dv; idx += blockDim.x) u_s[(idx / dv) * kChunkDv + idx % dv] *= beta_s[idx / dv];
    __syncthreads();
    // Forward substitution, a thread per column: columns < dv of U, then dk of W.
    if (tid < dv + dk) {
      float* x = tid < dv ? u_s + tid : w_s + (tid - dv);
      const int ld = tid < dv ? kChunkDv : kChunkDk;
      for (int i = 1; i < n; ++i) {
        float acc = x[i * ld];
        for (int l = 0; l < i; ++l) acc -= a_s[i * (kChunk + 1) + l] * x[l * ld];
        x[i * ld] = acc;
      }
    }
    __syncthreads();
    // Row by row: v' = U - W S (in place of U), then o = (q exp(G)) S + P v'. Column j's v' rows
    // are written and read by the same thread (row0 == 0), so the rows need no barrier.
    for (int i = 0; i < n; ++i) {
      float ws = 0.f, qs = 0.f;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (row0 + r < dk) {
          ws += w_s[i * kChunkDk + row0 + r] * s[r];
          qs += q_s[i * kLd + row0 + r] * s[r];
        }
      }
      ws += __shfl_xor_sync(kFullMask, ws, 1);
      qs += __shfl_xor_sync(kFullMask, qs, 1);
      if (valid && row0 == 0) {
        u_s[i * kChunkDv + j] -= ws;
        float o = qs * expf(cum_s[i]);
        for (int l = 0; l <= i; ++l) o += p_s[i * (kChunk + 1) + l] * u_s[l * kChunkDv + j];
        out[(row_base + i) * num_v_heads * dv + h * dv + j] = from_float<T>(o);
      }
    }
    // Then S = exp(G_last) S + (k exp(G_last - G))^T v'.
    const float last = cum_s[n - 1];
    if (tid < n) norm_s[tid] = expf(last - cum_s[tid]);
    __syncthreads();
    const float chunk_decay = expf(last);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (valid && row0 + r < dk) {
        float acc = 0.f;
        for (int i = 0; i < n; ++i) acc += k_s[i * kLd + row0 + r] * norm_s[i] * u_s[i * kChunkDv + j];
        s[r] = chunk_decay * s[r] + acc;
      }
    }
    t0 += n;
  }
  column.store(head.own);
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

// out [T, N] = x * sigmoid(gate): x [T, N] at row stride ld_x, gate [T, N] (gate_cols N) or
// [T, 1] (gate_cols 1) at row stride ld_gate. Launch: a 1-D grid over the T * N elements.
template <typename T>
__global__ void mul_sigmoid_kernel(T* __restrict__ out, const T* __restrict__ x, long long ld_x,
                                   const T* __restrict__ gate, long long ld_gate, int gate_cols, int tokens,
                                   int width) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<long long>(tokens) * width) return;
  const long long t = i / width;
  const int col = static_cast<int>(i % width);
  const float gv = to_float(gate[t * ld_gate + (gate_cols == 1 ? 0 : col)]);
  const float sig = to_float(from_float<T>(1.f / (1.f + expf(-gv))));  // transformers rounds the sigmoid to T
  out[i] = from_float<T>(to_float(x[t * ld_x + col]) * sig);
}
