// Expert GEMMs of a mixture-of-experts layer at decode-sized batches: each selected
// expert's two projections run on the rows routed to it, and on nothing else.
//
// Shapes: T tokens, k choices each, P = T * k (token, expert) pairs (pair p = t * k + j),
// E experts, H hidden size, I expert intermediate size.
//   gate_up [E, 2I, H] = [gate | up] per expert, down [E, H, I], both row-major;
//   from the alignment kernel (moe_routing.cu), all int32:
//   sorted_pairs [P]      pair ids in expert order ("sorted rows");
//   offsets [E + 1]       expert e owns sorted rows offsets[e] .. offsets[e + 1] - 1;
//   active_experts [min(E, P)], num_active [1]: the experts with rows, the first
//                         num_active entries used.
//
// At such batches the products are bound by streaming the chosen experts' weights once.
// The bf16 / fp16 arithmetic runs on the tensor cores so that it stays negligible whatever
// an expert's row count, and the weights go from memory straight into mma operands:
// - a warp owns a tile of 16 weight rows (gate_up: 8 gate rows and the up rows of the
//   same 8 hidden columns, so SiLU-and-mul needs no exchange) over all of K, or over one
//   of k_split slices of K, whose partial tiles meet in shared memory once per pass;
// - for bf16 / fp16 the tile is the A operand of mma.sync m16n8k16. Lane c of each quad
//   loads one 16-byte chunk of the quad's two weight rows and the same chunk of its
//   activation row and uses them as its A and B fragments: the k order inside an mma is
//   not memory's, but it is the same for A and B, so each weight still meets its own
//   activation;
// - fp32 is the parity mode: the same tiles and loads, but on the CUDA cores with IEEE
//   fp32 FMA in a fixed order (the tensor cores' fp32 / tf32 sums are not accurate to
//   1e-5 over a long K). Each lane sums its own chunks of its two weight rows against all
//   8 activation rows of the group (taken from the other quads by shuffles), and the
//   quad adds its four partial sums at the end of the pass;
// - a warp issues kBatchSteps k-steps of weight loads (16 of 16 bytes a lane for 16-bit
//   types) before it uses any; the weights are read once, evict-first, the activation
//   rows (shared by every warp of the block, all on one expert) stay cached;
// - an expert's sorted rows run kM at a time (kM / 8 mma columns) against the weights:
//   one pass over an expert's weights serves up to kM of its rows, and groups of 8 past
//   its row count are skipped, so kM costs registers only. An expert with more rows
//   streams its weights again per kM rows.
// Grid dim y has one slot per possible active expert; a slot past num_active exits at
// once, so an expert no token chose is never read, and the grid depends only on
// (T, k, E): graph-capturable, with no atomics and no workspace (deterministic).
// A block's start is one dependent read (its slot's expert) before its first weights are
// asked for: those go to L2 while the expert's row range and activation rows are read.
#include "attention_mma.cuh"
#include "gemv_common.cuh"

using namespace sparkd;
using attn::mma_16816;

constexpr int kWarps = 4;        // warps per block
constexpr int kTileRows = 16;    // weight rows per warp tile: the mma's m
constexpr int kGroupRows = 8;    // sorted rows per mma: its n
constexpr int kStepChunks = 4;   // 16-byte chunks of a row per k-step: one per lane of a quad
// k-steps of weight loads a warp issues before using any: 16 loads of 16 bytes a lane,
// a quarter as many for fp32 (the parity mode), whose CUDA-core sums take 16 registers a group.
template <typename T>
constexpr int kBatchSteps = sizeof(T) == 2 ? 8 : 2;
constexpr int kGateUpCols = kTileRows / 2;  // hidden columns per gate_up tile
constexpr int kMinBlocksPerSm = 3;  // 12 warps an SM (up to 168 registers each: no spills) keep ~100 KB in flight

