// The gated delta rule over each sequence of a step in the chunked WY form (prefill), in two
// kernels: every 64-token chunk of every sequence and value head is prepared at once
// (delta_chunk_prepare_kernel), then one block per (sequence, value head, 32 state columns)
// carries the state across its sequence's chunks (delta_chunk_state_kernel). Only the second
// walks the chunks in order, and it holds no triangular solve. backend/cpu/gdn.py's
// chunked_delta_rule states the form; delta_rule.cu has the token-by-token form.
//
// Per chunk of n <= 64 tokens, with G the chunk's inclusive cumsum of g and D[i, l] =
// exp(G_i - G_l) for l <= i:
//   A = strictly_lower((beta k) k^T * D), P = lower((q k^T) * D),
//   U = (I + A)^-1 (beta v), W = (I + A)^-1 (beta k exp(G))            (prepare)
//   v' = U - W S, o = (q exp(G)) S + P v',
//   S <- exp(G_last) S + (k exp(G_last - G))^T v'                       (state)
// v' is causal (row i reads rows <= i), so the state after any prefix of the chunk, a
// snapshot's, is the last line with the prefix's rows.
//
// The workspace between the two (float32, rows are the step's T token rows): W [T, Hv, dk],
// U [T, Hv, dv], P [T, Hv, 64] (row i of its chunk's P), then G, the q scale (dk^-0.5 over
// |q|) and the k scale (1 / |k|), each [T, Hv]: T Hv (dk + dv + 67) floats
// (kernels/delta_net.py's chunk_workspace_floats).
#include "delta_chunk_rows.cuh"

using namespace sparkd;
using attn::cp_async_commit;
using attn::cp_async_wait;

constexpr int kChunkD = 128;  // dk and dv at most
constexpr int kPrepareThreads = 2 * kChunkD;
constexpr int kStateCols = 32, kStateWarps = 16, kStateThreads = 32 * kStateWarps;

struct ChunkWorkspace {
  float *w, *u, *p, *cum, *q_scale, *k_scale;

  __device__ __forceinline__ ChunkWorkspace(float* base, int tokens, int num_v_heads, int dk, int dv) {
    const long long rows = static_cast<long long>(tokens) * num_v_heads;
    w = base;
    u = w + rows * dk;
    p = u + rows * dv;
    cum = p + rows * kChunk;
    q_scale = cum + rows;
    k_scale = q_scale + rows;
  }
};

