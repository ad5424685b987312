// Rotary embedding (neox rotate-half, partial rotary) fused with the paged
// KV-cache write, optionally after a per-head RMSNorm of q and k (Qwen3's
// q_norm / k_norm).
//
// For a head vector x of head_dim values and half = rotary_dim / 2, at token
// position p with c = cos_sin[p, i] and s = cos_sin[p, half + i]:
//   out[i]        = x[i] * c - x[i + half] * s      i <  half
//   out[i + half] = x[i + half] * c + x[i] * s      i <  half
//   out[i]        = x[i]                            i >= rotary_dim
// The host builds cos_sin [max_pos, rotary_dim] float32 from the already
// scaled inv_freq (llama3 scaling) and multiplies in the attention scaling.
//
// With norm weights, every q and k head is first replaced by
//   x = round_T(x / sqrt(mean(x^2) + eps) * weight)      (over all head_dim values)
// computed as rmsnorm_kernel (norm.cu) does and rounded to T where it stores, so
// the fused launch equals rmsnorm followed by the plain rotation.
//
// Rotated q goes to q_out [T, Hq, D]; rotated k and plain v go to the caches
// [NB, Hkv, BS, D] at slot = slot_mapping[t] = block * BS + offset; a negative
// slot skips the cache write (padding tokens).
//
// The arithmetic is rope_common.cuh's, as the fused decode attention
// (attention_rope.cuh) does it, and gives the same bits: head_inv_rms has lane l of
// L = lanes_per_head(D / kVec) lanes add up chunks l, l + L, ... of a head, then a
// butterfly over the L lanes. Here a group of threads owns one (token, head) and
// holds that head's chunks in registers, loaded once; thread t of a group of G holds
// chunks t, t + G, t + 2 G, ...:
// - the plain layout (kLanesPerThread 1): G = L, thread l holds lane l's chunks (one
//   each up to D = 32 kVec); a chunk's rotation partner comes from the thread
//   holding it by shuffle;
// - the split layout (kLanesPerThread 4; D / kVec = L chunks, full rotary): G = L / 4,
//   thread t holds the 4 lanes t + i G, one chunk each, and adds up their sums as the
//   butterfly's first two steps (offsets L / 2, L / 4) would; its group shuffles the
//   rest of the butterfly. Chunks t + i G and t + (i + 2) G are rotation partners.
#include "rope_common.cuh"

using namespace sparkd;

constexpr int kRopeMaxThreads = 512;
// The largest head_dim: a thread holds all its chunks of a head in registers.
constexpr int kRopeMaxHeadDim = 256;

// Chunks one thread holds: kLanesPerThread in the split layout, else lane l's chunks
// l, l + 32, ... of a head of up to kRopeMaxHeadDim values.
template <int kVec, int kLanesPerThread>
__host__ __device__ constexpr int rope_chunks_held() {
  return kLanesPerThread > 1 ? kLanesPerThread : (kRopeMaxHeadDim / kVec > 32 ? kRopeMaxHeadDim / kVec / 32 : 1);
}

// partner[s] = the values of the rotation partner of the plain layout's chunk
// lane + s * lanes (rotation_partner's chunk; the chunk itself where it does not
// rotate), from the thread of the group that holds it. group_first: the warp lane of
// the group's thread 0. Every lane of the warp calls it.
template <int kVec, int kHeld>
__device__ __forceinline__ void partner_chunks(float (&partner)[kHeld][kVec], const float (&x)[kHeld][kVec],
                                               int lane, int lanes, int group_first, int rotary_dim) {
#pragma unroll
  for (int s = 0; s < kHeld; ++s) {
    const int dim = (lane + s * lanes) * kVec;
    const int source = dim < rotary_dim ? rotation_partner(dim, rotary_dim) / kVec : lane + s * lanes;
    const int source_lane = group_first + source % lanes, source_slot = source / lanes;
    // Registers cannot be indexed at run time: every chunk of the source thread
    // crosses, and the one named is kept (one shuffle a value when a thread holds one).
#pragma unroll
    for (int from = 0; from < kHeld; ++from) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float value = __shfl_sync(kFullMask, x[from][i], source_lane);
        if (kHeld == 1 || from == source_slot) partner[s][i] = value;
      }
    }
  }
}

