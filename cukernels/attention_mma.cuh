// The per-warp tensor-core steps of flash attention for bf16 / fp16:
// S = Q K^T, online softmax, O += P V (mma.sync m16n8k16, fp32 accumulators).
#pragma once

#include "attention_common.cuh"

namespace sparkd {
namespace attn {

// ---- tensor cores: mma.sync m16n8k16, fp32 accumulators ----
//
// Fragment layouts (PTX ISA), g = lane / 4, c = lane % 4:
//   A 16x16 (4 regs): {row g, cols 2c..2c+1}, {row g+8, same}, {row g, cols 2c+8..}, {row g+8, cols 2c+8..}
//   B 16x8  (2 regs): {rows 2c..2c+1, col g}, {rows 2c+8..2c+9, col g}
//   C 16x8  (4 f32):  (g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1)

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                                        unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned short bits_of(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ unsigned short bits_of(__half x) { return __half_as_ushort(x); }

// Two floats rounded to T and packed in one register, `lo` in the low half (mma operand order).
template <typename T>
__device__ __forceinline__ unsigned pack_pair(float lo, float hi) {
  return bits_of(from_float<T>(lo)) | static_cast<unsigned>(bits_of(from_float<T>(hi))) << 16;
}

// ---- one warp's flash-attention steps on MT m-tiles (16 query rows each) ----
//
// s[mt][nt][e] holds scores of m-tile mt and key n-tile nt (8 keys); o[mt][dt][e]
// the output of m-tile mt and dim n-tile dt. Element e sits at row g + 8 * (e / 2),
// column 2c + e % 2 of its tile. m and l hold each row's running max and sum
// (l only over this lane's columns until finish_rows reduces it).

// s = Q K^T for q_rows [MT * 16][LD] and keys [NT * 8][LD] in shared memory.
template <typename T, int D, int MT, int NT>
__device__ __forceinline__ void warp_qk(float (&s)[MT][NT][4], const T* q_rows, const T* keys, int lane) {
  static_assert(NT % 2 == 0, "keys come in pairs of n-tiles (16 keys)");
  constexpr int LD = smem_ld<T, D>();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
  for (int k0 = 0; k0 < D; k0 += 16) {
    unsigned a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      ldmatrix_x4(a[mt], q_rows + (mt * 16 + lane % 16) * LD + k0 + (lane / 16) * 8);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      // Matrices: keys 0-7 dims 0-7, keys 0-7 dims 8-15, keys 8-15 dims 0-7, keys 8-15 dims 8-15.
      unsigned b[4];
      ldmatrix_x4(b, keys + (np * 16 + lane % 8 + (lane / 16) * 8) * LD + k0 + ((lane / 8) % 2) * 8);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<T>(s[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Scales scores to log2 units; with `masked`, keys past a row's last_key become -inf.
template <int MT, int NT>
__device__ __forceinline__ void scale_and_mask(float (&s)[MT][NT][4], float scale_log2, bool masked, int key0,
                                               const int (&last_key)[MT][2], int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + nt * 8 + (lane % 4) * 2 + e % 2;
        s[mt][nt][e] = masked && key > last_key[mt][e / 2] ? -infinity() : s[mt][nt][e] * scale_log2;
      }
}

// Online softmax: folds the tile's scores into (m, l), rescales o, and turns s into P.
template <int MT, int NT, int DT>
__device__ __forceinline__ void online_softmax(float (&s)[MT][NT][4], float (&m)[MT][2], float (&l)[MT][2],
                                               float (&o)[MT][DT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float tile_max = -infinity();
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) tile_max = fmaxf(tile_max, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
      // The 4 lanes of a quad hold one row.
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
      const float m_new = fmaxf(m[mt][half], tile_max);
      // A row with every key masked so far keeps m = -inf; subtracting 0 keeps P = 0, not NaN.
      const float ref = m_new == -infinity() ? 0.f : m_new;
      const float rescale = exp2f(m[mt][half] - ref);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          s[mt][nt][e] = exp2f(s[mt][nt][e] - ref);
          sum += s[mt][nt][e];
        }
      l[mt][half] = l[mt][half] * rescale + sum;
      m[mt][half] = m_new;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        o[mt][dt][2 * half] *= rescale;
        o[mt][dt][2 * half + 1] *= rescale;
      }
    }
}

// o += P V for P (in s, accumulator layout) and values [NT * 8][LD] in shared memory.
template <typename T, int D, int MT, int NT>
__device__ __forceinline__ void warp_pv(float (&o)[MT][D / 8][4], const float (&p)[MT][NT][4], const T* values,
                                        int lane) {
  constexpr int LD = smem_ld<T, D>();
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    // The C layout of two key n-tiles is the A layout of one 16-key k-step.
    unsigned a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      a[mt][0] = pack_pair<T>(p[mt][2 * kk][0], p[mt][2 * kk][1]);
      a[mt][1] = pack_pair<T>(p[mt][2 * kk][2], p[mt][2 * kk][3]);
      a[mt][2] = pack_pair<T>(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
      a[mt][3] = pack_pair<T>(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int d0 = 0; d0 < D; d0 += 16) {
      // Transposed matrices: keys 0-7 dims 0-7, keys 8-15 dims 0-7, keys 0-7 dims 8-15, keys 8-15 dims 8-15.
      unsigned b[4];
      ldmatrix_x4_trans(b, values + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD + d0 + (lane / 16) * 8);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<T>(o[mt][d0 / 8], a[mt], b[0], b[1]);
        mma_16816<T>(o[mt][d0 / 8 + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Completes each row's sum over the 4 lanes of its quad.
template <int MT>
__device__ __forceinline__ void finish_rows(float (&l)[MT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      l[mt][half] += __shfl_xor_sync(kFullMask, l[mt][half], 1);
      l[mt][half] += __shfl_xor_sync(kFullMask, l[mt][half], 2);
    }
}

}  // namespace attn
}  // namespace sparkd
