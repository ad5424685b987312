// Split-K for paged decode attention: how a sequence's keys are cut into
// splits and parts, where each part's result goes, the on-chip merges of a
// decode block's warps and of a cluster's blocks, and the merge of the parts by
// the block that stores the last of them (attention_decode.cu).
#pragma once

#include "attention_cluster.cuh"

namespace sparkd {
namespace attn {

// ---- split-K ----

// A sequence's keys are cut into splits of a multiple of kSplitAlign keys, at
// least min_keys long (a multiple of kSplitAlign chosen by the launcher's plan:
// a graph sized for long contexts must not cut a short one into tiny splits).
// Every block derives the split length from the device seq_len, so a short
// sequence in a grid planned for long ones fills only its first splits.
constexpr int kSplitAlign = 64;
constexpr int kDecodeRows = 16;  // query heads per decode block: one m-tile

// Keys per split when seq_len keys are shared by at most num_splits splits.
__device__ __forceinline__ int split_length(int seq_len, int num_splits, int min_keys) {
  const int even = ceil_div(ceil_div(seq_len, num_splits), kSplitAlign) * kSplitAlign;
  return max(even, min_keys);
}

// The keys [key_begin, key_end) that split `split` of a sequence covers, and how
// many parts of `per_part` splits hold keys (DecodePlan.parts_used in attention_plan.py).
// A sequence that fits in one part is written directly by that part.
struct DecodeSplit {
  int key_begin, key_end;
  int used_parts;

  __device__ bool direct() const { return used_parts == 1; }
};

__device__ __forceinline__ DecodeSplit decode_split(int seq_len, int split, int num_splits, int per_part,
                                                    int min_keys) {
  const int len = split_length(seq_len, num_splits, min_keys);
  return {split * len, min(seq_len, (split + 1) * len), ceil_div(seq_len, len * per_part)};
}

// Workspace: o_part [B, Hq, P, D] (normalised per part), lse_part [B, Hq, P] (log2).
// The slot of (sequence, packed row, part) in both.
__device__ __forceinline__ long long part_slot(const PackedRows& rows, int row, int seq, int part, int num_parts) {
  return (static_cast<long long>(seq) * rows.num_q_heads + rows.first_head + row) * num_parts + part;
}

// Where a decode block writes one query head: `out` when the part is direct,
// else the part's slot of the workspace, which merge_parts reduces.
template <typename T>
struct DecodeSink {
  T* out;       // the head's [D] in out
  float* part;  // the head's [D] in o_part for this part
  float* lse;   // the head's entry in lse_part for this part
  bool direct;