// The chunk's q (then normalised and scaled), k (normalised), beta v and beta k exp(G), and A.
// Grid (ceil(max query length / 64), Hv, B), kPrepareThreads threads; dynamic shared memory:
// q (then A [kChunk][kChunk + 4]) and k [kChunk][kChunkD + 4], v [kChunk][kChunkD], G and beta
// and exp(G) [kChunk] (the launcher's _PREPARE_SMEM_BYTES): two blocks fit an SM. W and P, which
// the state kernel reads only as product operands, are stored as it rounds them (keep_tf32).
template <typename T>
__global__ void __launch_bounds__(kPrepareThreads)
    delta_chunk_prepare_kernel(float* __restrict__ workspace, const T* __restrict__ mixed_qkv, long long ld_qkv,
                               const float* __restrict__ g, const float* __restrict__ beta,
                               const int* __restrict__ query_start, int tokens, int num_k_heads, int num_v_heads,
                               int dk, int dv) {
  extern __shared__ float smem[];
  // Rows padded to 4 mod 32 floats: conflict-free mma fragments (mma_tf32.cuh), and the
  // substitution reads 4 entries of a row of A at once (float4).
  constexpr int kLd = kChunkD + 4;
  constexpr int kLdA = kChunk + 4;
  float* q_s = smem;  // then A, once q is read
  float* k_s = q_s + kChunk * kLd;
  float* v_s = k_s + kChunk * kLd;
  float* cum_s = v_s + kChunk * kChunkD;
  float* beta_s = cum_s + kChunk;
  float* exp_cum_s = beta_s + kChunk;
  float* a_s = q_s;
  constexpr int kTerms = sizeof(T) == sizeof(float) ? 3 : 1;  // as the state kernel's products

  const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int start = query_start[b], t0 = blockIdx.x * kChunk, length = query_start[b + 1] - start;
  if (t0 >= length) return;
  const int n = min(kChunk, length - t0), kh = h / (num_v_heads / num_k_heads);
  const long long row0 = static_cast<long long>(start) + t0;
  const ChunkWorkspace ws(workspace, tokens, num_v_heads, dk, dv);

  // Rows past n are zeros, so A, U and W are zero there and the solve needs no bound.
  const T* qkv = mixed_qkv + row0 * ld_qkv;
  ChunkRows<kChunkD, kPrepareThreads, T> q_rows, k_rows, v_rows;
  q_rows.load(qkv + kh * dk, ld_qkv, n, dk);
  k_rows.load(qkv + (num_k_heads + kh) * dk, ld_qkv, n, dk);
  v_rows.load(qkv + 2 * num_k_heads * dk + h * dv, ld_qkv, n, dv);
  if (tid < kChunk) {
    beta_s[tid] = tid < n ? beta[(row0 + tid) * num_v_heads + h] : 0.f;
    cum_s[tid] = tid < n ? g[(row0 + tid) * num_v_heads + h] : 0.f;
  }
  q_rows.store(q_s, kLd);
  k_rows.store(k_s, kLd);
  v_rows.store(v_s, kChunkD);
  __syncthreads();
  if (tid == 0) {  // summed in token order, as numpy's cumsum
    for (int i = 1; i < kChunk; ++i) cum_s[i] += cum_s[i - 1];
  }
  // L2-normalise each row of q (and scale it by dk^-0.5) and of k: a warp per row.
  const int lane = tid & 31, warp = tid / 32, num_warps = blockDim.x / 32;
  for (int i = warp; i < 2 * n; i += num_warps) {
    const bool is_q = i < n;
    float* row = (is_q ? q_s : k_s) + (i % n) * kLd;
    float sum = 0.f;
    for (int c = lane; c < dk; c += 32) sum += row[c] * row[c];
    sum = warp_reduce(sum, SumOp());
    const float scale = (is_q ? rsqrtf(static_cast<float>(dk)) : 1.f) / sqrtf(sum + 1e-6f);
    for (int c = lane; c < dk; c += 32) row[c] *= scale;
    if (lane == 0) (is_q ? ws.q_scale : ws.k_scale)[(row0 + i % n) * num_v_heads + h] = scale;
  }
  __syncthreads();
  if (tid < n) ws.cum[(row0 + tid) * num_v_heads + h] = cum_s[tid];
  if (tid < kChunk) exp_cum_s[tid] = expf(cum_s[tid]);
  // A and P from k k^T and q k^T on the tensor cores (as the state kernel: 3xTF32 in fp32
  // models). Warp w takes the 16 rows 16 (w / 2) against the 32 columns 32 (w % 2) of both;
  // its tiles wholly above the diagonal are zeros. A then takes q's place.
  {
    const int g = (tid & 31) >> 2, t = tid & 3, m0 = 16 * (warp / 2), n_first = 32 * (warp % 2);
    float kk[4][4] = {}, qk[4][4] = {};
    for (int k0 = 0; k0 < dk; k0 += 8) {
      float a_k[4], a_q[4];
      load_a_rows(a_k, k_s, kLd, m0, k0);
      load_a_rows(a_q, q_s, kLd, m0, k0);
      const auto k_frag = to_tf32<kTerms>(a_k), q_frag = to_tf32<kTerms>(a_q);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n0 = n_first + 8 * j;
        if (n0 > m0 + 15) break;  // warp-uniform: this tile and the next are above the diagonal
        float b[2];
        load_b_transposed(b, k_s, kLd, k0, n0);
        const auto b_frag = to_tf32<kTerms>(b);
        mma_tf32(kk[j], k_frag, b_frag);
        mma_tf32(qk[j], q_frag, b_frag);
      }
    }
    __syncthreads();  // q is read
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = m0 + g + 8 * (e / 2), l = n_first + 8 * j + 2 * t + e % 2;
        const float decay = l <= i ? expf(cum_s[i] - cum_s[l]) : 0.f;
        a_s[i * kLdA + l] = l < i ? beta_s[i] * kk[j][e] * decay : 0.f;
        if (i < n) ws.p[((row0 + i) * num_v_heads + h) * kChunk + l] = keep_tf32<kTerms>(qk[j][e] * decay);
      }
    }
  }
  __syncthreads();
  // Forward substitution, a thread per right-hand column (tid < kChunkD: U's column tid, of
  // beta v; else W's column tid - kChunkD, of beta k exp(G)), the column in registers; two
  // partial sums halve the dependent chain. A row of A is read 4 entries a load (a broadcast):
  // the entries past the diagonal are zeros, so the sums are those of l < i exactly.
  const bool is_u = tid < kChunkD;
  const int col = is_u ? tid : tid - kChunkD;
  if (col >= (is_u ? dv : dk)) return;
  float x[kChunk];
