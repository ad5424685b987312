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

__device__ __forceinline__ unsigned tf32_bits(float x) {
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

// An operand fragment of N floats as tf32: its head, and for kTerms 3 its tail. Converted once,
// it serves every product that reads it.
template <int kTerms, int N>
struct Tf32Fragment {
  static_assert(kTerms == 1 || kTerms == 3, "one tf32 product, or three of the split operands");
  unsigned hi[N], lo[kTerms == 3 ? N : 1];
};

template <int kTerms, int N>
__device__ __forceinline__ Tf32Fragment<kTerms, N> to_tf32(const float (&x)[N]) {
  Tf32Fragment<kTerms, N> f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    f.hi[i] = tf32_bits(x[i]);
    if constexpr (kTerms == 3) f.lo[i] = tf32_bits(x[i] - __uint_as_float(f.hi[i]));
  }
  return f;
}

// Operands that many products read are rounded once, where they are stored, when the product
// takes one tf32 term: keep_tf32 stores x so, and stored_tf32 reads the values back with no
// conversion (the same bits cvt.rna gives: it leaves a tf32 value as it is). With kTerms 3 the
// tail is needed, so keep_tf32 keeps x whole and stored_tf32 splits it.
template <int kTerms>
__device__ __forceinline__ float keep_tf32(float x) {
  return kTerms == 1 ? __uint_as_float(tf32_bits(x)) : x;
}

template <int kTerms, int N>
__device__ __forceinline__ Tf32Fragment<kTerms, N> stored_tf32(const float (&x)[N]) {
  if constexpr (kTerms == 1) {
    Tf32Fragment<1, N> f;
#pragma unroll
    for (int i = 0; i < N; ++i) f.hi[i] = __float_as_uint(x[i]);
    return f;
  } else {
    return to_tf32<kTerms>(x);
  }
}

// d += a b for fragments a (16x8) and b (8x8).
template <int kTerms>
__device__ __forceinline__ void mma_tf32(float (&d)[4], const Tf32Fragment<kTerms, 4>& a,
                                         const Tf32Fragment<kTerms, 2>& b) {
  if constexpr (kTerms == 3) {
    mma_tf32_raw(d, a.lo, b.hi);  // the small terms first
    mma_tf32_raw(d, a.hi, b.lo);
  }
  mma_tf32_raw(d, a.hi, b.hi);
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
