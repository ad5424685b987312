// Hopper building blocks of warp-specialised tensor-core kernels (PTX ISA, "Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate"): mbarriers, cp.async completion on an mbarrier,
// the 128-byte-swizzled K-major shared-memory tile and the matrix descriptor wgmma reads it
// through, wgmma m64n256k16 (bf16 / fp16 in, fp32 accumulators) and setmaxnreg.
//
// wgmma and setmaxnreg exist on sm_90a only. compiler.py builds a source that mentions
// __CUDA_ARCH_FEAT_SM90_ALL (as this header does) for sm_90a where the target is sm_90; the
// functions that emit sm_90a instructions sit under SPARKD_HAS_WGMMA, and so must every caller,
// so that other targets (sm_120) compile the including kernels with those parts left out.
#pragma once

#include "attention_common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SPARKD_HAS_WGMMA 1
#endif

namespace sparkd {
namespace wgmma {

constexpr int kWarpgroupThreads = 128;  // 4 consecutive warps, the first a multiple of 4
constexpr int kRowBytes = 128;          // a tile row: 64 16-bit elements of K
constexpr int kChunkBytes = 16;         // what the swizzle permutes, and one cp.async
constexpr int kChunksPerRow = kRowBytes / kChunkBytes;
constexpr int kSwizzleRows = 8;  // the 128-byte swizzle repeats every 8 rows
constexpr int kSwizzleBytes = kSwizzleRows * kRowBytes;
constexpr int kStepBytes = 32;       // the K of one wgmma: 16 16-bit elements
constexpr int kM64N256Outputs = 128;  // fp32 accumulators per thread of an m64n256 wgmma

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of kRowBytes rows in the 128-byte
// swizzle: the chunk index XOR the row's place in its 8-row group. This is the hardware's
// pattern (address bits 4-6 XOR bits 7-9) for a tile that starts on a kSwizzleBytes boundary.
__host__ __device__ constexpr int swizzled_offset(int row, int chunk) {
  return row * kRowBytes + (chunk ^ (row % kSwizzleRows)) * kChunkBytes;
}

// Row and column of this thread's accumulator element i in the 64 x N output of an m64nNk16
// wgmma: warp w of the warpgroup holds rows 16w .. 16w + 15; element i lies in the 8-column
// group i / 4, at row lane / 4 (+ 8 when i % 4 >= 2) and column 2 * (lane % 4) + i % 2 of it
// (the mma.sync m16n8 accumulator layout, once per column group).
__device__ __forceinline__ int accumulator_row(int i) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4;
  return 16 * warp + lane / 4 + 8 * (i % 4 / 2);
}

__device__ __forceinline__ int accumulator_col(int i) { return 8 * (i / 4) + 2 * (threadIdx.x % 4) + i % 2; }

// A place in a ring of kStages shared-memory stages: the stage, and the parity of the current
// pass over the ring, which is the phase a wait on that stage's barrier expects.
template <int kStages>
struct RingPosition {
  int stage = 0;
  unsigned phase = 0;

  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

#if defined(SPARKD_HAS_WGMMA)

// ---- mbarriers (shared addresses, 8-byte aligned) ----

__device__ __forceinline__ void mbarrier_init(unsigned barrier, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(arrivals) : "memory");
}

// Makes initialised barriers visible to the other threads (with the __syncthreads that follows)
// and to the asynchronous arrivals of cp.async.
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(unsigned barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(barrier) : "memory");
}

// One arrival on `barrier` once every cp.async this thread issued before it has landed; .noinc:
// the barrier's arrival count includes it.
__device__ __forceinline__ void mbarrier_arrive_on_copies(unsigned barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(barrier) : "memory");
}

// True once the phase of parity `phase` has completed (a fresh barrier counts parity 1 as done).
__device__ __forceinline__ bool mbarrier_try_wait(unsigned barrier, unsigned phase) {
  unsigned done;
  asm volatile(
      "{\n.reg .pred done;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%1], %2;\n"
      "selp.u32 %0, 1, 0, done;\n}\n"
      : "=r"(done)
      : "r"(barrier), "r"(phase)
      : "memory");
  return done != 0;
}