  __device__ void store(int d, float value) const {
    if (direct) out[d] = from_float<T>(value);
    else part[d] = value;
  }
  __device__ void store_pair(int d, float2 value) const {
    if (direct) store_floats<2>(out + d, {value.x, value.y});
    else *reinterpret_cast<float2*>(part + d) = value;
  }
  // lse2 = running max + log2(running sum), in log2 units.
  __device__ void store_lse(float lse2) const {
    if (!direct) *lse = lse2;
  }
};

template <typename T, int D>
__device__ __forceinline__ DecodeSink<T> decode_sink(T* out, float* o_part, float* lse_part, const PackedRows& rows,
                                                     int row, int seq, int part, int num_parts, bool direct) {
  const long long slot = part_slot(rows, row, seq, part, num_parts);
  return {out + rows.offset(row, D), o_part + slot * D, lse_part + slot, direct};
}

// ---- the parts' merge, by the block that stores the last part ----

// arrive_last (common.cuh) picks the block that merges.

// out rows = the parts merged by their log-sum-exps. Each thread owns 4 dims of a
// row and folds the parts in part order, so the result does not depend on which
// block arrived last. It loads kMergeBatch parts before folding any, so their
// trips to L2 (where the other SMs' stores are) overlap.
constexpr int kMergeBatch = 8;

template <typename T, int D>
__device__ __forceinline__ void merge_parts(T* out, const float* o_part, const float* lse_part,
                                            const PackedRows& rows, int first_row, int seq, int used_parts,
                                            int num_parts) {
  constexpr int VEC = 4, COLS = D / VEC;
  const int num_rows = min(kDecodeRows, rows.count() - first_row);
  for (int e = threadIdx.x; e < num_rows * COLS; e += kThreads) {
    const int r = e / COLS, d = (e % COLS) * VEC;
    const long long slot = part_slot(rows, first_row + r, seq, 0, num_parts);
    // Online softmax over the parts, in log2 units; every used part holds keys, so its lse is finite.
    float lse_max = -infinity(), total = 0.f, acc[VEC] = {0.f, 0.f, 0.f, 0.f};
    for (int p0 = 0; p0 < used_parts; p0 += kMergeBatch) {
      float lse[kMergeBatch];
      float4 o[kMergeBatch];
#pragma unroll
      for (int i = 0; i < kMergeBatch; ++i) {
        if (p0 + i >= used_parts) break;
        lse[i] = __ldcg(lse_part + slot + p0 + i);
        o[i] = __ldcg(reinterpret_cast<const float4*>(o_part + (slot + p0 + i) * D + d));
      }
#pragma unroll
      for (int i = 0; i < kMergeBatch; ++i) {
        if (p0 + i >= used_parts) break;
        const float new_max = fmaxf(lse_max, lse[i]);
        const float rescale = exp2f(lse_max - new_max), w = exp2f(lse[i] - new_max);
        total = fmaf(total, rescale, w);
        acc[0] = fmaf(acc[0], rescale, w * o[i].x);
        acc[1] = fmaf(acc[1], rescale, w * o[i].y);
        acc[2] = fmaf(acc[2], rescale, w * o[i].z);
        acc[3] = fmaf(acc[3], rescale, w * o[i].w);
        lse_max = new_max;
      }
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] /= total;
    store_floats<VEC>(out + rows.offset(first_row + r, D) + d, acc);
  }
}

// ---- merges of the bf16 / fp16 decode kernel ----

constexpr int kDecodeCluster = 8;  // splits per part of the bf16 / fp16 kernel: DECODE_CLUSTER in attention_plan.py

// Shared memory of the final merges, laid over the freed K/V tiles (floats):
// warp_o [kWarps][16][D], warp_m, warp_l, weight [kWarps][16], block_lse [16],
// rank_weight [16][kDecodeCluster], row_lse [16]: (64 D + 352) * 4 bytes.
template <int D>
struct DecodeMergeSmem {
  float* warp_o;       // each warp's unnormalised output; warp 0's becomes the block's normalised one
  float* warp_m;       // each warp's running max per row
  float* warp_l;       // each warp's running sum per row
  float* weight;       // each warp's share of a row
  float* block_lse;    // the block's log2-sum-exp per row; -inf when its split holds no key
  float* rank_weight;  // each cluster block's share of a row
  float* row_lse;      // the part's log2-sum-exp per row

  __device__ explicit DecodeMergeSmem(unsigned char* smem)
      : warp_o(reinterpret_cast<float*>(smem)),
        warp_m(warp_o + kWarps * kDecodeRows * D),
        warp_l(warp_m + kWarps * kDecodeRows),
        weight(warp_l + kWarps * kDecodeRows),
        block_lse(weight + kWarps * kDecodeRows),
        rank_weight(block_lse + kDecodeRows),
        row_lse(rank_weight + kDecodeRows * kDecodeCluster) {}
};

// Merges the four warps' softmax states into the block's normalised output
// (in warp_o's first [16][D]) and its log-sum-exp per row. Only the first
// num_rows rows are real heads (a GQA group of 4 fills a quarter of the m-tile),
// so only they are moved through shared memory; the rest of warp_o is never read.
template <int D>
__device__ __forceinline__ void merge_warps(const DecodeMergeSmem<D>& sm, const float (&m)[1][2],
                                            const float (&l)[1][2], const float (&o)[1][D / 8][4], int num_rows) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warp * kDecodeRows + lane / 4 + 8 * half;
    if (lane / 4 + 8 * half < num_rows) {
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<float2*>(sm.warp_o + r * D + dt * 8 + (lane % 4) * 2) =
            make_float2(o[0][dt][2 * half], o[0][dt][2 * half + 1]);
    }
    if (lane % 4 == 0) {
      sm.warp_m[r] = m[0][half];
      sm.warp_l[r] = l[0][half];
    }
  }
  __syncthreads();
  if (threadIdx.x < kDecodeRows) {
    const int r = threadIdx.x;
    float row_max = -infinity();
    for (int w = 0; w < kWarps; ++w) row_max = fmaxf(row_max, sm.warp_m[w * kDecodeRows + r]);
    // Warps that saw no key have m = -inf and weigh 0; a block whose split is
    // empty has no key at all and weighs 0 in the cluster merge (lse -inf).
    const float ref = row_max == -infinity() ? 0.f : row_max;
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += sm.warp_l[w * kDecodeRows + r] * exp2f(sm.warp_m[w * kDecodeRows + r] - ref);
    for (int w = 0; w < kWarps; ++w)
      sm.weight[w * kDecodeRows + r] = total > 0.f ? exp2f(sm.warp_m[w * kDecodeRows + r] - ref) / total : 0.f;
    sm.block_lse[r] = total > 0.f ? row_max + log2f(total) : -infinity();
  }
  __syncthreads();
  // Each element is read and rewritten by one thread only, so warp 0's rows take the result in place.
  for (int e = threadIdx.x; e < num_rows * D; e += kThreads) {
    const int r = e / D;
    float value = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) value = fmaf(sm.warp_o[w * kDecodeRows * D + e], sm.weight[w * kDecodeRows + r], value);
    sm.warp_o[e] = value;
  }
}

