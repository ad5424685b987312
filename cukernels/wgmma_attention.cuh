// wgmma building blocks of flash attention on Hopper (sm_90a), beside wgmma.cuh's:
//   - tiles of head_dim 128 stored as 2 panels of 64 dims, each a K-major 128-byte-swizzled
//     tile (wgmma.cuh's layout): Q and K read as K-major operands, V (rows = keys) read as the
//     MN-major B operand of O += P V through the transpose bit;
//   - the descriptor of an MN-major tile spanning panels;
//   - wgmma m64n64k16 with A from shared memory (S = Q K^T over 64 keys) and m64n128k16 with A
//     from registers and B transposed (O += P V);
//   - the accumulator-to-A-fragment conversion that keeps P in registers, and the fence that
//     keeps those registers live while an asynchronous wgmma still reads them;
//   - the named barriers two consumer warpgroups take turns on (ping-pong).
#pragma once

#include "attention_mma.cuh"
#include "wgmma.cuh"

namespace sparkd {
namespace wgmma {

constexpr int kPanelDims = kRowBytes / 2;  // 16-bit elements of one swizzled row
constexpr int kM64N64Outputs = 32;         // fp32 accumulators per thread of an m64n64 wgmma
constexpr int kM64N128Outputs = 64;        // fp32 accumulators per thread of an m64n128 wgmma
constexpr int kFragmentRegisters = 4;      // 32-bit registers of one thread's A fragment (m64k16)

// Byte offset of 16-byte chunk `chunk` (of D / 8) of row `row` in a tile of `rows` rows of D
// elements kept as panels of kPanelDims: panel chunk / 8, each rows * kRowBytes long.
__host__ __device__ constexpr int panel_offset(int rows, int row, int chunk) {
  return chunk / kChunksPerRow * rows * kRowBytes + swizzled_offset(row, chunk % kChunksPerRow);
}

#if defined(SPARKD_HAS_WGMMA)

// The descriptor of an MN-major operand in the 128-byte swizzle (PTX ISA, "Matrix Descriptor
// Format"; canonical layout ((64, n), (8, k)) : ((1, LBO), (64, SBO)) in elements): each
// 128-byte row holds 64 consecutive N values at one K, 8 rows form a swizzle period and the
// next 8 K rows follow at the stride byte offset (kSwizzleBytes); N values 64 .. 127 lie in the
// next panel, `panel_bytes` on (the leading byte offset). The tile starts on a swizzle period.
__device__ __forceinline__ unsigned long long mn_major_descriptor(unsigned start, unsigned panel_bytes) {
  return static_cast<unsigned long long>((start & 0x3FFFF) >> 4) |
         (static_cast<unsigned long long>((panel_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<unsigned long long>(kSwizzleBytes >> 4) << 32) | (1ull << 62);
}

// Operand lists of the asm below: acc[0 .. 31] or acc[0 .. 63] bound with constraint C, and
// the matching "{%0, ..., %31}" / "{%0, ..., %63}".
#define SPARKD_ACC8(C, i)                                                                           \
  C(acc[i]), C(acc[i + 1]), C(acc[i + 2]), C(acc[i + 3]), C(acc[i + 4]), C(acc[i + 5]), C(acc[i + 6]), \
      C(acc[i + 7])
#define SPARKD_ACC32(C) SPARKD_ACC8(C, 0), SPARKD_ACC8(C, 8), SPARKD_ACC8(C, 16), SPARKD_ACC8(C, 24)
#define SPARKD_ACC64(C) \
  SPARKD_ACC32(C), SPARKD_ACC8(C, 32), SPARKD_ACC8(C, 40), SPARKD_ACC8(C, 48), SPARKD_ACC8(C, 56)
#define SPARKD_D32                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "          \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SPARKD_D64                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                             \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                    \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                     \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define SPARKD_WRITE(x) "=f"(x)
#define SPARKD_UPDATE(x) "+f"(x)

// acc = A . B^T (SCALE_D 0, acc written only) or acc += A . B^T (SCALE_D 1) for A [64, 16] and
// B [64, 16], both K-major in shared memory (wgmma.cuh's tile_descriptor); acc in the layout
// of accumulator_row / accumulator_col.
#define SPARKD_WGMMA_M64N64K16_SS(TYPE, SCALE_D, C)                                   \
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " SPARKD_D32 \
               ", %32, %33, " #SCALE_D ", 1, 1, 0, 0;\n"                                \
               : SPARKD_ACC32(C)                                                         \
               : "l"(a), "l"(b))

// acc += A . B for A [64, 16] in registers (a: this thread's fragment, see p_fragment) and
// B [16, 128] MN-major in shared memory (mn_major_descriptor; the last 1 is the transpose bit).
#define SPARKD_WGMMA_M64N128K16_RS_TRANSPOSED_B(TYPE)                                     \
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " SPARKD_D64 \
               ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"                              \
               : SPARKD_ACC64(SPARKD_UPDATE)                                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))

// The first K step of S = Q K^T overwrites acc, so the previous tile's S is dead before it.
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16_ss_first(float (&acc)[kM64N64Outputs], unsigned long long a,
                                                         unsigned long long b);

template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&acc)[kM64N64Outputs], unsigned long long a,
                                                   unsigned long long b);

template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16_rs_tb(float (&acc)[kM64N128Outputs],
                                                       const unsigned (&a)[kFragmentRegisters], unsigned long long b);