// Waits for the phase of parity `phase`. A pipeline whose counts or parities are wrong never
// completes one: after kWaitLimitNs this traps, a launch error the host reports, not a hung device.
constexpr unsigned long long kWaitLimitNs = 10'000'000'000ull;

__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(now));
  return now;
}

__device__ __forceinline__ void mbarrier_wait(unsigned barrier, unsigned phase) {
  if (mbarrier_try_wait(barrier, phase)) return;
  const unsigned long long start = globaltimer_ns();
  while (!mbarrier_try_wait(barrier, phase))
    if (globaltimer_ns() - start > kWaitLimitNs) __trap();
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Orders this thread's ordinary shared-memory writes before reads by the tensor cores (the async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- register budgets (the kernel needs __launch_bounds__(threads, 1); one role per branch) ----

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// ---- wgmma ----

// The descriptor of a K-major tile of kRowBytes rows in the 128-byte swizzle whose first row
// starts at shared address `start` (plus kStepBytes per 16-wide K step into the rows; the tile
// itself on a kSwizzleBytes boundary, so the base offset, bits 49-51, is 0). Bits 0-13: start
// >> 4; 16-29: the leading byte offset >> 4, unused when one row holds the K of a wgmma (1, as
// CUTLASS writes); 32-45: the stride byte offset >> 4, between 8-row groups; 62-63: swizzle
// mode 1, 128 bytes.
__device__ __forceinline__ unsigned long long tile_descriptor(unsigned start) {
  return static_cast<unsigned long long>((start & 0x3FFFF) >> 4) | (1ull << 16) |
         (static_cast<unsigned long long>(kSwizzleBytes >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most `kPending` of this warpgroup's committed wgmma groups are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// The tensor cores write the accumulators after the wgmma instruction returns: this keeps the
// compiler from moving reads or writes of them across a fence, commit or wait.
template <int N>
__device__ __forceinline__ void fence_operands(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

#define SPARKD_ACC8(i)                                                                                   \
  "+f"(acc[i]), "+f"(acc[i + 1]), "+f"(acc[i + 2]), "+f"(acc[i + 3]), "+f"(acc[i + 4]), "+f"(acc[i + 5]), \
      "+f"(acc[i + 6]), "+f"(acc[i + 7])

// acc += A . B^T for A [64, 16] and B [256, 16], both K-major in shared memory (descriptors a
// and b); acc in the layout of accumulator_row / accumulator_col. Asynchronous: issue between
// wgmma_fence and wgmma_commit, read acc after wgmma_wait.
#define SPARKD_WGMMA_M64N256K16(TYPE)                                                                           \
  asm volatile(                                                                                                 \
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %130, 0;\n"                                          \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {"                                         \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                        \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                        \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                        \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                        \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                        \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "            \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "       \
      "%128, %129, accumulate, 1, 1, 0, 0;\n}\n"                                                                \
      : SPARKD_ACC8(0), SPARKD_ACC8(8), SPARKD_ACC8(16), SPARKD_ACC8(24), SPARKD_ACC8(32), SPARKD_ACC8(40),     \
        SPARKD_ACC8(48), SPARKD_ACC8(56), SPARKD_ACC8(64), SPARKD_ACC8(72), SPARKD_ACC8(80), SPARKD_ACC8(88),   \
        SPARKD_ACC8(96), SPARKD_ACC8(104), SPARKD_ACC8(112), SPARKD_ACC8(120)                                   \
      : "l"(a), "l"(b), "r"(1))

template <typename T>
__device__ __forceinline__ void wgmma_m64n256k16(float (&acc)[kM64N256Outputs], unsigned long long a,
                                                 unsigned long long b);

template <>
__device__ __forceinline__ void wgmma_m64n256k16<__nv_bfloat16>(float (&acc)[kM64N256Outputs], unsigned long long a,
                                                               unsigned long long b) {
  SPARKD_WGMMA_M64N256K16("bf16");
}

template <>
__device__ __forceinline__ void wgmma_m64n256k16<__half>(float (&acc)[kM64N256Outputs], unsigned long long a,
                                                        unsigned long long b) {
  SPARKD_WGMMA_M64N256K16("f16");
}

#undef SPARKD_WGMMA_M64N256K16
#undef SPARKD_ACC8

#endif  // SPARKD_HAS_WGMMA

}  // namespace wgmma
}  // namespace sparkd