// Merges the blocks of a cluster (CLUSTER splits of one part) and stores the
// part's rows: block `rank` produces dims [rank * D / CLUSTER, ...) of every row,
// reading the other blocks' outputs from their shared memory.
template <typename T, int D, int CLUSTER>
__device__ __forceinline__ void merge_cluster(const DecodeMergeSmem<D>& sm, int rank, T* out, float* o_part,
                                              float* lse_part, const PackedRows& rows, int first_row, int seq,
                                              int part, int num_parts, bool direct) {
  constexpr int SLICE = D / CLUSTER, PAIRS = SLICE / 2;
  static_assert(kDecodeRows * CLUSTER <= kThreads && 32 % CLUSTER == 0, "one thread per (row, cluster block)");
  cluster_sync<CLUSTER>();  // every block's output and log-sum-exp are in its shared memory
  if (threadIdx.x < kDecodeRows * CLUSTER) {
    // CLUSTER consecutive lanes hold one row, one cluster block each.
    const int r = threadIdx.x / CLUSTER, c = threadIdx.x % CLUSTER;
    const float lse = load_from_rank<CLUSTER>(sm.block_lse + r, c);
    float lse_max = lse;
#pragma unroll
    for (int offset = CLUSTER / 2; offset > 0; offset /= 2)
      lse_max = fmaxf(lse_max, __shfl_xor_sync(kFullMask, lse_max, offset));
    // The part's first split always holds keys, so lse_max is finite.
    const float w = exp2f(lse - lse_max);
    float total = w;
#pragma unroll
    for (int offset = CLUSTER / 2; offset > 0; offset /= 2) total += __shfl_xor_sync(kFullMask, total, offset);
    sm.rank_weight[r * CLUSTER + c] = w / total;
    if (c == 0) sm.row_lse[r] = lse_max + log2f(total);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kDecodeRows * PAIRS; e += kThreads) {
    const int r = e / PAIRS, d = rank * SLICE + (e % PAIRS) * 2;
    if (first_row + r >= rows.count()) break;
    float2 value = make_float2(0.f, 0.f);
#pragma unroll
    for (int c = 0; c < CLUSTER; ++c) {
      const float2 o = load_from_rank<CLUSTER>(reinterpret_cast<const float2*>(sm.warp_o + r * D + d), c);
      const float w = sm.rank_weight[r * CLUSTER + c];
      value = make_float2(fmaf(w, o.x, value.x), fmaf(w, o.y, value.y));
    }
    const DecodeSink<T> sink = decode_sink<T, D>(out, o_part, lse_part, rows, first_row + r, seq, part, num_parts, direct);
    sink.store_pair(d, value);
    if (d == 0) sink.store_lse(sm.row_lse[r]);
  }
  if constexpr (CLUSTER > 1) cluster_sync<CLUSTER>();  // the others may still read this block's shared memory
}

}  // namespace attn
}  // namespace sparkd