// ---- a warp tile's sums over its k-steps ----
//
// Lane (g = lane / 4, c = lane % 4) holds, each k-step, chunk c of weight rows g (w_lo)
// and g + 8 (w_hi) of the tile and of activation row g of the group (act). fragment()
// gives the 16 x 8 sums in the mma's C layout: element e of lane (g, c) is weight row
// g + 8 * (e / 2) against activation row 2c + e % 2.

// bf16 / fp16: the C fragment of m16n8k16 mma. Each chunk feeds two mma: its words x, y
// the first and z, w the second, filling k slots 2c, 2c + 1, 2c + 8, 2c + 9 in the same
// order for A and B.
template <typename T>
struct TileSums {
  float c[4] = {};

  __device__ __forceinline__ void step(const uint4& w_lo, const uint4& w_hi, const uint4& act) {
    const unsigned first[4] = {w_lo.x, w_hi.x, w_lo.y, w_hi.y};
    const unsigned second[4] = {w_lo.z, w_hi.z, w_lo.w, w_hi.w};
    mma_16816<T>(c, first, act.x, act.y);
    mma_16816<T>(c, second, act.z, act.w);
  }

  __device__ __forceinline__ void fragment(float (&out)[4]) const {
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = c[e];
  }
};

// fp32: part[r][j] = this lane's chunks of weight row g + 8r . activation row j, summed
// by fmaf in k order; the quad's four lanes cover disjoint chunks of every k-step.
template <>
struct TileSums<float> {
  float part[2][kGroupRows] = {};

  __device__ __forceinline__ void step(const uint4& w_lo, const uint4& w_hi, const uint4& act) {
    const int c = threadIdx.x % kStepChunks;
#pragma unroll
    for (int j = 0; j < kGroupRows; ++j) {  // chunk c of activation row j, from lane (j, c)
      const int src = j * kStepChunks + c;
      const float a[4] = {__uint_as_float(__shfl_sync(kFullMask, act.x, src)),
                          __uint_as_float(__shfl_sync(kFullMask, act.y, src)),
                          __uint_as_float(__shfl_sync(kFullMask, act.z, src)),
                          __uint_as_float(__shfl_sync(kFullMask, act.w, src))};
      part[0][j] = dot_chunk(part[0][j], w_lo, a);
      part[1][j] = dot_chunk(part[1][j], w_hi, a);
    }
  }

  // The quad's sums in two exchanges, each lane keeping half the columns it still holds:
  // lanes c < 2 columns 0..3, then even c the first two of those, so lane c ends with
  // columns 2c, 2c + 1. Every sum is formed once, so all lanes agree on its rounding.
  __device__ __forceinline__ void fragment(float (&out)[4]) const {
    const int c = threadIdx.x % kStepChunks;
    float half[2][kGroupRows / 2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int j = 0; j < kGroupRows / 2; ++j) half[r][j] = keep_half(part[r][j], part[r][j + 4], c & 2, 2);
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int j = 0; j < 2; ++j) out[2 * r + j] = keep_half(half[r][j], half[r][j + 2], c & 1, 1);
  }

 private:
  __device__ static __forceinline__ float dot_chunk(float sum, const uint4& w, const float (&a)[4]) {
    sum = fmaf(__uint_as_float(w.x), a[0], sum);
    sum = fmaf(__uint_as_float(w.y), a[1], sum);
    sum = fmaf(__uint_as_float(w.z), a[2], sum);
    return fmaf(__uint_as_float(w.w), a[3], sum);
  }

  // This lane's column of a pair (low half unless `upper`) plus the partner lane's
  // (lane ^ lane_mask, which keeps the other) same column.
  __device__ static __forceinline__ float keep_half(float low, float high, bool upper, int lane_mask) {
    return (upper ? high : low) + __shfl_xor_sync(kFullMask, upper ? low : high, lane_mask);
  }
};

// ---- one warp tile against kM sorted rows ----

// A row as 16-byte chunks, from this lane's chunk of each k-step on.
template <typename T>
__device__ __forceinline__ const uint4* lane_chunks(const T* row) {
  return reinterpret_cast<const uint4*>(row) + threadIdx.x % kStepChunks;
}

