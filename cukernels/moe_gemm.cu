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
// At such batches the products are bound by streaming the weights, so the kernels are
// built like gemv.cu:
// - a block owns kRows weight rows of one expert; its threads stride over K in 16-byte
//   chunks, issue every weight load of a pass before using any, and several warps split
//   a long K (their partial sums meet in shared memory);
// - the expert's activation rows are gathered kM at a time, and each weight chunk,
//   read once, serves the whole tile: an expert with n rows streams its weights
//   ceil(n / kM) times, from DRAM once per kM rows;
// - grid dim y has one slot per possible active expert; a slot past num_active exits
//   at once, so an expert no token chose is never read, and the grid depends only on
//   (T, k, E): graph-capturable, with no atomics and no workspace (deterministic).
#include "common.cuh"

using namespace sparkd;

constexpr int kRows = 4;                // weight rows per block
constexpr int kGateUpCols = kRows / 2;  // hidden columns per gate_up block: a gate and an up row each
constexpr int kMaxWarps = 8;            // warps splitting K within a block
constexpr int kLoads = 16;              // 16-byte weight loads in flight per thread and pass

template <typename T>
struct Chunk {
  static constexpr int kSize = 16 / sizeof(T);  // elements per 16-byte chunk
  // A chunk never straddles two row blocks: every K (and so every row count, as H and I
  // are each the other GEMM's K) is a whole number of chunks, and so of kRows rows.
  static_assert(kSize % kRows == 0, "row counts that are whole chunks must be whole row blocks");

  __device__ static __forceinline__ void unpack(const uint4& raw, float (&out)[kSize]) {
    Pack<T, kSize> pack;
    memcpy(&pack, &raw, sizeof(raw));
#pragma unroll
    for (int i = 0; i < kSize; ++i) out[i] = to_float(pack.v[i]);
  }
};

// acc[m][r] += act[m] . w[r] over this thread's share of K's num_chunks chunks, for the
// first num_rows rows of the tile. Weights are read once, evict-first (ld.global.cs), so
// they do not push the tile's activations, which every block re-reads, out of the caches.
template <typename T, int kM>
__device__ __forceinline__ void accumulate_tile(float (&acc)[kM][kRows], const T* const (&w)[kRows],
                                                const T* const (&act)[kM], int num_rows, int num_chunks) {
  using C = Chunk<T>;
  // With many rows the accumulators need the registers: fewer loads per pass.
  constexpr int kUnroll = (kM >= 8 ? kLoads / 2 : kLoads) / kRows;
  for (int first = threadIdx.x; first < num_chunks; first += blockDim.x * kUnroll) {
    uint4 w_raw[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int chunk = first + u * blockDim.x;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (chunk < num_chunks) w_raw[u][r] = __ldcs(reinterpret_cast<const uint4*>(w[r] + chunk * C::kSize));
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int chunk = first + u * blockDim.x;
      if (chunk >= num_chunks) break;
      float w_vals[kRows][C::kSize];
#pragma unroll
      for (int r = 0; r < kRows; ++r) C::unpack(w_raw[u][r], w_vals[r]);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        if (m >= num_rows) break;
        float a[C::kSize];
        C::unpack(__ldg(reinterpret_cast<const uint4*>(act[m] + chunk * C::kSize)), a);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
#pragma unroll
          for (int i = 0; i < C::kSize; ++i) acc[m][r] = fmaf(a[i], w_vals[r][i], acc[m][r]);
        }
      }
    }
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

// The block's sums of one tile: totals(m, r) = act[row0 + m] . w[r], over the warps' partials.
// (A struct, not a generic lambda: NVRTC's JIT mode takes a generic lambda for host code.)
template <int kM>
struct TileSums {
  const float (*partial)[kM * kRows];
  int num_warps;
  __device__ __forceinline__ float operator()(int m, int r) const {
    float sum = 0.f;
    for (int p = 0; p < num_warps; ++p) sum += partial[p][m * kRows + r];
    return sum;
  }
};

// Runs the sorted rows [begin, end) of one expert against the block's weight rows w,
// kM rows per pass over w. act_row(row) -> const T*: the activation row of a sorted row.
// store(totals, row0, num_rows) writes the tile's results, where totals(m, r) is the
// block's sum act[row0 + m] . w[r]. Every thread of the block must call it.
template <typename T, int kM, typename ActRow, typename Store>
__device__ __forceinline__ void run_expert_rows(const T* const (&w)[kRows], int begin, int end, int num_chunks,
                                                ActRow act_row, Store store) {
  __shared__ float partial[kMaxWarps][kM * kRows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
  const TileSums<kM> totals{partial, num_warps};
  for (int row0 = begin; row0 < end; row0 += kM) {
    const int num_rows = min(kM, end - row0);
    const T* act[kM];
#pragma unroll
    for (int m = 0; m < kM; ++m) act[m] = act_row(row0 + min(m, num_rows - 1));
    float acc[kM][kRows] = {};
    accumulate_tile<T, kM>(acc, w, act, num_rows, num_chunks);
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      if (m >= num_rows) break;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float sum = warp_reduce(acc[m][r], SumOp());
        if (lane == 0) partial[warp][m * kRows + r] = sum;
      }
    }
    __syncthreads();
    store(totals, row0, num_rows);
    __syncthreads();  // the next tile rewrites partial
  }
}

