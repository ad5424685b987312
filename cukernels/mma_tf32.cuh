// Warp-level fp32 products on the tensor cores: mma.sync m16n8k8 with tf32 operands and fp32
// accumulators, from fp32 matrices in shared memory. kTerms 1 rounds each operand to tf32
// (10-bit mantissa, ~2^-12 relative); kTerms 3 splits each into a tf32 head and a tf32 tail and
// adds the three products that matter (head*head, head*tail, tail*head), which keeps about fp32's
// precision at three times the tensor-core work ("3xTF32").
//
// Fragments (lane = 4 g + t, g = lane / 4, t = lane % 4), as the PTX ISA lays out m16n8k8 .tf32:
//   A 16x8 (row): a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
//   B 8x8 (col):  b0 (t, g), b1 (t + 4, g)
//   C 16x8:       c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1)
// Bank-conflict-free loads want row strides of 4 mod 32 floats for A read by rows and B read
// transposed, and 8 mod 32 for B read by rows and A read transposed.
#pragma once

namespace sparkd {

__device__ __forceinline__ unsigned to_tf32(float x) {
  unsigned bits;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x));
  return bits;
}

__device__ __forceinline__ void mma_tf32_raw(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a b for fp32 fragments a (16x8) and b (8x8), kTerms 1 or 3 (header).
template <int kTerms>
__device__ __forceinline__ void mma_f32(float (&d)[4], const float (&a)[4], const float (&b)[2]) {
  static_assert(kTerms == 1 || kTerms == 3, "one tf32 product, or three of the split operands");
  unsigned a_hi[4], b_hi[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) a_hi[i] = to_tf32(a[i]);
#pragma unroll
  for (int i = 0; i < 2; ++i) b_hi[i] = to_tf32(b[i]);
  if constexpr (kTerms == 3) {
    unsigned a_lo[4], b_lo[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) a_lo[i] = to_tf32(a[i] - __uint_as_float(a_hi[i]));
#pragma unroll
    for (int i = 0; i < 2; ++i) b_lo[i] = to_tf32(b[i] - __uint_as_float(b_hi[i]));
    mma_tf32_raw(d, a_lo, b_hi);  // the small terms first
    mma_tf32_raw(d, a_hi, b_lo);
  }
  mma_tf32_raw(d, a_hi, b_hi);
}

// A fragment at (m0, k0) of a row-major matrix (row stride ld).
__device__ __forceinline__ void load_a_rows(float (&a)[4], const float* m, int ld, int m0, int k0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const float* p = m + (m0 + g) * ld + k0 + t;
  a[0] = p[0];
  a[1] = p[8 * ld];
  a[2] = p[4];
  a[3] = p[8 * ld + 4];
}

// A fragment at (m0, k0) of the transpose of a row-major matrix: A[r][c] = m[c][r].
__device__ __forceinline__ void load_a_transposed(float (&a)[4], const float* m, int ld, int m0, int k0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const float* p = m + (k0 + t) * ld + m0 + g;
  a[0] = p[0];
  a[1] = p[8];
  a[2] = p[4 * ld];
  a[3] = p[4 * ld + 8];
}

// B fragment at (k0, n0) of a row-major [K][N] matrix (row stride ld).
__device__ __forceinline__ void load_b_rows(float (&b)[2], const float* m, int ld, int k0, int n0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const float* p = m + (k0 + t) * ld + n0 + g;
  b[0] = p[0];
  b[1] = p[4 * ld];
}

// B fragment at (k0, n0) of B = m^T, m row-major [N][K] (row stride ld): b = m[n0 + g][k0 + t (+ 4)].
__device__ __forceinline__ void load_b_transposed(float (&b)[2], const float* m, int ld, int k0, int n0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const float* p = m + (n0 + g) * ld + k0 + t;
  b[0] = p[0];
  b[1] = p[4];
}

}  // namespace sparkd
