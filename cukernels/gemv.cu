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

// out [M, N] (row stride ld_out) = x [M, K] (row stride ld_x) @ w [N, K]^T (+ bias [N] if not null).
// kM is the M tile: M <= kM rows of x run in one pass over w.
// Launch: ceil(N / kGemvRows) blocks of 32 * S threads, S in [1, kGemvMaxWarps] warps
// splitting K. Preconditions (checked by the launcher): K and ld_x are multiples of a
// 16-byte chunk, and x and w are 16-byte aligned.
template <typename T, typename OutT, int kM>
__global__ void __launch_bounds__(32 * kGemvMaxWarps)
    gemv_kernel(OutT* __restrict__ out, const T* __restrict__ x, const T* __restrict__ w,
                const OutT* __restrict__ bias, int M, int N, int K, long long ld_x, long long ld_out) {
  using C = Chunk<T>;
  // With many x rows the accumulators need the registers: fewer loads per pass.
  constexpr int kUnroll = (kM >= 8 ? kGemvLoads / 2 : kGemvLoads) / kGemvRows;
  const int num_chunks = K / C::kSize;
  const int row0 = blockIdx.x * kGemvRows;

  const T* w_rows[kGemvRows];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) {
    // The last block's rows past N re-read row N - 1; their sums are never stored.
    w_rows[r] = w + static_cast<long long>(min(row0 + r, N - 1)) * K;
  }

  float acc[kM][kGemvRows] = {};
  for (int first = threadIdx.x; first < num_chunks; first += blockDim.x * kUnroll) {
    uint4 w_raw[kUnroll][kGemvRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int chunk = first + u * blockDim.x;
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) {
        if (chunk < num_chunks) w_raw[u][r] = load_streaming(w_rows[r] + static_cast<long long>(chunk) * C::kSize);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int chunk = first + u * blockDim.x;
      if (chunk >= num_chunks) break;
      float w_vals[kGemvRows][C::kSize];
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) C::unpack(w_raw[u][r], w_vals[r]);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        if (m >= M) break;
        float x_vals[C::kSize];
        C::unpack(__ldg(reinterpret_cast<const uint4*>(x + m * ld_x + static_cast<long long>(chunk) * C::kSize)),
                  x_vals);
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
  for (int i = threadIdx.x; i < kM * kGemvRows; i += blockDim.x) {
    const int m = i / kGemvRows, row = row0 + i % kGemvRows;
    if (m >= M || row >= N) continue;
    float sum = 0.f;
    for (int p = 0; p < num_warps; ++p) sum += partial[p][i];
    if (bias != nullptr) sum += to_float(bias[row]);
    out[m * ld_out + row] = from_float<OutT>(sum);
  }
}