#define SPARKD_DEFINE_WGMMAS(T, TYPE)                                                                           \
  template <>                                                                                                   \
  __device__ __forceinline__ void wgmma_m64n64k16_ss_first<T>(float (&acc)[kM64N64Outputs], unsigned long long a, \
                                                             unsigned long long b) {                            \
    SPARKD_WGMMA_M64N64K16_SS(TYPE, 0, SPARKD_WRITE);                                                           \
  }                                                                                                             \
  template <>                                                                                                   \
  __device__ __forceinline__ void wgmma_m64n64k16_ss<T>(float (&acc)[kM64N64Outputs], unsigned long long a,       \
                                                       unsigned long long b) {                                  \
    SPARKD_WGMMA_M64N64K16_SS(TYPE, 1, SPARKD_UPDATE);                                                          \
  }                                                                                                             \
  template <>                                                                                                   \
  __device__ __forceinline__ void wgmma_m64n128k16_rs_tb<T>(                                                    \
      float (&acc)[kM64N128Outputs], const unsigned (&a)[kFragmentRegisters], unsigned long long b) {           \
    SPARKD_WGMMA_M64N128K16_RS_TRANSPOSED_B(TYPE);                                                              \
  }

SPARKD_DEFINE_WGMMAS(__nv_bfloat16, "bf16")
SPARKD_DEFINE_WGMMAS(__half, "f16")

#undef SPARKD_DEFINE_WGMMAS
#undef SPARKD_WGMMA_M64N128K16_RS_TRANSPOSED_B
#undef SPARKD_WGMMA_M64N64K16_SS
#undef SPARKD_UPDATE
#undef SPARKD_WRITE
#undef SPARKD_D64
#undef SPARKD_D32
#undef SPARKD_ACC64
#undef SPARKD_ACC32
#undef SPARKD_ACC8

// A wgmma reads its register A fragments after the instruction returns, until wgmma_wait: this
// keeps the fragments live (their registers not reused) up to the call, placed after that wait.
template <int kSteps>
__device__ __forceinline__ void fence_fragments(unsigned (&a)[kSteps][kFragmentRegisters]) {
#pragma unroll
  for (int step = 0; step < kSteps; ++step)
#pragma unroll
    for (int r = 0; r < kFragmentRegisters; ++r) asm volatile("" : "+r"(a[step][r])::"memory");
}

// ---- consumer ping-pong (FlashAttention-3): named barriers 1 and 2, one a consumer warpgroup ----
// Consumer c waits on barrier kTurnBarrier + c for its turn to issue its GEMMs and, once they
// are issued, passes the turn to the other (bar.arrive does not block), so one warpgroup's
// softmax runs while the other's GEMMs hold the tensor cores. Each barrier completes when its
// owner's 128 threads sync and the other's 128 arrive; barrier 0 stays __syncthreads'.
constexpr int kTurnBarrier = 1;
constexpr int kTurnThreads = 2 * kWarpgroupThreads;

__device__ __forceinline__ void wait_turn(int consumer) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(kTurnBarrier + consumer), "n"(kTurnThreads) : "memory");
}

__device__ __forceinline__ void pass_turn(int consumer) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(kTurnBarrier + 1 - consumer), "n"(kTurnThreads) : "memory");
}

#endif  // SPARKD_HAS_WGMMA

// This thread's A fragment of K step `step` (columns 16 step .. 16 step + 15) of a 64 x N
// matrix held in the accumulator layout, rounded to T. The A fragment of an m64k16 wgmma from
// registers is the mma.sync m16k16 one per warp (rows 16 w ..): {row g, cols 2c, 2c+1}, {row
// g + 8, same}, {row g, cols 2c + 8, 2c + 9}, {row g + 8, same}; accumulator column groups
// 2 step and 2 step + 1 hold exactly those, in that order.
template <typename T, int N>
__device__ __forceinline__ void p_fragment(unsigned (&a)[kFragmentRegisters], const float (&p)[N], int step) {
#pragma unroll
  for (int r = 0; r < kFragmentRegisters; ++r) a[r] = attn::pack_pair<T>(p[8 * step + 2 * r], p[8 * step + 2 * r + 1]);
}

// The sum of the two T values packed in x (pack_pair's layout), in fp32.
template <typename T>
__device__ __forceinline__ float pair_sum(unsigned x);

template <>
__device__ __forceinline__ float pair_sum<__nv_bfloat16>(unsigned x) {
  return __uint_as_float(x << 16) + __uint_as_float(x & 0xFFFF0000u);
}

template <>
__device__ __forceinline__ float pair_sum<__half>(unsigned x) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(x))) +
         __half2float(__ushort_as_half(static_cast<unsigned short>(x >> 16)));
}

// Adds each of this thread's two rows' sum over its columns of P, from P's A fragments (see
// p_fragment: registers 0 and 2 hold row g, 1 and 3 row g + 8) to sum[0] and sum[1].
template <typename T, int kSteps>
__device__ __forceinline__ void add_fragment_row_sums(float (&sum)[2], const unsigned (&a)[kSteps][kFragmentRegisters]) {
#pragma unroll
  for (int step = 0; step < kSteps; ++step)
#pragma unroll
    for (int r = 0; r < kFragmentRegisters; ++r) sum[r % 2] += pair_sum<T>(a[step][r]);
}

}  // namespace wgmma
}  // namespace sparkd
