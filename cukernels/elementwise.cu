// Elementwise add: out = x + y, fp32 math, rounded once to y's type. y may be fp32 (the
// residual stream, which the decoder keeps in fp32: see norm.cu), and the sum stays fp32.
#include "common.cuh"

using namespace sparkd;

// x: [n] in T, y and out: [n] in Y (T or float); contiguous, n a multiple of kVec.
// Launch: a 1-D grid of 256-thread blocks striding over the n / kVec chunks.
template <typename T, typename Y, int kVec>
__global__ void add_kernel(Y* __restrict__ out, const T* __restrict__ x, const Y* __restrict__ y, long long n) {
  for (long long i = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) * kVec; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x * kVec) {
    float a[kVec], b[kVec];
    load_floats<kVec>(x + i, a);
    load_floats<kVec>(y + i, b);
#pragma unroll
    for (int k = 0; k < kVec; ++k) a[k] += b[k];
    store_floats<kVec>(out + i, a);
  }
}
