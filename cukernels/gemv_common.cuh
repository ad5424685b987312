// The weight-streaming core of the skinny GEMMs (gemv.cu, gemv_norm.cu):
// acc [M, kGemvRows] = x [M, K] . w rows [kGemvRows, K], M <= 16, fp32 accumulation.
//
// At such M the product is bound by reading w once from DRAM, so the loop is
// built around that stream:
// - a block owns kGemvRows rows of w, and its threads stride over K in
//   16-byte chunks (8 bf16/fp16 or 4 fp32): a warp reads 512 contiguous bytes
//   of a row per load;
// - every thread issues all the loads of a pass (a chunk of each of its rows for
//   one x row, in many resident warps; kGemvLoads for a few x rows) before it
//   uses any, so thousands of loads per SM are in flight;
// - w is read exactly once and bypasses L1; x (a few KB that every block
//   re-reads) stays cached there or in shared memory, and each x chunk serves
//   kGemvRows rows of w;
// - when K is long, several warps split one row (split-K inside the block);
//   their partial sums meet in shared memory, so there is no workspace and no
//   atomic, the launch is graph-capturable and the result deterministic.
#pragma once

#include "common.cuh"

namespace sparkd {

constexpr int kGemvRows = 4;      // rows of w per block (per row group of a fused block)
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

// Asks L2 for the 128-byte line at p without waiting for it.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

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

// x rows in global memory, row stride ld (elements), read through the read-only cache.
template <typename T>
struct GlobalRows {
  const T* x;
  long long ld;
  __device__ __forceinline__ uint4 chunk(int m, int c) const {
    return __ldg(reinterpret_cast<const uint4*>(x + m * ld + static_cast<long long>(c) * Chunk<T>::kSize));
  }
};

// x rows in shared memory, packed [M, K].
template <typename T>
struct SharedRows {
  const T* x;
  int k;
  __device__ __forceinline__ uint4 chunk(int m, int c) const {
    return *reinterpret_cast<const uint4*>(x + m * k + c * Chunk<T>::kSize);
  }
};

// The launch's kUnroll: the chunks of each w row a thread loads per pass. One x row: one, so
// that a pass is short and many warps fit an SM, which keeps loads in flight while blocks
// come and go (measured on the H200, docs/benchmarks.md runs 39-42: the 4096 x 4096 GEMV went
// from 0.67 to 0.74-0.80 of the copy rate against four). With more x rows, four; with many, the
// accumulators need the registers, so two.
template <int kM>
struct GemvPass {
  static constexpr int kUnroll = kM == 1 ? 1 : (kM >= 8 ? kGemvLoads / 2 : kGemvLoads) / kGemvRows;
};

// acc[m][r] += x row m . w_rows[r] over this thread's share of the num_chunks chunks of K, m < M.
// Rows: GlobalRows<T> or SharedRows<T>.
template <typename T, int kM, typename Rows>
__device__ __forceinline__ void accumulate_rows(float (&acc)[kM][kGemvRows], const T* const (&w_rows)[kGemvRows],
                                                const Rows& x, int M, int num_chunks) {
  using C = Chunk<T>;
  constexpr int kUnroll = GemvPass<kM>::kUnroll;
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
        C::unpack(x.chunk(m, chunk), x_vals);
#pragma unroll
        for (int r = 0; r < kGemvRows; ++r) {
#pragma unroll
          for (int i = 0; i < C::kSize; ++i) acc[m][r] = fmaf(x_vals[i], w_vals[r][i], acc[m][r]);
        }
      }
    }
  }
}

// Per-warp sums of acc, for rows m < M: partial[warp][m * kGemvRows + r]. Ends with a
// __syncthreads, after which block_total reads them.
template <int kM>
__device__ __forceinline__ void store_warp_sums(const float (&acc)[kM][kGemvRows],
                                                float (&partial)[kGemvMaxWarps][kM * kGemvRows], int M) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
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
}