// q: [T, Hq, D] at row stride q_stride; k, v: [T, Hkv, D] at k_stride, v_stride
// (elements; heads contiguous inside a row, so strided views of the fused qkv
// GEMM output work). positions, slot_mapping: [T] int32. q_norm, k_norm: [D], or
// both null for no norm. head_dim <= kRopeMaxHeadDim; rotary_dim / 2 a multiple of
// kVec; kLanesPerThread 4 only where D / kVec = lanes_per_head(D / kVec) >= 4 and
// rotary_dim = D.
// Launch: grid = (T, parts), block = a multiple of 32, at most kRopeMaxThreads, with
// parts * block >= (Hq + 2 Hkv) * G: token blockIdx.x's heads in order (q, k, v),
// G = lanes_per_head(D / kVec) / kLanesPerThread threads a head, within one warp.
// No shared memory, no block barrier.
template <typename T, int kVec, int kLanesPerThread>
__global__ void __launch_bounds__(kRopeMaxThreads)
    rope_write_kv_kernel(T* __restrict__ q_out, T* __restrict__ k_cache, T* __restrict__ v_cache,
                         const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                         const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                         const float* __restrict__ cos_sin, const T* __restrict__ q_norm,
                         const T* __restrict__ k_norm, float eps, int num_q_heads, int num_kv_heads, int head_dim,
                         int rotary_dim, int block_size, long long q_stride, long long k_stride,
                         long long v_stride) {
  constexpr bool kSplit = kLanesPerThread > 1;
  constexpr int kHeld = rope_chunks_held<kVec, kLanesPerThread>();
  constexpr int kFactors = kSplit ? kHeld / 2 : kHeld;  // rotation partners share their cos and sin
  const int chunks = head_dim / kVec, lanes = lanes_per_head(chunks);
  const int group = lanes / kLanesPerThread, group_shift = __ffs(group) - 1;
  const int thread = blockIdx.y * blockDim.x + threadIdx.x, lane = thread & (group - 1);
  const int token = blockIdx.x, num_heads = num_q_heads + 2 * num_kv_heads;
  // Threads past the last head repeat head 0 without storing: they still take part
  // in their warp's shuffles.
  const bool live = (thread >> group_shift) < num_heads;
  const int head = live ? thread >> group_shift : 0;
  const bool is_q = head < num_q_heads, is_k = !is_q && head < num_q_heads + num_kv_heads;
  const bool rotates = is_q || is_k;
  const int kv_head = head - num_q_heads - (is_k ? 0 : num_kv_heads);
  const T* src = is_q   ? q + token * q_stride + head * head_dim
                 : is_k ? k + token * k_stride + kv_head * head_dim
                        : v + token * v_stride + kv_head * head_dim;

  // Every global load is issued before the first use: the head's chunks, the token's
  // slot, position and rotation factors (the k and v heads of a padding token load
  // too, and store nothing).
  float x[kHeld][kVec], cos_v[kFactors][kVec], sin_v[kFactors][kVec];
  const int slot = slot_mapping[token];
  const float* cos_sin_row = cos_sin + static_cast<long long>(positions[token]) * rotary_dim;
#pragma unroll
  for (int s = 0; s < kHeld; ++s) {
    const int dim = (lane + s * group) * kVec;
    if (kSplit || dim < head_dim) {
      load_floats<kVec>(src + dim, x[s]);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) x[s][i] = 0.f;
    }
    if (s < kFactors && rotates && (kSplit || dim < rotary_dim))
      rotation_factors<kVec>(cos_v[s], sin_v[s], cos_sin_row, dim, rotary_dim);
  }

  if (q_norm != nullptr) {  // uniform: every lane of the warp reduces (the shuffles)
    float sum_sq[kLanesPerThread] = {};
#pragma unroll
    for (int s = 0; s < kHeld; ++s)
      if (kSplit || (lane + s * group) * kVec < head_dim) add_squares<kVec>(sum_sq[s % kLanesPerThread], x[s]);
#pragma unroll
    for (int offset = kLanesPerThread / 2; offset > 0; offset /= 2) {  // the butterfly's steps inside the thread
#pragma unroll
      for (int i = 0; i < offset; ++i) sum_sq[i] = __fadd_rn(sum_sq[i], sum_sq[i + offset]);
    }
    const float inv_rms = group_inv_rms(sum_sq[0], head_dim, group, eps);
#pragma unroll
    for (int s = 0; s < kHeld; ++s) {
      const int dim = (lane + s * group) * kVec;
      if (rotates && (kSplit || dim < head_dim)) normalise<T, kVec>(x[s], is_q ? q_norm : k_norm, inv_rms, dim);
    }
  }
  float partner[kHeld][kVec];
  if constexpr (kSplit) {
#pragma unroll
    for (int s = 0; s < kHeld; ++s) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) partner[s][i] = x[(s + kHeld / 2) % kHeld][i];
    }
  } else {
    partner_chunks<kVec, kHeld>(partner, x, lane, lanes, (threadIdx.x & 31) - lane, rotary_dim);
  }

  if (!live || (!is_q && slot < 0)) return;
  T* dst;
  if (is_q) {
    dst = q_out + (static_cast<long long>(token) * num_q_heads + head) * head_dim;
  } else {
    const long long block = slot / block_size, offset = slot % block_size;
    dst = (is_k ? k_cache : v_cache) + ((block * num_kv_heads + kv_head) * block_size + offset) * head_dim;
  }
#pragma unroll
  for (int s = 0; s < kHeld; ++s) {
    const int dim = (lane + s * group) * kVec;
    if (!kSplit && dim >= head_dim) continue;
    if (rotates && (kSplit || dim < rotary_dim)) {
      const bool first_half = kSplit ? s < kHeld / 2 : dim < rotary_dim / 2;
      const int f = kSplit ? s % kFactors : s;
      rotate<kVec>(x[s], partner[s], cos_v[f], sin_v[f], first_half);
    }
    store_floats<kVec>(dst + dim, x[s]);
  }
}