#pragma unroll
  for (int i = 0; i < kChunk; ++i) x[i] = beta_s[i] * (is_u ? v_s[i * kChunkD + col] : k_s[i * kLd + col] * exp_cum_s[i]);
#pragma unroll
  for (int i = 1; i < kChunk; ++i) {
    float even = x[i], odd = 0.f;
#pragma unroll
    for (int l = 0; l < i; l += 4) {
      const float4 a = *reinterpret_cast<const float4*>(a_s + i * kLdA + l);
      even -= a.x * x[l];
      odd -= a.y * x[l + 1];
      even -= a.z * x[l + 2];
      odd -= a.w * x[l + 3];
    }
    x[i] = even + odd;
  }
  float* dst = is_u ? ws.u + h * dv + col : ws.w + h * dk + col;
  const long long ld = static_cast<long long>(num_v_heads) * (is_u ? dv : dk);
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    if (i < n) dst[(row0 + i) * ld] = is_u ? x[i] : keep_tf32<kTerms>(x[i]);
  }
}

// The state's columns [j0, j0 + 32) in shared memory, walked over the sequence's chunks, with
// the chunk products on the tensor cores (mma_tf32.cuh: 3xTF32 for fp32 models, whose parity is
// fp32's; one tf32 product for bf16 / fp16 ones, whose inputs carry 2^-8 already). Warp w of 16
// computes the 16 x 8 tile (rows 16 (w / 4), columns 8 (w % 4)) of v' and o, and two tiles of
// the state update (rows 16 (w / 4) and 64 + 16 (w / 4), the same columns). Grid (Hv, B,
// ceil(dv / 32)), kStateThreads threads; dk and dv multiples of 4; dynamic shared memory
// (_STATE_SMEM_BYTES), rows padded for conflict-free fragment loads: S [kChunkD][kLdS],
// W and q [kChunk][kLdW], k [kChunk][kLdK], P [kChunk][kLdP], U then v' [kChunk][kLdS], then G,
// the decays and k's scales [kChunk]. Rows of S past dk, and columns of W, q, k past dk, are zeros.
// W, q, k and P are read only as product operands, so they are held as the products round them
// (keep_tf32: rounded once, not at every fragment load); S and v' are kept whole.
constexpr int kLdS = kStateCols + 8, kLdW = kChunkD + 4, kLdK = kChunkD + 8, kLdP = kChunk + 4;

template <int kTerms>
struct ChunkState {
  float *s, *w, *q, *k, *p, *v, *cum, *decay;
  int warp, dk;

  // The state after the chunk's first `count` tokens into dst (row stride ld, `cols` of the
  // block's 32 columns; dst may be s itself, or a slot in the pool's type D): needs decay[i] =
  // exp(G_{count-1} - G_i) / |k_i| for i < count and 0 past it (set_decays).
  template <typename D>
  __device__ __forceinline__ void advance(D* dst, int ld, int cols, int count) const {
    const float scale = expf(cum[count - 1]);
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3, n0 = 8 * (warp & 3);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m0 = 16 * (warp / 4) + (kChunkD / 2) * half;
      if (m0 >= dk) break;  // warp-uniform
      float acc[4] = {};
#pragma unroll 2
      for (int k0 = 0; k0 < kChunk; k0 += 8) {  // (k diag(decay))^T v'
        float a[4], b[2];
        load_a_transposed(a, k, kLdK, m0, k0);
        load_b_rows(b, v, kLdS, k0, n0);
        b[0] *= decay[k0 + t];
        b[1] *= decay[k0 + t + 4];
        mma_tf32(acc, stored_tf32<kTerms>(a), to_tf32<kTerms>(b));
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + g + 8 * (e / 2), c = n0 + 2 * t + e % 2;
        if (r < dk && c < cols) dst[r * ld + c] = from_float<D>(scale * s[r * kLdS + c] + acc[e]);
      }
    }
  }

  // decay[i] for advance(count), from the chunk's G and k's scales (in decay[] until then).
  __device__ __forceinline__ void set_decays(const float* k_scale, int count) const {
    if (threadIdx.x < kChunk) {
      const int i = threadIdx.x;
      decay[i] = i < count ? expf(cum[count - 1] - cum[i]) * k_scale[i] : 0.f;
    }
  }
};

