// A decode graph's per-step inputs, moved from the step's staging slot (pinned
// host memory, which the device reads through its mapping) into the bucket's
// static device region in one launch. It replaces two H2D copies, the upload of
// the drawn-token pairs and their gather: each copy costs ~4 us of the stream
// whatever its size, a launch reading a few KB over PCIe about one round trip.
//
// The staging slot, in int32 words:
//   [0, block_tables_word)        the per-step arrays (token_ids first, `size`
//                                 of them), laid out as in the region;
//   [block_tables_word, + B * W)  the step's block-table rows, W wide;
//   [+ B * W, + size)             sources: -1 keeps the staged id, j >= 0 takes
//                                 drawn[j], an id an earlier step drew on the
//                                 device and the host does not know yet.
// The region: the same per-step words, then block_tables [size, max_blocks]
// at block_tables_word, whose first W columns of rows [0, B) this writes.
//
// Every thread moves one word. The blocks that write token ids first read all
// of `drawn` into shared memory alongside their staged words, so that a source
// costs no second round trip when `drawn` lies in host memory too.
// Launch: grid = ceil((block_tables_word + B * W) / blockDim.x), dynamic shared
// memory = 4 * num_drawn bytes.
__global__ void stage_decode_inputs_kernel(int* __restrict__ region, const int* __restrict__ staged,
                                           int block_tables_word, int size, int max_blocks, int batch, int width,
                                           const int* __restrict__ drawn, int num_drawn) {
  extern __shared__ int drawn_ids[];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int total = block_tables_word + batch * width;
  const bool writes_tokens = blockIdx.x * blockDim.x < size;
  const int value = i < total ? staged[i] : 0;
  const int source = writes_tokens && i < size ? staged[total + i] : -1;
  if (writes_tokens) {
    for (int j = threadIdx.x; j < num_drawn; j += blockDim.x) drawn_ids[j] = drawn[j];
    __syncthreads();
  }
  if (i >= total) return;
  if (i < block_tables_word) {
    region[i] = source >= 0 && source < num_drawn ? drawn_ids[source] : value;
    return;
  }
  const int cell = i - block_tables_word, row = cell / width;
  region[block_tables_word + row * max_blocks + (cell - row * width)] = value;
}
