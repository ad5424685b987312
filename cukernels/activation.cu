// SiLU-and-mul, the gated MLP activation: out = silu(gate) * up, fp32 math,
// with silu(g) = g / (1 + exp(-g)).
#include "common.cuh"

using namespace sparkd;

// x: [rows, 2 * inter] = [gate | up] contiguous  out: [rows, inter] contiguous.
// Launch: a 1-D grid of 256-thread blocks striding over the rows * inter / kVec
// output chunks (grid-stride, so any row count fits).
template <typename T, int kVec>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int rows, int inter) {
  const int chunks_per_row = inter / kVec;
  const long long num_chunks = static_cast<long long>(rows) * chunks_per_row;
  for (long long chunk = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; chunk < num_chunks;
       chunk += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long row = chunk / chunks_per_row;
    const int col = static_cast<int>(chunk % chunks_per_row) * kVec;
    const T* gate_ptr = x + row * 2 * inter + col;
    float gate[kVec], up[kVec], y[kVec];
    load_floats<kVec>(gate_ptr, gate);
    load_floats<kVec>(gate_ptr + inter, up);
#pragma unroll
    for (int i = 0; i < kVec; ++i) y[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    store_floats<kVec>(out + row * inter + col, y);
  }
}
