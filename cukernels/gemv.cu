// Skinny GEMM for decode-sized batches: out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]),
// M <= 16, fp32 accumulation whatever the storage type.
//
// At such M the product is bound by reading w once from DRAM (N * K elements),
// so the kernel is built around that stream:
// - each block owns kGemvRows rows of w, and its threads stride over K in
//   16-byte chunks (8 bf16/fp16 or 4 fp32): a warp reads 512 contiguous bytes
//   of a row per load;
// - every thread issues all the loads of a pass (kGemvLoads for few x rows)
//   before it uses any, so thousands of loads per SM are in flight;
// - w is read exactly once and bypasses L1; x (a few KB that every block
//   re-reads) stays cached there, and each x chunk serves kGemvRows rows of w;
// - when K is long, several warps split one row (split-K inside the block);
//   their partial sums meet in shared memory, so there is no workspace and no
//   atomic, the launch is graph-capturable and the result deterministic.
// - split-K across blocks (gridDim.y > 1): on short grids each block takes one
//   K slice of its rows, so the blocks are small and many and the memory pipes
//   stay full to the end. The slices' sums go to a fixed fp32 workspace; the
//   last block of a row group to finish (a counter per row group, which that
//   block resets to zero) adds them in slice order, so the result is
//   deterministic and the launch graph-capturable.
// - kSiluMul: x is [M, 2K] = [gate | up] and the kernel multiplies by
//   silu(gate) * up, computed and rounded to T exactly as silu_and_mul_kernel
//   does (activation.cu), so the fused down projection matches the unfused one.
#include "common.cuh"

using namespace sparkd;

constexpr int kGemvRows = 4;      // rows of w per block
constexpr int kGemvMaxWarps = 8;  // warps splitting K within a block
constexpr int kGemvLoads = 16;    // 16-byte loads of w in flight per thread and pass

// 16 bytes of w, read once: not allocated in L1, where x lives.
__device__ __forceinline__ uint4 load_streaming(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// The elements of one 32-bit word as floats, exactly.
__device__ __forceinline__ void unpack_word(unsigned word, float* out, float) { out[0] = __uint_as_float(word); }
__device__ __forceinline__ void unpack_word(unsigned word, float* out, __half) {
  out[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(word & 0xffffu)));
  out[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(word >> 16)));
}
__device__ __forceinline__ void unpack_word(unsigned word, float* out, __nv_bfloat16) {
  out[0] = __uint_as_float(word << 16);  // bf16 is the top half of an fp32
  out[1] = __uint_as_float(word & 0xffff0000u);
}

template <typename T>
struct Chunk {
  static constexpr int kSize = 16 / sizeof(T);  // elements per 16-byte chunk
  static constexpr int kPerWord = 4 / sizeof(T);

  __device__ static __forceinline__ void unpack(const uint4& raw, float (&out)[kSize]) {
    unpack_word(raw.x, out, T());
    unpack_word(raw.y, out + kPerWord, T());
    unpack_word(raw.z, out + 2 * kPerWord, T());
    unpack_word(raw.w, out + 3 * kPerWord, T());
  }
};

// The activation's value as silu_and_mul_kernel stores it: fp32 math, rounded to T.
template <typename T>
__device__ __forceinline__ float silu_mul_rounded(float gate, float up) {
  return to_float(from_float<T>(gate / (1.f + expf(-gate)) * up));
}

// One 16-byte chunk of x's row (the chunk-th), as floats; with kSiluMul, silu(gate) * up
// where up lies k elements after gate.
template <typename T, bool kSiluMul>
__device__ __forceinline__ void load_x_chunk(const T* x_row, int chunk, int k, float (&out)[Chunk<T>::kSize]) {
  using C = Chunk<T>;
  const T* gate = x_row + static_cast<long long>(chunk) * C::kSize;
  C::unpack(__ldg(reinterpret_cast<const uint4*>(gate)), out);
  if constexpr (kSiluMul) {
    float up[C::kSize];
    C::unpack(__ldg(reinterpret_cast<const uint4*>(gate + k)), up);
#pragma unroll
    for (int i = 0; i < C::kSize; ++i) out[i] = silu_mul_rounded<T>(out[i], up[i]);
  }
}

// Output i's sum over the block's warps, in warp order.
template <int kOutputs>
__device__ __forceinline__ float sum_warps(const float (&partial)[kGemvMaxWarps][kOutputs], int i, int num_warps) {
  float sum = 0.f;
  for (int p = 0; p < num_warps; ++p) sum += partial[p][i];
  return sum;
}

