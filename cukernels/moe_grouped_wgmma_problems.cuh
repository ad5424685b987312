// The two GEMMs of moe_grouped_wgmma.cu as "problems" its pipeline runs: where a tile's activation
// rows and weight boxes come from, and how a consumer's accumulators are stored (SiLU-and-mul
// for gate_up), with the epilogue's store helpers.
#pragma once

#include "attention_mma.cuh"
#include "moe_grouped_wgmma_tiles.cuh"
#include "tma.cuh"

namespace sparkd::moe_wgmma {

using attn::pack_pair;
using tma::TensorMap;

// Stores one row of a consumer's outputs in T, 8 bytes a lane: word(g) is this lane's packed pair
// of column group g (columns 8g + 2 (lane % 4) and the next), g < kGroups, and store(col, v)
// writes columns col .. col + 3 of the row. Lanes c and c ^ 1 of a quad trade one word of each
// two groups, so that a quad's four stores cover columns 8g .. 8g + 15: whole 32-byte sectors,
// where a lane's own 4-byte pairs would fill half sectors (measured slower: run 45). Every lane
// of the warp calls it (the trade is a shuffle); store decides what is in bounds.
template <int kGroups, typename Word, typename Store>
__device__ __forceinline__ void store_row_words(const Word& word, const Store& store) {
  const int c = threadIdx.x % 4;
  const bool even = c % 2 == 0;
#pragma unroll
  for (int g = 0; g < kGroups; g += 2) {
    const unsigned first = word(g), second = word(g + 1);
    const unsigned got = __shfl_xor_sync(kFullMask, even ? second : first, 1);
    // Even lanes keep group g's columns 2c .. 2c + 3, odd lanes take group g + 1's 2c - 2 .. 2c + 1.
    store(8 * g + (even ? 2 * c : 8 + 2 * (c - 1)), even ? make_uint2(first, got) : make_uint2(got, second));
  }
}

// A consumer's outputs of one tile, both accumulator row halves through store_row_words: out
// points at the tile's first output column of sorted row 0, rows ld elements apart; word(half,
// group) is the lane's packed pair of column group `group` in row half `half`. Columns at or past
// cols (a multiple of 8 past the tile's first, so a column below it has its next three below it
// too) and rows past the tile's are not stored.
template <int kGroups, typename T, typename Word>
__device__ __forceinline__ void store_tile_rows(const Tile& tile, int consumer, T* out, long long ld, int cols,
                                                const Word& word) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = tile.row0 + consumer * kConsumerRows + accumulator_row(2 * half);
    T* row_out = out + static_cast<long long>(row) * ld;
    store_row_words<kGroups>([&](int group) { return word(half, group); }, [&](int col, uint2 v) {
      if (row < tile.row_end && col < cols) *reinterpret_cast<uint2*>(row_out + col) = v;
    });
  }
}

// hidden[row, c] = silu(x[tok] . gate[e, c]) * (x[tok] . up[e, c]) for every sorted row of
// expert e, tok = sorted_pairs[row] / top_k; silu(g) = g / (1 + exp(-g)).
// hidden [P, I] contiguous, x [T, H] (row stride ld_x); the weights gate_up [E, 2I, H] contiguous,
// read through `weights`, a map of them as [2E, I, H] (a box: 128 rows of 64 elements).
template <typename T>
struct GateUpProblem {
  T* hidden;
  const T* x;
  const TensorMap* weights;
  const int* sorted_pairs;
  int top_k, hidden_size, inter_size;
  long long ld_x;

  __device__ int k_size() const { return hidden_size; }
  __device__ int weight_tiles() const { return (inter_size + kHalfN - 1) / kHalfN; }
  __device__ const T* any_valid() const { return x; }

  __device__ void sources(const Tile& tile, int first_row, TileSources<T>& src) const {
    src.fill(tile, first_row,
             [&](int row) { return x + static_cast<long long>(__ldg(sorted_pairs + row) / top_k) * ld_x; });
  }

  // B's halves are gate rows c0 .. c0 + 127 and the same up rows, c0 = n_block * kHalfN: rows
  // c0.. of matrices 2e and 2e + 1 of the map.
  __device__ int2 b_box(const Tile& tile, int half) const {
    return make_int2(tile.n_block * kHalfN, 2 * tile.expert + half);
  }

  // A consumer's accumulator column groups 0-15 are gate columns, 16-31 the matching up columns,
  // so SiLU-and-mul pairs elements i and i + kM64N256Outputs / 2 of one thread.
  __device__ void store(const Tile& tile, int consumer, const float (&acc)[kM64N256Outputs]) const {
    const int col0 = tile.n_block * kHalfN;
    store_tile_rows<kHalfN / 8>(tile, consumer, hidden + col0, inter_size, inter_size - col0, [&](int half, int group) {
      const int i = 4 * group + 2 * half;
      float value[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float gate = acc[i + j], up = acc[i + j + kM64N256Outputs / 2];
        value[j] = gate / (1.f + expf(-gate)) * up;
      }
      return pack_pair<T>(value[0], value[1]);
    });
  }
};

// expert_out[row, h] = hidden[row] . down[e, h] for every sorted row of expert e, summed in fp32
// and rounded to T. expert_out [P, H], hidden [P, I], all in T and contiguous; the weights down
// [E, H, I] contiguous, read through `weights`, a map of them as such (a box: 128 rows of 64).
template <typename T>
struct DownProblem {
  T* expert_out;
  const T* hidden;
  const TensorMap* weights;
  int hidden_size, inter_size;

  __device__ int k_size() const { return inter_size; }
  __device__ int weight_tiles() const { return (hidden_size + kTileN - 1) / kTileN; }
  __device__ const T* any_valid() const { return hidden; }

  __device__ void sources(const Tile& tile, int first_row, TileSources<T>& src) const {
    src.fill(tile, first_row, [&](int row) { return hidden + static_cast<long long>(row) * inter_size; });
  }

  // B is down rows h0 .. h0 + 255 of the expert, h0 = n_block * kTileN, in two halves.
  __device__ int2 b_box(const Tile& tile, int half) const {
    return make_int2(tile.n_block * kTileN + half * kHalfN, tile.expert);
  }

  __device__ void store(const Tile& tile, int consumer, const float (&acc)[kM64N256Outputs]) const {
    const int h0 = tile.n_block * kTileN;
    store_tile_rows<kTileN / 8>(tile, consumer, expert_out + h0, hidden_size, hidden_size - h0,
                                [&](int half, int group) {
                                  const int i = 4 * group + 2 * half;
                                  return pack_pair<T>(acc[i], acc[i + 1]);
                                });
  }
};

}  // namespace sparkd::moe_wgmma