// This lane's chunks of a K slice ending at step_end are chunks c (as offsets from its
// lane_chunks row pointer) with c < the bound returned.
__device__ __forceinline__ int lane_chunk_end(int step_end, int num_chunks) {
  return min(step_end * kStepChunks, num_chunks) - static_cast<int>(threadIdx.x % kStepChunks);
}

// Asks L2 for this lane's weight chunks of the first batch of its K slice; issued before
// the block reads which rows it runs, so their DRAM latency overlaps those reads.
template <typename T>
__device__ __forceinline__ void prefetch_first_batch(const uint4* w_lo, const uint4* w_hi, int step_begin,
                                                     int step_end, int num_chunks) {
  const int chunk_end = lane_chunk_end(step_end, num_chunks);
#pragma unroll
  for (int u = 0; u < kBatchSteps<T>; ++u) {
    const int chunk = (step_begin + u) * kStepChunks;
    if (chunk < chunk_end) {
      prefetch_l2(w_lo + chunk);
      prefetch_l2(w_hi + chunk);
    }
  }
}

// acc[grp] = (weight rows g, g + 8 of the tile) . (sorted row grp * 8 + g of the pass) over
// k-steps [step_begin, step_end) as C fragments (TileSums), for the first num_groups
// groups (the others zero); w_lo / w_hi / act[grp] are this lane's rows (g = lane / 4) as
// 16-byte chunks, each already offset by its lane of the quad. Chunks past num_chunks
// count as zeros. Every lane of the warp must call it.
template <typename T, int kGroups>
__device__ __forceinline__ void accumulate_tile(float (&acc)[kGroups][4], const uint4* w_lo, const uint4* w_hi,
                                                const uint4* const (&act)[kGroups], int num_groups, int step_begin,
                                                int step_end, int num_chunks) {
  constexpr int kSteps = kBatchSteps<T>;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  const int chunk_end = lane_chunk_end(step_end, num_chunks);
  TileSums<T> sums[kGroups];
  for (int step0 = step_begin; step0 < step_end; step0 += kSteps) {
    uint4 lo[kSteps], hi[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int chunk = (step0 + u) * kStepChunks;
      lo[u] = chunk < chunk_end ? __ldcs(w_lo + chunk) : zero;
      hi[u] = chunk < chunk_end ? __ldcs(w_hi + chunk) : zero;
    }
    // Group by group, each a straight run of loads and mma that the compiler can schedule
    // freely (steps past the slice multiply zeros); group 0 always holds rows.
#pragma unroll
    for (int grp = 0; grp < kGroups; ++grp) {
      if (grp > 0 && grp >= num_groups) break;
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        const int chunk = (step0 + u) * kStepChunks;
        sums[grp].step(lo[u], hi[u], chunk < chunk_end ? __ldg(act[grp] + chunk) : zero);
      }
    }
  }
#pragma unroll
  for (int grp = 0; grp < kGroups; ++grp) sums[grp].fragment(acc[grp]);
}

