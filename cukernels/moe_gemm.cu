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
// The arithmetic runs on the tensor cores so that it stays negligible whatever an
// expert's row count, and the weights go from memory straight into mma operands:
// - a warp owns a tile of 16 weight rows (gate_up: 8 gate rows and the up rows of the
//   same 8 hidden columns, so SiLU-and-mul needs no exchange) over all of K, or over one
//   of k_split slices of K, whose partial tiles meet in shared memory once per pass;
// - the tile is the A operand of mma.sync (m16n8k16 for bf16 / fp16; three m16n8k8 tf32
//   on split operands for fp32, which keeps fp32 accuracy). Lane c of each quad loads one
//   16-byte chunk of the quad's two weight rows and the same chunk of its activation row
//   and uses them as its A and B fragments: the k order inside an mma is not memory's,
//   but it is the same for A and B, so each weight still meets its own activation;
// - a warp issues kBatchSteps k-steps of weight loads (16 of 16 bytes a lane) before it
//   uses any; the weights are read once, evict-first, the activation rows (shared by
//   every warp of the block, all on one expert) stay cached;
// - an expert's sorted rows run kM at a time (kM / 8 mma columns) against the weights:
//   one pass over an expert's weights serves up to kM of its rows, and groups of 8 past
//   its row count are skipped, so kM costs registers only. An expert with more rows
//   streams its weights again per kM rows.
// Grid dim y has one slot per possible active expert; a slot past num_active exits at
// once, so an expert no token chose is never read, and the grid depends only on
// (T, k, E): graph-capturable, with no atomics and no workspace (deterministic).
#include "attention_mma.cuh"

using namespace sparkd;
using attn::mma_16816;

constexpr int kWarps = 4;        // warps per block
constexpr int kTileRows = 16;    // weight rows per warp tile: the mma's m
constexpr int kGroupRows = 8;    // sorted rows per mma: its n
constexpr int kStepChunks = 4;   // 16-byte chunks of a row per k-step: one per lane of a quad
// k-steps of weight loads a warp issues before using any: 16 loads of 16 bytes a lane,
// half as many for fp32, whose operands take twice the registers once split for tf32.
template <typename T>
constexpr int kBatchSteps = sizeof(T) == 2 ? 8 : 4;
constexpr int kGateUpCols = kTileRows / 2;  // hidden columns per gate_up tile
constexpr int kMinBlocksPerSm = 3;  // 12 warps an SM (up to 168 registers each: no spills) keep ~100 KB in flight

// ---- one k-step of a warp tile on the tensor cores ----
//
// acc (the 16 x 8 fp32 C fragment) += A . B, where lane (g = lane / 4, c = lane % 4)
// holds chunk c of the k-step of weight rows g (w_lo) and g + 8 (w_hi) and of activation
// row g (act). Each chunk feeds two mma: its words x, y the first and z, w the second,
// filling k slots 2c, 2c + 1, 2c + 8, 2c + 9 of an m16n8k16 (16-bit types) or slots c,
// c + 4 of an m16n8k8 (fp32) in the same order for A and B.
template <typename T>
struct StepMma {
  __device__ static __forceinline__ void run(float (&acc)[4], const uint4& w_lo, const uint4& w_hi,
                                             const uint4& act) {
    const unsigned first[4] = {w_lo.x, w_hi.x, w_lo.y, w_hi.y};
    const unsigned second[4] = {w_lo.z, w_hi.z, w_lo.w, w_hi.w};
    mma_16816<T>(acc, first, act.x, act.y);
    mma_16816<T>(acc, second, act.z, act.w);
  }
};

__device__ __forceinline__ unsigned to_tf32(float x) {
  unsigned out;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(out) : "f"(x));
  return out;
}

// An fp32 word as hi + lo, both tf32: exact to about 2^-22 of the value.
struct SplitTf32 {
  unsigned hi, lo;
  __device__ __forceinline__ explicit SplitTf32(unsigned bits) {
    const float x = __uint_as_float(bits);
    hi = to_tf32(x);
    lo = to_tf32(x - __uint_as_float(hi));
  }
};

__device__ __forceinline__ void mma_1688_tf32(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                              unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 3xTF32: a.b = hi.hi + hi.lo + lo.hi, dropping only lo.lo (about 2^-22 relative).
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                           unsigned b0, unsigned b1) {
  const SplitTf32 x0(a0), x1(a1), x2(a2), x3(a3), y0(b0), y1(b1);
  mma_1688_tf32(c, x0.hi, x1.hi, x2.hi, x3.hi, y0.lo, y1.lo);
  mma_1688_tf32(c, x0.lo, x1.lo, x2.lo, x3.lo, y0.hi, y1.hi);
  mma_1688_tf32(c, x0.hi, x1.hi, x2.hi, x3.hi, y0.hi, y1.hi);
}

template <>
struct StepMma<float> {
  __device__ static __forceinline__ void run(float (&acc)[4], const uint4& w_lo, const uint4& w_hi,
                                             const uint4& act) {
    mma_3xtf32(acc, w_lo.x, w_hi.x, w_lo.y, w_hi.y, act.x, act.y);
    mma_3xtf32(acc, w_lo.z, w_hi.z, w_lo.w, w_hi.w, act.z, act.w);
  }
};