// out [M, N] (row stride ld_out) = x [M, K] (row stride ld_x) @ w [N, K]^T (+ bias [N] if not null);
// with kSiluMul, x [M, K] = silu(gate) * up of gate_up [M, 2K] (row stride ld_x) passed as x.
// kM is the M tile: M <= kM rows of x run in one pass over w.
// Launch: (ceil(N / kGemvRows), S) blocks of 32 * W threads, W in [1, kGemvMaxWarps] warps
// splitting a block's K slice, S the K slices (split-K across blocks). With S > 1:
// partials [S, M, N] fp32 scratch and counters [ceil(N / kGemvRows)] zero before the
// launch (and left zero after it); with S == 1 both may be null.
// Preconditions (checked by the launcher): K and ld_x are multiples of a 16-byte chunk,
// and x and w are 16-byte aligned.
template <typename T, typename OutT, int kM, bool kSiluMul>
__global__ void __launch_bounds__(32 * kGemvMaxWarps)
    gemv_kernel(OutT* __restrict__ out, const T* __restrict__ x, const T* __restrict__ w,
                const OutT* __restrict__ bias, float* __restrict__ partials, unsigned* __restrict__ counters,
                int M, int N, int K, long long ld_x, long long ld_out) {
  using C = Chunk<T>;
  // With many x rows the accumulators need the registers: fewer loads per pass.
  constexpr int kUnroll = (kM >= 8 ? kGemvLoads / 2 : kGemvLoads) / kGemvRows;
  const int num_chunks = K / C::kSize;
  const int slice = (num_chunks + gridDim.y - 1) / gridDim.y;
  const int chunk_begin = blockIdx.y * slice;
  const int chunk_end = min(num_chunks, chunk_begin + slice);
  const int row0 = blockIdx.x * kGemvRows;

  const T* w_rows[kGemvRows];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) {
    // The last block's rows past N re-read row N - 1; their sums are never stored.
    w_rows[r] = w + static_cast<long long>(min(row0 + r, N - 1)) * K;
  }

  float acc[kM][kGemvRows] = {};
  for (int first = chunk_begin + threadIdx.x; first < chunk_end; first += blockDim.x * kUnroll) {
    uint4 w_raw[kUnroll][kGemvRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int chunk = first + u * blockDim.x;
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) {
        if (chunk < chunk_end) w_raw[u][r] = load_streaming(w_rows[r] + static_cast<long long>(chunk) * C::kSize);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int chunk = first + u * blockDim.x;
      if (chunk >= chunk_end) break;
      float w_vals[kGemvRows][C::kSize];
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) C::unpack(w_raw[u][r], w_vals[r]);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        if (m >= M) break;
        float x_vals[C::kSize];
        load_x_chunk<T, kSiluMul>(x + m * ld_x, chunk, K, x_vals);
#pragma unroll
        for (int r = 0; r < kGemvRows; ++r) {
#pragma unroll
          for (int i = 0; i < C::kSize; ++i) acc[m][r] = fmaf(x_vals[i], w_vals[r][i], acc[m][r]);
        }
      }
    }
  }

  // Each warp folds its lanes; then the block's warps meet in shared memory.
  __shared__ float partial[kGemvMaxWarps][kM * kGemvRows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
#pragma unroll
  for (int m = 0; m < kM; ++m) {
    if (m >= M) break;
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
      const float sum = warp_reduce(acc[m][r], SumOp());
      if (lane == 0) partial[warp][m * kGemvRows + r] = sum;
    }
  }
  __syncthreads();
  // Outputs are (m, row) = (i / kGemvRows, row0 + i % kGemvRows), i < kM * kGemvRows, strided over the threads.
  const bool split = gridDim.y > 1;
  if (split) {
    for (int i = threadIdx.x; i < kM * kGemvRows; i += blockDim.x) {
      const int m = i / kGemvRows, row = row0 + i % kGemvRows;
      if (m < M && row < N) partials[(static_cast<long long>(blockIdx.y) * M + m) * N + row] =
          sum_warps(partial, i, num_warps);
    }
    __threadfence();  // this slice's sums reach L2 before the counter says so
    __syncthreads();
    __shared__ bool is_last;
    if (threadIdx.x == 0) {
      is_last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
      if (is_last) counters[blockIdx.x] = 0;  // every slice has counted: ready for the next launch
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();  // and the other slices' sums are read after it
  }
  for (int i = threadIdx.x; i < kM * kGemvRows; i += blockDim.x) {
    const int m = i / kGemvRows, row = row0 + i % kGemvRows;
    if (m >= M || row >= N) continue;
    float sum = 0.f;
    if (split) {
      for (int s = 0; s < gridDim.y; ++s) sum += __ldcg(&partials[(static_cast<long long>(s) * M + m) * N + row]);
    } else {
      sum = sum_warps(partial, i, num_warps);
    }
    if (bias != nullptr) sum += to_float(bias[row]);
    out[m * ld_out + row] = from_float<OutT>(sum);
  }
}