// The block's sum of entry i (= m * kGemvRows + r), warps folded in a fixed order.
template <int kM>
__device__ __forceinline__ float block_total(const float (&partial)[kGemvMaxWarps][kM * kGemvRows], int i) {
  float sum = 0.f;
  for (int p = 0; p < blockDim.x / 32; ++p) sum += partial[p][i];
  return sum;
}

// The w rows of a plain product's row group: rows row0 + r of w [N, K]. The last group's
// rows past N re-read row N - 1; their sums are never stored.
template <typename T>
__device__ __forceinline__ void product_rows(const T* (&w_rows)[kGemvRows], const T* w, int row0, int N, int K) {
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) w_rows[r] = w + static_cast<long long>(min(row0 + r, N - 1)) * K;
}

// The w rows of a gated MLP's column group: w = [gate | up] [2I, K]; the group owns
// kGemvRows / 2 output columns col0 + c, whose gate rows col0 + c and up rows I + col0 + c
// meet in one block. Columns past I re-read the last; they are never stored.
template <typename T>
__device__ __forceinline__ void gate_up_rows(const T* (&w_rows)[kGemvRows], const T* w, int col0, int I, int K) {
  constexpr int kCols = kGemvRows / 2;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int col = min(col0 + c, I - 1);
    w_rows[c] = w + static_cast<long long>(col) * K;
    w_rows[kCols + c] = w + static_cast<long long>(I + col) * K;
  }
}

// out[m * ld_out + row0 + r] = the block's sum of acc[m][r] (+ bias[row0 + r]) for rows < N, m < M.
// Every thread of the block calls it (store_warp_sums holds a barrier).
template <typename OutT, int kM>
__device__ __forceinline__ void store_product(OutT* __restrict__ out, const float (&acc)[kM][kGemvRows],
                                              float (&partial)[kGemvMaxWarps][kM * kGemvRows],
                                              const OutT* __restrict__ bias, int row0, int M, int N,
                                              long long ld_out) {
  store_warp_sums<kM>(acc, partial, M);
  for (int i = threadIdx.x; i < kM * kGemvRows; i += blockDim.x) {
    const int m = i / kGemvRows, row = row0 + i % kGemvRows;
    if (m >= M || row >= N) continue;
    float sum = block_total<kM>(partial, i);
    if (bias != nullptr) sum += to_float(bias[row]);
    out[m * ld_out + row] = from_float<OutT>(sum);
  }
}

// out [M, I] columns col0 + c = silu(gate) * up from the block's sums of acc (gate_up_rows'
// order), bias [2I] or null. Each half is rounded to T first, as linear's output would be,
// then silu(g) * u is taken in fp32 (activation.cu). Every thread of the block calls it.
template <typename T, int kM>
__device__ __forceinline__ void store_silu_and_mul(T* __restrict__ out, const float (&acc)[kM][kGemvRows],
                                                   float (&partial)[kGemvMaxWarps][kM * kGemvRows],
                                                   const T* __restrict__ bias, int col0, int M, int I) {
  constexpr int kCols = kGemvRows / 2;
  store_warp_sums<kM>(acc, partial, M);
  for (int i = threadIdx.x; i < kM * kCols; i += blockDim.x) {
    const int m = i / kCols, c = i % kCols, col = col0 + c;
    if (m >= M || col >= I) continue;
    float gate = block_total<kM>(partial, m * kGemvRows + c);
    float up = block_total<kM>(partial, m * kGemvRows + kCols + c);
    if (bias != nullptr) {
      gate += to_float(bias[col]);
      up += to_float(bias[I + col]);
    }
    gate = to_float(from_float<T>(gate));
    up = to_float(from_float<T>(up));
    out[static_cast<long long>(m) * I + col] = from_float<T>(gate / (1.f + expf(-gate)) * up);
  }
}

}  // namespace sparkd
