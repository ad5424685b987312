// Row gather: out[i] = table[ids[i]]. Serves the embedding lookup and the
// gather of the last-position hidden rows before the final norm.
//
// The copy is dtype-blind: Word is the unit moved per thread, uint4 (16 bytes)
// when the row size and the pointers allow it, else a 4- or 2-byte word.

// out: [num_rows, row_words]  table: [table_rows, row_words]  ids: [num_rows] int32
// An id outside [0, table_rows) yields a zero row rather than a wild read.
// Launch: grid = num_rows blocks, block = up to 256 threads striding the row.
template <typename Word>
__global__ void gather_rows_kernel(Word* __restrict__ out, const Word* __restrict__ table,
                                   const int* __restrict__ ids, int row_words, int table_rows) {
  const int row = blockIdx.x;
  const int id = ids[row];
  Word* dst = out + static_cast<long long>(row) * row_words;
  if (id < 0 || id >= table_rows) {
    const Word zero{};
    for (int i = threadIdx.x; i < row_words; i += blockDim.x) dst[i] = zero;
    return;
  }
  const Word* src = table + static_cast<long long>(id) * row_words;
  for (int i = threadIdx.x; i < row_words; i += blockDim.x) dst[i] = src[i];
}

// The input ids an earlier step drew on the device (async scheduling: the host
// schedules step N+1 before step N's ids come back):
//   token_ids[pairs[i]] = drawn[pairs[num_pairs + i]]  for i < num_pairs.
// token_ids: [T] int32  drawn: [B'] int32  pairs: [2, num_pairs] int32 (rows, drawn rows)
// Launch: grid = ceil(num_pairs / 256) blocks of 256 threads.
__global__ void copy_drawn_tokens_kernel(int* __restrict__ token_ids, const int* __restrict__ drawn,
                                         const int* __restrict__ pairs, int num_pairs) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < num_pairs) token_ids[pairs[i]] = drawn[pairs[num_pairs + i]];
}
