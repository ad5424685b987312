// The gated delta rule over each sequence of a step, in two forms, each one block per
// (sequence, value head) on the CUDA cores: token by token (decode) and the chunked WY form
// (prefill). Not yet run on a GPU. Shared parts and the sequence layout: delta_net_common.cuh.
#include "delta_net_common.cuh"

using namespace sparkd;

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
  const HeadSegment head = load_head(column, seg, state, b, h, num_k_heads, num_v_heads);
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
    const float v = column.valid ? to_float(qkv[2 * num_k_heads * dk + h * dv + j]) : 0.f;
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
    if (column.valid && row0 == 0) out[row * num_v_heads * dv + h * dv + j] = from_float<T>(o);
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
  const HeadSegment head = load_head(column, seg, state, b, h, num_k_heads, num_v_heads);
  const int kh = head.kh, start = head.start, length = head.length;
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
      const float inv = (i < n ? rsqrtf(static_cast<float>(dk)) : 1.f) / sqrtf(sum + 1e-6f);
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
      if (column.valid && row0 == 0) {
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
      if (column.valid && row0 + r < dk) {
        float acc = 0.f;
        for (int i = 0; i < n; ++i) acc += k_s[i * kLd + row0 + r] * norm_s[i] * u_s[i * kChunkDv + j];
        s[r] = chunk_decay * s[r] + acc;
      }
    }
    t0 += n;
  }
  column.store(head.own);
}