// Runs the sorted rows expert_rows[0] .. expert_rows[1] - 1 of one expert (its entries of
// offsets) against this warp's weight tile (rows w_lo, w_hi of this lane; `live` false for
// a tile past the matrix, uniform over the warp), kM rows a pass.
// act_row(row) -> const T*: the activation row of a sorted row. The k_split warps of a
// tile (consecutive in the block) take one slice of K each and meet in shared memory;
// the first then calls store(acc, row0, num_rows), where acc[grp][e] is the C fragment
// of group grp for sorted rows row0 + grp * 8 + 2c + e % 2 (c = lane % 4) and weight
// row g + 8 * (e / 2) of the tile. Every thread of the block must call it.
template <typename T, int kM, typename ActRow, typename Store>
__device__ __forceinline__ void run_expert_rows(const T* w_lo, const T* w_hi, bool live, const int* expert_rows,
                                                int num_chunks, int k_split, ActRow act_row, Store store) {
  constexpr int kGroups = kM / kGroupRows;
  __shared__ float partial[kWarps][kGroups][4][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, slice = warp % k_split;
  const int num_steps = (num_chunks + kStepChunks - 1) / kStepChunks;
  const int slice_steps = (num_steps + k_split - 1) / k_split;
  const int step_begin = slice * slice_steps, step_end = min(num_steps, step_begin + slice_steps);
  if (live) prefetch_first_batch<T>(lane_chunks(w_lo), lane_chunks(w_hi), step_begin, step_end, num_chunks);
  const int begin = expert_rows[0], end = expert_rows[1];
  for (int row0 = begin; row0 < end; row0 += kM) {
    const int num_rows = min(kM, end - row0);
    const uint4* act[kGroups];  // rows past the pass re-read its last row; their sums are never stored
#pragma unroll
    for (int grp = 0; grp < kGroups; ++grp) {
      act[grp] = lane_chunks(act_row(row0 + min(grp * kGroupRows + lane / 4, num_rows - 1)));
    }
    float acc[kGroups][4] = {};
    if (live) {
      accumulate_tile<T, kGroups>(acc, lane_chunks(w_lo), lane_chunks(w_hi), act,
                                  (num_rows + kGroupRows - 1) / kGroupRows, step_begin, step_end, num_chunks);
    }
    if (k_split > 1) {
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp)
#pragma unroll
        for (int e = 0; e < 4; ++e) partial[warp][grp][e][lane] = acc[grp][e];
      __syncthreads();
      if (slice == 0) {
        for (int other = 1; other < k_split; ++other)
#pragma unroll
          for (int grp = 0; grp < kGroups; ++grp)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[grp][e] += partial[warp + other][grp][e][lane];
      }
    }
    if (slice == 0 && live) store(acc, row0, num_rows);
    if (k_split > 1) __syncthreads();  // the next pass rewrites partial
  }
}

// The expert in this block's slot (grid dim y): false for a slot past num_active. Both
// are read at once (the slot is inside active_experts whatever num_active says), so the
// block waits for one read before it asks for weights.
__device__ __forceinline__ bool slot_expert(const int* active_experts, const int* num_active, int& expert) {
  const int active = *num_active;
  expert = active_experts[blockIdx.y];
  return static_cast<int>(blockIdx.y) < active;
}

// This warp's tile: blocks hold kWarps / k_split tiles of k_split consecutive warps.
__device__ __forceinline__ int warp_tile(int k_split) {
  return blockIdx.x * (kWarps / k_split) + static_cast<int>(threadIdx.x / 32) / k_split;
}