// ---- one warp tile against kM sorted rows ----

// A row as 16-byte chunks, from this lane's chunk of each k-step on.
template <typename T>
__device__ __forceinline__ const uint4* lane_chunks(const T* row) {
  return reinterpret_cast<const uint4*>(row) + threadIdx.x % kStepChunks;
}

// acc[grp] += (weight rows g, g + 8 of the tile) . (sorted row grp * 8 + g of the pass) over
// k-steps [step_begin, step_end), for the first num_groups groups; w_lo / w_hi / act[grp]
// are this lane's rows (g = lane / 4) as 16-byte chunks, each already offset by its lane
// of the quad. Chunks past num_chunks count as zeros.
template <typename T, int kGroups>
__device__ __forceinline__ void accumulate_tile(float (&acc)[kGroups][4], const uint4* w_lo, const uint4* w_hi,
                                                const uint4* const (&act)[kGroups], int num_groups, int step_begin,
                                                int step_end, int num_chunks) {
  constexpr int kSteps = kBatchSteps<T>;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  // This lane's chunks c of the slice, c + quad lane < chunk_end, step by step.
  const int chunk_end = min(step_end * kStepChunks, num_chunks) - static_cast<int>(threadIdx.x % kStepChunks);
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
        StepMma<T>::run(acc[grp], lo[u], hi[u], chunk < chunk_end ? __ldg(act[grp] + chunk) : zero);
      }
    }
  }
}

// Runs the sorted rows [begin, end) of one expert against this warp's weight tile (rows
// w_lo, w_hi of this lane; `live` false for a tile past the matrix), kM rows a pass.
// act_row(row) -> const T*: the activation row of a sorted row. The k_split warps of a
// tile (consecutive in the block) take one slice of K each and meet in shared memory;
// the first then calls store(acc, row0, num_rows), where acc[grp][e] is the C fragment
// of group grp for sorted rows row0 + grp * 8 + 2c + e % 2 (c = lane % 4) and weight
// row g + 8 * (e / 2) of the tile. Every thread of the block must call it.
template <typename T, int kM, typename ActRow, typename Store>
__device__ __forceinline__ void run_expert_rows(const T* w_lo, const T* w_hi, bool live, int begin, int end,
                                                int num_chunks, int k_split, ActRow act_row, Store store) {
  constexpr int kGroups = kM / kGroupRows;
  __shared__ float partial[kWarps][kGroups][4][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, slice = warp % k_split;
  const int num_steps = (num_chunks + kStepChunks - 1) / kStepChunks;
  const int slice_steps = (num_steps + k_split - 1) / k_split;
  const int step_begin = slice * slice_steps, step_end = min(num_steps, step_begin + slice_steps);
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

// The rows of the expert in this block's slot (grid dim y): false for a slot past num_active.
__device__ __forceinline__ bool slot_rows(const int* active_experts, const int* num_active, const int* offsets,
                                          int& expert, int& begin, int& end) {
  if (static_cast<int>(blockIdx.y) >= *num_active) return false;
  expert = active_experts[blockIdx.y];
  begin = offsets[expert];
  end = offsets[expert + 1];
  return true;
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
  int expert, begin, end;
  if (!slot_rows(active_experts, num_active, offsets, expert, begin, end)) return;
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
  run_expert_rows<T, kM>(gate, up, tile * kGateUpCols < inter_size, begin, end, hidden_size / (16 / sizeof(T)),
                         k_split, x_row, store);
}

// expert_out[row, h] = hidden[row] . down[e, h] for every sorted row of expert e, in fp32.
// expert_out [P, H] float32, hidden [P, I], down [E, H, I], all contiguous.
// Launch: grid (ceil(ceil(H / 16) * k_split / kWarps), min(E, P)), 32 * kWarps threads;
// k_split in {1, 2, 4}. Preconditions (checked by the launcher): H and I are multiples
// of a 16-byte chunk; hidden and down are 16-byte aligned.
template <typename T, int kM>
__global__ void __launch_bounds__(32 * kWarps, kMinBlocksPerSm)
    moe_down_kernel(float* __restrict__ expert_out, const T* __restrict__ hidden, const T* __restrict__ down,
                    const int* __restrict__ offsets, const int* __restrict__ active_experts,
                    const int* __restrict__ num_active, int hidden_size, int inter_size, int k_split) {
  int expert, begin, end;
  if (!slot_rows(active_experts, num_active, offsets, expert, begin, end)) return;
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
        float* out = expert_out + static_cast<long long>(row0 + m) * hidden_size;
        if (h_lo < hidden_size) out[h_lo] = acc[grp][e];
        if (h_hi < hidden_size) out[h_hi] = acc[grp][2 + e];
      }
  };
  run_expert_rows<T, kM>(w_lo, w_hi, tile * kTileRows < hidden_size, begin, end, inter_size / (16 / sizeof(T)),
                         k_split, hidden_row, store);
}
