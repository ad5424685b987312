// The fp32 attention path on CUDA cores: plain FMAs, no tensor cores and no
// TF32, so it matches numpy to rounding.
#pragma once

#include "attention_common.cuh"

namespace sparkd {
namespace attn {

// ---- fp32 on CUDA cores (exact path: no tensor cores, no TF32) ----
//
// A warp owns kFp32RowsPerWarp query rows. For Q K^T each lane takes one key of
// the 32-key tile; for P V each lane takes the dims lane, lane + 32, ...

constexpr int kFp32RowsPerWarp = 4;
constexpr int kFp32Rows = kWarps * kFp32RowsPerWarp;  // query rows per block
constexpr int kFp32Keys = 32;                          // keys per tile

template <int D>
struct Fp32Rows {
  static constexpr int R = kFp32RowsPerWarp, DL = D / 32;  // rows, dims per lane
  float o[R][DL];
  float m[R];  // running max, log2 units (identical in every lane)
  float l[R];  // running sum (identical in every lane)
};

// Attends the warp's rows (q_rows [R][D] in shared memory, already loaded or in
// flight) to keys [key_begin, key_end), row r seeing only keys <= last_key[r].
// smem_kv holds one K tile and one V tile [kFp32Keys][smem_ld]. All threads call it.
template <int D>
__device__ __forceinline__ void fp32_attend(Fp32Rows<D>& st, const float* q_rows, float* smem_kv,
                                            const PagedKV<float, D>& kv, int key_begin, int key_end,
                                            const int (&last_key)[kFp32RowsPerWarp], float scale_log2) {
  constexpr int R = kFp32RowsPerWarp, DL = D / 32, LD = smem_ld<float, D>();
  float* k_tile = smem_kv;
  float* v_tile = smem_kv + kFp32Keys * LD;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    st.m[r] = -infinity();
    st.l[r] = 0.f;
#pragma unroll
    for (int i = 0; i < DL; ++i) st.o[r][i] = 0.f;
  }
  pipelined_tiles<1>(
      ceil_div(key_end - key_begin, kFp32Keys),
      [&](int t, int) { load_kv_tile<float, D, kFp32Keys>(k_tile, v_tile, kv, key_begin + t * kFp32Keys, key_end); },
      [&](int t, int) {
        const int key = key_begin + t * kFp32Keys + lane;
        float s[R];
#pragma unroll
        for (int r = 0; r < R; ++r) s[r] = 0.f;
        // The pad of smem_ld puts the 8 lanes of each float4 phase in distinct banks.
        for (int d = 0; d < D; d += 4) {
          const float4 k4 = *reinterpret_cast<const float4*>(k_tile + lane * LD + d);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const float4 q4 = *reinterpret_cast<const float4*>(q_rows + r * LD + d);
            s[r] = fmaf(q4.x, k4.x, fmaf(q4.y, k4.y, fmaf(q4.z, k4.z, fmaf(q4.w, k4.w, s[r]))));
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          s[r] = key < key_end && key <= last_key[r] ? s[r] * scale_log2 : -infinity();
          const float m_new = fmaxf(st.m[r], warp_reduce(s[r], MaxOp()));
          const float ref = m_new == -infinity() ? 0.f : m_new;
          const float rescale = exp2f(st.m[r] - ref);
          s[r] = exp2f(s[r] - ref);
          st.l[r] = st.l[r] * rescale + warp_reduce(s[r], SumOp());
          st.m[r] = m_new;
#pragma unroll
          for (int i = 0; i < DL; ++i) st.o[r][i] *= rescale;
        }
        for (int j = 0; j < kFp32Keys; ++j) {
          float v[DL];
#pragma unroll
          for (int i = 0; i < DL; ++i) v[i] = v_tile[j * LD + lane + 32 * i];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const float p = __shfl_sync(kFullMask, s[r], j);
#pragma unroll
            for (int i = 0; i < DL; ++i) st.o[r][i] = fmaf(p, v[i], st.o[r][i]);
          }
        }
      });
}

}  // namespace attn
}  // namespace sparkd