// hidden[row, c] = silu(x[tok] . gate[e, c]) * (x[tok] . up[e, c]) for every sorted row of
// expert e, tok = sorted_pairs[row] / top_k; silu(g) = g / (1 + exp(-g)).
// hidden [P, I] contiguous, x [T, H] (row stride ld_x), gate_up [E, 2I, H] contiguous.
// Launch: grid (I / kGateUpCols, min(E, P)), 32 * S threads, S in [1, kMaxWarps] warps
// splitting H. Preconditions (checked by the launcher): H, I and ld_x are multiples of
// a 16-byte chunk; x and gate_up are 16-byte aligned.
template <typename T, int kM>
__global__ void __launch_bounds__(32 * kMaxWarps)
    moe_gate_up_kernel(T* __restrict__ hidden, const T* __restrict__ x, const T* __restrict__ gate_up,
                       const int* __restrict__ sorted_pairs, const int* __restrict__ offsets,
                       const int* __restrict__ active_experts, const int* __restrict__ num_active, int top_k,
                       int hidden_size, int inter_size, long long ld_x) {
  int expert, begin, end;
  if (!slot_rows(active_experts, num_active, offsets, expert, begin, end)) return;
  const int col0 = blockIdx.x * kGateUpCols;
  const T* expert_w = gate_up + static_cast<long long>(expert) * 2 * inter_size * hidden_size;
  const T* w[kRows];  // the gate rows, then the up rows, of this block's columns
#pragma unroll
  for (int c = 0; c < kGateUpCols; ++c) {
    w[c] = expert_w + static_cast<long long>(col0 + c) * hidden_size;
    w[kGateUpCols + c] = expert_w + static_cast<long long>(inter_size + col0 + c) * hidden_size;
  }
  const auto x_row = [&](int row) { return x + static_cast<long long>(sorted_pairs[row] / top_k) * ld_x; };
  const auto store = [&](const TileSums<kM>& totals, int row0, int num_rows) {
    for (int i = threadIdx.x; i < num_rows * kGateUpCols; i += blockDim.x) {
      const int m = i / kGateUpCols, c = i % kGateUpCols;
      const float gate = totals(m, c), up = totals(m, kGateUpCols + c);
      hidden[static_cast<long long>(row0 + m) * inter_size + col0 + c] = from_float<T>(gate / (1.f + expf(-gate)) * up);
    }
  };
  run_expert_rows<T, kM>(w, begin, end, hidden_size / Chunk<T>::kSize, x_row, store);
}

// expert_out[row, h] = hidden[row] . down[e, h] for every sorted row of expert e, in fp32.
// expert_out [P, H] float32, hidden [P, I], down [E, H, I], all contiguous.
// Launch: grid (H / kRows, min(E, P)), 32 * S threads, S in [1, kMaxWarps] warps splitting I.
// Preconditions (checked by the launcher): H and I are multiples of a 16-byte chunk;
// hidden and down are 16-byte aligned.
template <typename T, int kM>
__global__ void __launch_bounds__(32 * kMaxWarps)
    moe_down_kernel(float* __restrict__ expert_out, const T* __restrict__ hidden, const T* __restrict__ down,
                    const int* __restrict__ offsets, const int* __restrict__ active_experts,
                    const int* __restrict__ num_active, int hidden_size, int inter_size) {
  int expert, begin, end;
  if (!slot_rows(active_experts, num_active, offsets, expert, begin, end)) return;
  const int h0 = blockIdx.x * kRows;
  const T* w[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    w[r] = down + (static_cast<long long>(expert) * hidden_size + h0 + r) * inter_size;
  }
  const auto hidden_row = [&](int row) { return hidden + static_cast<long long>(row) * inter_size; };
  const auto store = [&](const TileSums<kM>& totals, int row0, int num_rows) {
    for (int i = threadIdx.x; i < num_rows * kRows; i += blockDim.x) {
      const int m = i / kRows, r = i % kRows;
      expert_out[static_cast<long long>(row0 + m) * hidden_size + h0 + r] = totals(m, r);
    }
  };
  run_expert_rows<T, kM>(w, begin, end, inter_size / Chunk<T>::kSize, hidden_row, store);
}