// Copies the block's columns of S (shared) into a head's [dk, dv] state in the pool.
template <typename S>
__device__ __forceinline__ void store_columns(S* head, const float* s, int j0, int dk, int dv) {
  for (int idx = threadIdx.x; idx < dk * kStateCols; idx += blockDim.x) {
    const int r = idx / kStateCols, c = idx % kStateCols;
    if (j0 + c < dv) head[r * dv + j0 + c] = from_float<S>(s[r * kLdS + c]);
  }
}

template <typename T, typename S>
__global__ void __launch_bounds__(kStateThreads)
    delta_chunk_state_kernel(T* __restrict__ out, const T* __restrict__ mixed_qkv, long long ld_qkv,
                             const float* __restrict__ workspace, S* __restrict__ state,
                             const int* query_start, const int* seq_lens, const int* state_slots,
                             const int* snapshot_start, const int* snapshot_offsets, const int* snapshot_slots,
                             int tokens, int num_k_heads, int num_v_heads, int dk, int dv) {
  constexpr int kTerms = sizeof(T) == sizeof(float) ? 3 : 1;
  extern __shared__ float smem[];
  ChunkState<kTerms> cs;
  cs.s = smem;
  cs.w = cs.s + kChunkD * kLdS;
  cs.q = cs.w + kChunk * kLdW;
  cs.k = cs.q + kChunk * kLdW;
  cs.p = cs.k + kChunk * kLdK;
  cs.v = cs.p + kChunk * kLdP;
  cs.cum = cs.v + kChunk * kLdS;
  cs.decay = cs.cum + kChunk;
  float* k_scale = cs.decay + kChunk;
  cs.warp = threadIdx.x / 32;
  cs.dk = dk;
  const int tid = threadIdx.x, warp = cs.warp, g = (tid & 31) >> 2, t = tid & 3;
  const int m0 = 16 * (warp / 4), n0 = 8 * (warp % 4);  // this warp's tile of v' and o

  const Segments seg{query_start, seq_lens, state_slots, snapshot_start, snapshot_offsets, snapshot_slots};
  const int h = blockIdx.x, b = blockIdx.y, j0 = blockIdx.z * kStateCols, cols = min(kStateCols, dv - j0);
  const HeadSegment<S> head = head_segment(seg, state, b, h, num_k_heads, num_v_heads, dk, dv);
  const int kh = head.kh, start = head.start, length = head.length;
  const ChunkWorkspace ws(const_cast<float*>(workspace), tokens, num_v_heads, dk, dv);
  for (int idx = tid; idx < kChunkD * kStateCols; idx += blockDim.x) {
    const int r = idx / kStateCols, c = idx % kStateCols;
    cs.s[r * kLdS + c] = head.cached && r < dk && c < cols ? to_float(head.own[r * dv + j0 + c]) : 0.f;
  }
  int next = seg.snapshot_start[b];
  const int last_snapshot = seg.snapshot_start[b + 1];

  for (int t0 = 0, n = 0;; t0 += n) {
    __syncthreads();  // S is written; the previous chunk's arrays are read
    for (; next < last_snapshot && seg.snapshot_offsets[next] == t0; ++next) {
      store_columns(head_state(state, seg.snapshot_slots[next], num_v_heads, h, dk, dv), cs.s, j0, dk, dv);
    }
    if (t0 >= length) break;
    n = min(kChunk, length - t0);
    const long long row0 = static_cast<long long>(start) + t0;
    // One round trip: W, P and U copied straight to shared memory, q and k through registers,
    // G, q's factor (its scale times exp(G), in decay[] until the decays are set) and k's scale.
    const long long head_row = row0 * num_v_heads + h;
    copy_chunk_rows_async<kChunkD, kStateThreads>(cs.w, kLdW, ws.w + head_row * dk, num_v_heads * dk, n, dk);
    copy_chunk_rows_async<kChunk, kStateThreads>(cs.p, kLdP, ws.p + head_row * kChunk, num_v_heads * kChunk, n,
                                                 kChunk);
    copy_chunk_rows_async<kStateCols, kStateThreads>(cs.v, kLdS, ws.u + head_row * dv + j0, num_v_heads * dv, n,
                                                     cols);
    cp_async_commit();
    const T* qkv = mixed_qkv + row0 * ld_qkv;
    ChunkRows<kChunkD, kStateThreads, T> q_rows, k_rows;
    q_rows.load(qkv + kh * dk, ld_qkv, n, dk);
    k_rows.load(qkv + (num_k_heads + kh) * dk, ld_qkv, n, dk);
    if (tid < kChunk) {
      const long long at = (row0 + tid) * num_v_heads + h;
      const float cum = tid < n ? ws.cum[at] : 0.f;
      cs.cum[tid] = cum;
      cs.decay[tid] = tid < n ? ws.q_scale[at] * expf(cum) : 0.f;
      k_scale[tid] = tid < n ? ws.k_scale[at] : 0.f;
    }
    q_rows.store(cs.q, kLdW, KeepTf32<kTerms>());
    k_rows.store(cs.k, kLdK, KeepTf32<kTerms>());
    cp_async_wait<0>();
    __syncthreads();
    // This warp's tiles of W S and q S.
    float ws_acc[4] = {}, o[4] = {};
    for (int k0 = 0; k0 < dk; k0 += 8) {
      float a[4], s_frag[2];
      load_b_rows(s_frag, cs.s, kLdS, k0, n0);
      const auto s_tf32 = to_tf32<kTerms>(s_frag);
      load_a_rows(a, cs.w, kLdW, m0, k0);
      mma_tf32(ws_acc, stored_tf32<kTerms>(a), s_tf32);
      load_a_rows(a, cs.q, kLdW, m0, k0);
      mma_tf32(o, stored_tf32<kTerms>(a), s_tf32);
    }
    // v' = U - W S; o = (q exp(G)) S so far (q's scale and exp(G) are per row).
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = m0 + g + 8 * (e / 2);
      cs.v[i * kLdS + n0 + 2 * t + e % 2] -= ws_acc[e];
      o[e] *= cs.decay[i];
    }
    __syncthreads();
    // o += P v' (P is zero above its diagonal and past n).
#pragma unroll 2
    for (int k0 = 0; k0 < kChunk; k0 += 8) {
      float a[4], b[2];
      load_a_rows(a, cs.p, kLdP, m0, k0);
      load_b_rows(b, cs.v, kLdS, k0, n0);
      mma_tf32(o, stored_tf32<kTerms>(a), to_tf32<kTerms>(b));
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = m0 + g + 8 * (e / 2), c = n0 + 2 * t + e % 2;
      if (i < n && c < cols) out[(row0 + i) * num_v_heads * dv + h * dv + j0 + c] = from_float<T>(o[e]);
    }
    // Snapshots inside the chunk: the state after its first `offset - t0` tokens.
    for (; next < last_snapshot && seg.snapshot_offsets[next] < t0 + n; ++next) {
      const int count = seg.snapshot_offsets[next] - t0;
      __syncthreads();  // the decays are read
      cs.set_decays(k_scale, count);
      __syncthreads();
      cs.advance(head_state(state, seg.snapshot_slots[next], num_v_heads, h, dk, dv) + j0, dv, cols, count);
    }
    __syncthreads();  // the decays are set (and a snapshot's are read)
    cs.set_decays(k_scale, n);
    __syncthreads();
    cs.advance(cs.s, kLdS, kStateCols, n);
  }
  store_columns(head.own, cs.s, j0, dk, dv);
}
