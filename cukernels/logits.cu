// fp32 logits from a half-precision lm_head GEMM: out = float(x), elementwise.
// (The last-position rows are gathered by gather_rows_kernel in embedding.cu.)
#include "common.cuh"

using namespace sparkd;

// x: [n] T  out: [n] float32, n a multiple of kVec.
// Launch: a 1-D grid of 256-thread blocks striding over the n / kVec chunks.
template <typename T, int kVec>
__global__ void to_float32_kernel(float* __restrict__ out, const T* __restrict__ x, long long n) {
  for (long long i = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) * kVec; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x * kVec) {
    float y[kVec];
    load_floats<kVec>(x + i, y);
    store_floats<kVec>(out + i, y);
  }
}
