// Helpers shared by the kernels in cukernels/: element conversion, packed
// 16-byte loads and stores, and warp / block reductions.
//
// Every kernel computes in fp32 whatever its storage type (float, __half,
// __nv_bfloat16). No fast-math: parity with the numpy backend is 1e-5 in fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace sparkd {

constexpr unsigned kFullMask = 0xffffffffu;

// +inf (NVRTC has no <cmath> INFINITY).
__device__ __forceinline__ float infinity() { return __int_as_float(0x7f800000); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N consecutive elements moved as one access. With N * sizeof(T) == 16 this is
// a single 128-bit load/store; wider packs are split into 16-byte accesses, so
// the address only ever needs 16-byte alignment.
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[N]) {
  const Pack<T, N> pack = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(pack.v[i]);
}

template <int N, typename T>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[N]) {
  Pack<T, N> pack;
#pragma unroll
  for (int i = 0; i < N; ++i) pack.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<T, N>*>(p) = pack;
}

struct SumOp {
  template <typename V> __device__ __forceinline__ V operator()(V a, V b) const { return a + b; }
};

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Reduces v over the blockDim.x threads that share threadIdx.y (a "row
// group"); every thread of the group gets the result. blockDim.x must be a
// multiple of 32. scratch: shared memory of at least 32 * blockDim.y values.
// Every thread of the block must call it (it holds __syncthreads when a group
// spans several warps); it leaves scratch free for the next call. The
// combining order is fixed, so results are deterministic.
template <typename V, typename Op>
__device__ __forceinline__ V row_group_reduce(V v, Op op, V identity, V* scratch) {
  v = warp_reduce(v, op);
  const int num_warps = blockDim.x / 32;
  if (num_warps == 1) return v;
  V* partial = scratch + threadIdx.y * 32;
  const int lane = threadIdx.x & 31;
  if (lane == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  v = warp_reduce(lane < num_warps ? partial[lane] : identity, op);
  __syncthreads();
  return v;
}

// ---- 1-D block helpers: argmax, exclusive scan, radix select ----

struct ArgMax {
  float value;
  int index;
};

// The larger value wins; on equal values the lower index, as numpy's argmax.
__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

__device__ ArgMax block_argmax(ArgMax v, ArgMax* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = better(v, {__shfl_xor_sync(kFullMask, v.value, offset), __shfl_xor_sync(kFullMask, v.index, offset)});
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / 32 ? scratch[lane] : ArgMax{-infinity(), 0x7fffffff};
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = better(v, {__shfl_xor_sync(kFullMask, v.value, offset), __shfl_xor_sync(kFullMask, v.index, offset)});
  }
  __syncthreads();
  return v;
}

// Sum of v over the threads before this one in the block; total gets the sum over all.
__device__ int block_exclusive_sum(int v, int* scratch, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  int inclusive = v;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  int before = 0;
  total = 0;
  for (int w = 0; w < blockDim.x / 32; ++w) {
    before += w < warp ? scratch[w] : 0;
    total += scratch[w];
  }
  __syncthreads();
  return before + inclusive - v;
}

// ---- radix select ----

// Order-preserving uint key of a float (-0 counts as +0, as in comparisons).
__device__ __forceinline__ unsigned ordered_key(float v) {
  const unsigned bits = __float_as_uint(v == 0.f ? 0.f : v);
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

__device__ __forceinline__ float key_value(unsigned key) {
  return __uint_as_float((key & 0x80000000u) ? key & 0x7fffffffu : ~key);
}

constexpr int kRadixBins = 2048;  // the widest radix digit is 11 bits

template <typename W>
struct Candidate {
  float value;
  W weight;  // 0: not a candidate
};

template <typename W>
struct Selection {
  float value;  // the threshold: an exact candidate value
  W above;      // weight of the candidates strictly above it
  W at;         // weight of the candidates equal to it
};

// Picks, in a warp, the lowest non-empty bin b of hist[0, num_bins) with
// above + weight(bins > b) < target. Lane 0 scans the top bins.
template <typename W>
__device__ void pick_bin(const W* hist, int num_bins, W above, W target, int& bin, W& bin_above) {
  const int lane = threadIdx.x & 31, per_lane = num_bins / 32;
  const int top = num_bins - lane * per_lane;
  W segment = 0;
  for (int b = top - 1; b >= top - per_lane; --b) segment += hist[b];
  W inclusive = segment;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const W other = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  const W exclusive = __shfl_up_sync(kFullMask, inclusive, 1);
  W run = above + (lane ? exclusive : W(0));
  int found = 0x7fffffff;
  W found_above = 0;
  for (int b = top - 1; b >= top - per_lane; --b) {
    if (hist[b] > W(0) && run < target) {
      found = b;
      found_above = run;
    }
    run += hist[b];
  }
  int lowest = found;
  for (int offset = 16; offset > 0; offset >>= 1) lowest = min(lowest, __shfl_xor_sync(kFullMask, lowest, offset));
  // Only NaN weights leave every bin unmatched; fall back to the top bin.
  const int owner = lowest == 0x7fffffff ? 0 : (num_bins - 1 - lowest) / per_lane;
  bin = lowest == 0x7fffffff ? num_bins - 1 : lowest;
  bin_above = __shfl_sync(kFullMask, found_above, owner);
}

// The smallest candidate value v whose strictly-greater candidates weigh less
// than target (> 0), over ids [0, n). candidate_of(i) -> Candidate<W>.
// Three passes over the row refine the key 11, 11 and 10 bits at a time.
// hist: shared memory of kRadixBins W; every thread of the block must call it.
template <typename W, typename CandidateOf>
__device__ Selection<W> select_threshold(int n, CandidateOf candidate_of, W target, W* hist) {
  __shared__ unsigned s_prefix;
  __shared__ W s_above, s_at;
  unsigned prefix = 0;
  W above = 0, at = 0;
  for (int level = 0; level < 3; ++level) {
    const int bits = level == 2 ? 10 : 11;
    const int shift = level == 0 ? 21 : (level == 1 ? 10 : 0);
    const int num_bins = 1 << bits;
    for (int b = threadIdx.x; b < num_bins; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const Candidate<W> c = candidate_of(i);
      if (!(c.weight > W(0))) continue;
      const unsigned key = ordered_key(c.value);
      if (level > 0 && (key >> (shift + bits)) != prefix) continue;
      atomicAdd(&hist[(key >> shift) & (num_bins - 1)], c.weight);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      int bin;
      W bin_above;
      pick_bin(hist, num_bins, above, target, bin, bin_above);
      if (threadIdx.x == 0) {
        s_prefix = (prefix << bits) | bin;
        s_above = bin_above;
        s_at = hist[bin];
      }
    }
    __syncthreads();
    prefix = s_prefix;
    above = s_above;
    at = s_at;
  }
  return {key_value(prefix), above, at};
}

// "Last block done": every thread of a block that has stored its share of a result
// calls this; `arrivals` blocks share `counter` (e.g. a split decode attention's
// blocks of one sequence, kv head and head chunk). True in the block that arrives
// last, which then sees every other block's stores. That block resets the counter,
// so the next launch (a graph replay) starts from zero again. As in cooperative
// groups' grid barrier, thread 0 counts the block in with release semantics, which
// cover the stores the block barrier ordered before it, and acquire semantics, which
// the closing barrier extends to the whole block.
__device__ __forceinline__ bool arrive_last(unsigned* counter, unsigned arrivals) {
  __syncthreads();
  bool last = false;
  if (threadIdx.x == 0) {
    unsigned before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
    last = before == arrivals - 1;
    if (last) *counter = 0u;  // every block of this launch has counted itself in
  }
  return __syncthreads_or(last);
}

}  // namespace sparkd