// hidden[row, col] = silu(x[tok] . gate[e, col]) * (x[tok] . up[e, col]) for every sorted
// row of expert e, tok = sorted_pairs[row] / top_k; silu(g) = g / (1 + exp(-g)).
// hidden [P, I] contiguous, x [T, H] (row stride ld_x), gate_up [E, 2I, H] contiguous.
// Launch: grid (ceil(ceil(I / 8) * k_split / kWarps), min(E, P)), 32 * kWarps threads;
// k_split in {1, 2, 4}. Preconditions (checked by the launcher): H, I and ld_x are
// multiples of a 16-byte chunk; x and gate_up are 16-byte aligned.
template <typename T, int kM>
__global__ void __launch_bounds__(32 * kWarps, kMinBlocksPerSm)
    moe_gate_up_kernel(T* __restrict__ hidden, const T* __restrict__ x, const T* __restrict__ gate_up,
                       const int* __restrict__ sorted_pairs, const int* __restrict__ offsets,
                       const int* __restrict__ active_experts, const int* __restrict__ num_active, int top_k,
                       int hidden_size, int inter_size, long long ld_x, int k_split) {
  int expert;
  if (!slot_expert(active_experts, num_active, expert)) return;
  const int lane = threadIdx.x % 32, tile = warp_tile(k_split);
  const int col = tile * kGateUpCols + lane / 4;  // this lane's hidden column: A rows g (gate), g + 8 (up)
  const int row = min(col, inter_size - 1);       // a partial tile's lanes past I re-read the last column
  const T* expert_w = gate_up + static_cast<long long>(expert) * 2 * inter_size * hidden_size;
  const T* gate = expert_w + static_cast<long long>(row) * hidden_size;
  const T* up = expert_w + static_cast<long long>(inter_size + row) * hidden_size;
  const auto x_row = [&](int sorted_row) {
    return x + static_cast<long long>(sorted_pairs[sorted_row] / top_k) * ld_x;
  };
  const auto store = [&](const float (&acc)[kM / kGroupRows][4], int row0, int num_rows) {
    if (col >= inter_size) return;
#pragma unroll
    for (int grp = 0; grp < kM / kGroupRows; ++grp)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = grp * kGroupRows + 2 * (lane % 4) + e;
        if (m >= num_rows) continue;
        const float g = acc[grp][e], u = acc[grp][2 + e];
        hidden[static_cast<long long>(row0 + m) * inter_size + col] = from_float<T>(g / (1.f + expf(-g)) * u);
      }
  };
  run_expert_rows<T, kM>(gate, up, tile * kGateUpCols < inter_size, offsets + expert, hidden_size / (16 / sizeof(T)),
                         k_split, x_row, store);
}

// expert_out[row, h] = hidden[row] . down[e, h] for every sorted row of expert e, summed in fp32
// and rounded to T. expert_out [P, H], hidden [P, I], down [E, H, I], all in T and contiguous.
// Launch: grid (ceil(ceil(H / 16) * k_split / kWarps), min(E, P)), 32 * kWarps threads;
// k_split in {1, 2, 4}. Preconditions (checked by the launcher): H and I are multiples
// of a 16-byte chunk; hidden and down are 16-byte aligned.
template <typename T, int kM>
__global__ void __launch_bounds__(32 * kWarps, kMinBlocksPerSm)
    moe_down_kernel(T* __restrict__ expert_out, const T* __restrict__ hidden, const T* __restrict__ down,
                    const int* __restrict__ offsets, const int* __restrict__ active_experts,
                    const int* __restrict__ num_active, int hidden_size, int inter_size, int k_split) {
  int expert;
  if (!slot_expert(active_experts, num_active, expert)) return;
  const int lane = threadIdx.x % 32, tile = warp_tile(k_split);
  const int h_lo = tile * kTileRows + lane / 4, h_hi = h_lo + kTileRows / 2;  // A rows g and g + 8
  const T* expert_w = down + static_cast<long long>(expert) * hidden_size * inter_size;
  // A partial tile's rows past H re-read the last row.
  const T* w_lo = expert_w + static_cast<long long>(min(h_lo, hidden_size - 1)) * inter_size;
  const T* w_hi = expert_w + static_cast<long long>(min(h_hi, hidden_size - 1)) * inter_size;
  const auto hidden_row = [&](int sorted_row) { return hidden + static_cast<long long>(sorted_row) * inter_size; };
  const auto store = [&](const float (&acc)[kM / kGroupRows][4], int row0, int num_rows) {
#pragma unroll
    for (int grp = 0; grp < kM / kGroupRows; ++grp)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = grp * kGroupRows + 2 * (lane % 4) + e;
        if (m >= num_rows) continue;
        T* out = expert_out + static_cast<long long>(row0 + m) * hidden_size;
        if (h_lo < hidden_size) out[h_lo] = from_float<T>(acc[grp][e]);
        if (h_hi < hidden_size) out[h_hi] = from_float<T>(acc[grp][2 + e]);
      }
  };
  run_expert_rows<T, kM>(w_lo, w_hi, tile * kTileRows < hidden_size, offsets + expert, inter_size / (16 / sizeof(T)),
                         k_split, hidden_row, store);
}
