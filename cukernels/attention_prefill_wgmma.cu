// Varlen causal paged prefill attention with GQA on Hopper's warpgroup tensor cores (wgmma,
// sm_90a), head_dim 128, bf16 / fp16 (FlashAttention-3 style, fp32 softmax and accumulators).
// Inputs, outputs and semantics are prefill_attention_kernel's (attention_prefill.cu): q, out
// [T, Hq, D]; k_cache, v_cache [NB, Hkv, BS, D]; query_start_loc [B+1]; seq_lens [B] (context
// after the step); block_tables [B, max_blocks_per_seq]; query token i of sequence s sits at
// position seq_lens[s] - query_len + i and sees keys 0 .. that position. Query rows are packed
// (attention_common.cuh: row = token * group + head), so a block's rows share its K/V tiles.
//
// A block owns kBlockRows packed rows of one (sequence, kv head) and is 3 warpgroups.
// Warpgroup 0, the producer, copies the block's query rows once, then K and V tiles of kKeys
// keys through the block table into a kStages-deep ring with cp.async, in the order they are
// read (K_{t+1} before V_t); each completes on its own `full` mbarrier. Warpgroups 1 and 2, the
// consumers, own 64 rows each and follow FlashAttention-3: in turn t a consumer issues S_t = Q
// K_t^T (8 wgmma m64n64k16, both operands in shared memory) and O += P_{t-1} V_{t-1} (4 wgmma
// m64n128k16, P from registers, V through the transpose bit), waits for S_t only and runs its
// online softmax (base 2, the scale folded into one fma, the causal mask only on tiles past
// the consumer's first row's position) into the second P register buffer while P_{t-1} V runs;
// that P V is waited for at the start of turn t + 1. The two consumers take turns issuing
// their GEMMs (named barriers, ping-pong), so one's softmax runs under the other's GEMMs.
// 64-key tiles keep S (32), two P buffers (2 x 16) and O (64 registers) live at once with no
// spills; setmaxnreg gives the producer 56 registers and the consumers 224.
//
// Tiles are [rows][128 dims] as 2 panels of 64 dims in the 128-byte swizzle
// (wgmma_attention.cuh): Q of kBlockRows rows, K and V of kKeys. Rows past the sequence's and
// keys past the block's last visible key are zero-filled, never read from the cache.
#include "attention_prefill_wgmma.cuh"

using namespace sparkd;
using namespace sparkd::wgmma;
using namespace sparkd::prefill_wgmma;

#if defined(SPARKD_HAS_WGMMA)

constexpr int kDimSteps = kHeadDim / 16;           // wgmma K steps of S = Q K^T
constexpr int kStepsPerPanel = kPanelDims / 16;
constexpr int kKeySteps = kKeys / 16;              // wgmma K steps of O += P V
constexpr int kWarpsPerConsumer = kWarpgroupThreads / 32;
constexpr int kScores = kM64N64Outputs;            // S (then P) of a key tile, per thread
constexpr int kOutputs = kM64N128Outputs;          // O, per thread
using Fragments = unsigned[kKeySteps][kFragmentRegisters];  // P of a key tile rounded to T, as A operands

// Issues S = Q K^T for a consumer's 64 rows (q_tile: their first row) and one K tile as one
// commit group; a step's descriptors are the tiles' plus its byte offset >> 4 (no carry out of
// the 14-bit address field).
template <typename T>
__device__ __forceinline__ void issue_scores(float (&s)[kScores], unsigned q_tile, unsigned k_tile) {
  const unsigned long long q_desc = tile_descriptor(q_tile), k_desc = tile_descriptor(k_tile);
  wgmma_m64n64k16_ss_first<T>(s, q_desc, k_desc);
#pragma unroll
  for (int step = 1; step < kDimSteps; ++step) {
    const int panel = step / kStepsPerPanel, in_row = step % kStepsPerPanel * kStepBytes;
    wgmma_m64n64k16_ss<T>(s, q_desc + ((panel * kQPanelBytes + in_row) >> 4),
                          k_desc + ((panel * kKvPanelBytes + in_row) >> 4));
  }
  wgmma_commit();
}

// Issues O += P V for one V tile as one commit group; p and o stay in use until its wait.
template <typename T>
__device__ __forceinline__ void issue_values(float (&o)[kOutputs], const Fragments& p, unsigned v_tile) {
  const unsigned long long v_desc = mn_major_descriptor(v_tile, kKvPanelBytes);
#pragma unroll
  for (int step = 0; step < kKeySteps; ++step)
    wgmma_m64n128k16_rs_tb<T>(o, p[step], v_desc + (step * 16 * kRowBytes >> 4));
  wgmma_commit();
}

// 2^x for x <= 0 (a difference from the running max): one MUFU.EX2, results below 2^-126
// flushed to 0, where exp2f spends two more multiplies and a compare a value on subnormals.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// One key tile folded into a consumer's running max. s: the tile's raw scores in the
// accumulator layout, turned into P (unnormalised, relative to the new m); with `masked`, keys
// past a row's last_key are -inf. m: this thread's two rows' running max (raw scores);
// rescale: what O and the row sums, still relative to the old m, are to be scaled by. The max
// is taken on raw scores (the scale is positive), so each exponent is one fma.
__device__ __forceinline__ void online_softmax(float (&s)[kScores], float (&m)[2], float (&rescale)[2],
                                               int key0, bool masked, const int (&last_key)[2], float scale_log2) {
  if (masked) {
    // Column i of this thread is key key0 + 2 (lane % 4) + (a constant: accumulator_col's
    // rest), so each row's bound is one register and the comparisons take no per-element index.
    int bound[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) bound[half] = last_key[half] - key0 - 2 * (threadIdx.x % 4);
#pragma unroll
    for (int i = 0; i < kScores; ++i)
      if (8 * (i / 4) + i % 2 > bound[i % 4 / 2]) s[i] = -infinity();
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float tile_max = -infinity();
#pragma unroll
    for (int i = 2 * half; i < kScores; i += 4) tile_max = fmaxf(tile_max, fmaxf(s[i], s[i + 1]));
    // The 4 lanes of a quad hold one row.
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
    const float m_new = fmaxf(m[half], tile_max);
    // A row with every key masked so far keeps m = -inf; subtracting 0 keeps P = 0, not NaN.
    const float ref = m_new == -infinity() ? 0.f : m_new * scale_log2;
    rescale[half] = fast_exp2(fmaf(m[half], scale_log2, -ref));
#pragma unroll
    for (int i = 2 * half; i < kScores; i += 4) {
      s[i] = fast_exp2(fmaf(s[i], scale_log2, -ref));
      s[i + 1] = fast_exp2(fmaf(s[i + 1], scale_log2, -ref));
    }
    m[half] = m_new;
  }
}

// O and the row sums, relative to the previous tile's maxima, moved to the current ones.
__device__ __forceinline__ void rescale_output(float (&o)[kOutputs], float (&l)[2], const float (&rescale)[2]) {
#pragma unroll
  for (int i = 0; i < kOutputs; ++i) o[i] *= rescale[i % 4 / 2];
#pragma unroll
  for (int half = 0; half < 2; ++half) l[half] *= rescale[half];
}

template <typename T>
__device__ __forceinline__ void to_fragments(Fragments& p, const float (&s)[kScores]) {
#pragma unroll
  for (int step = 0; step < kKeySteps; ++step) p_fragment<T>(p[step], s, step);
}

// Hands the stage at pos back to the producer (one arrival a warp) and moves on.
__device__ __forceinline__ void release(const Smem& smem, RingPosition<kStages>& pos) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) mbarrier_arrive(smem.empty(pos.stage));
  pos.advance();
}

// A consumer warpgroup's 64 rows: their running softmax and O, and where they are in the ring.
// Every active consumer of a block runs the block's num_tiles tiles (a tile past all of its
// rows' keys is masked whole, P = 0), so with two active consumers both take the same number of
// turns: tile 0's S, then S_t with P_{t-1} V_{t-1} for t = 1 .. num_tiles - 1, then the last P V.
//
// ptxas hoists a wgmma wait to the top of its basic block (and before the first write to a
// register an unfinished wgmma reads). So a P V's wait sits in the next turn, after its
// mbarrier waits (a branch), and that P's row sums are read there too, keeping its registers
// P's under the softmax in between: the P V runs on under the next tile's softmax.
struct Consumer {
  Smem smem;
  unsigned q_tile;        // shared address of the consumer's first Q row
  int index;              // 0 or 1
  bool ping_pong;         // both consumers active: take turns issuing GEMMs
  int first_masked;       // from this key on, some row of the consumer masks
  int last_key[2];        // this thread's two rows' last visible key
  float scale_log2;
  float m[2], rescale[2];
  float l[2];  // this thread's two rows' sums over its columns of the rounded P that O has taken
  float s[kScores], o[kOutputs];
  RingPosition<kStages> k_pos, v_pos;  // the tile whose K is read next, and whose V
  RingPosition<kStages> done_pos;      // the stage to release once `done` (its P V waited for)
  bool done = false;

  __device__ __forceinline__ void begin_turn() {
    if (ping_pong) wait_turn(index);
  }
  // Consumer 1 passed the turn once before its first; it skips the pass after its last, so
  // both barriers see as many arrivals as syncs.
  __device__ __forceinline__ void end_turn(bool last) {
    if (ping_pong && !(last && index == 1)) pass_turn(index);
  }

  __device__ __forceinline__ void softmax(int tile) {
    online_softmax(s, m, rescale, tile * kKeys, (tile + 1) * kKeys > first_masked, last_key, scale_log2);
  }

  // After a turn's mbarrier waits: wait for the last turn's P V, release the stage it read and
  // add its P's row sums (`p_done`; l keeps step with O); then move O and l to the maxima of
  // the P about to be multiplied and order those register writes before the wgmmas.
  template <typename T>
  __device__ __forceinline__ void prepare_values(Fragments& p_done) {
    wgmma_wait<0>();
    fence_operands(o);
    fence_fragments(p_done);
    if (done) {
      release(smem, done_pos);
      add_fragment_row_sums<T>(l, p_done);
    }
    rescale_output(o, l, rescale);
    wgmma_fence();
  }

  // P V of the tile at v_pos is issued: the next prepare_values waits for it.
  __device__ __forceinline__ void values_issued() {
    done = true;
    done_pos = v_pos;
    v_pos.advance();
  }

  // Turn 0: S_0, its softmax, P_0 into p.
  template <typename T>
  __device__ __forceinline__ void first_tile(Fragments& p) {
    mbarrier_wait(smem.k_full(k_pos.stage), k_pos.phase);
    begin_turn();
    wgmma_fence();
    issue_scores<T>(s, q_tile, attn::smem_addr(smem.k(k_pos.stage)));
    end_turn(false);
    k_pos.advance();
    wgmma_wait<0>();
    fence_operands(s);
    softmax(0);  // O and l are 0; rescale (0) zeroes them again
    to_fragments<T>(p, s);
  }

  // Turn `tile` (>= 1): S_tile and O += P_{tile-1} V (`p`) issued together; S_tile's softmax
  // and P_tile (into the other buffer, `p_next`) overlap that P V (FlashAttention-3's
  // intra-warpgroup pipelining), whose wait is the next turn's.
  template <typename T>
  __device__ __forceinline__ void next_tile(Fragments& p, Fragments& p_next, int tile) {
    mbarrier_wait(smem.k_full(k_pos.stage), k_pos.phase);
    mbarrier_wait(smem.v_full(v_pos.stage), v_pos.phase);
    prepare_values<T>(p_next);  // P_{tile-2}, whose P V the last turn waited for
    begin_turn();
    issue_scores<T>(s, q_tile, attn::smem_addr(smem.k(k_pos.stage)));
    issue_values<T>(o, p, attn::smem_addr(smem.v(v_pos.stage)));
    end_turn(false);
    k_pos.advance();
    wgmma_wait<1>();
    fence_operands(s);
    softmax(tile);
    to_fragments<T>(p_next, s);
    values_issued();
  }

  // The last turn: O += P V for the last tile's P (`p`; `p_done` the one before it), its
  // stage released and its row sums added.
  template <typename T>
  __device__ __forceinline__ void last_values(Fragments& p, Fragments& p_done) {
    mbarrier_wait(smem.v_full(v_pos.stage), v_pos.phase);
    prepare_values<T>(p_done);
    begin_turn();
    issue_values<T>(o, p, attn::smem_addr(smem.v(v_pos.stage)));
    end_turn(true);
    wgmma_wait<0>();
    fence_operands(o);
    fence_fragments(p);
    release(smem, v_pos);
    add_fragment_row_sums<T>(l, p);
  }
};

// Warpgroups 1 and 2: consumer c computes rows first_row + 64c .. + 63 and stores them. P
// alternates between two register buffers, so P_t is written while P_{t-1} V runs on from the
// other; the loop is unrolled by two to keep both buffers' registers fixed.
template <typename T>
__device__ __forceinline__ void consume(const Smem& smem, T* out, const PackedRows& rows, int first_row, int num_tiles,
                                        float scale_log2) {
  const int index = threadIdx.x / kWarpgroupThreads - 1;
  const int row0 = first_row + index * kConsumerRows;
  if (row0 >= rows.count()) {
    // No rows: hand every stage back once its V (copied after its K) has landed, which keeps
    // this consumer's arrivals in the pass of the ring the producer is in.
    RingPosition<kStages> v_pos;
    for (int tile = 0; tile < num_tiles; ++tile) {
      mbarrier_wait(smem.v_full(v_pos.stage), v_pos.phase);
      release(smem, v_pos);
    }
    return;
  }
  Consumer c;
  c.smem = smem;
  c.q_tile = attn::smem_addr(smem.q()) + index * kConsumerRows * kRowBytes;
  c.index = index;
  c.ping_pong = first_row + kBlockRows - kConsumerRows < rows.count();  // consumer 1 has rows too
  c.first_masked = rows.position(row0) + 1;
  c.scale_log2 = scale_log2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    c.last_key[half] = rows.position(row0 + accumulator_row(2 * half));
    c.m[half] = -infinity();
    c.l[half] = 0.f;
  }
#pragma unroll
  for (int i = 0; i < kOutputs; ++i) c.o[i] = 0.f;
  if (c.ping_pong && index == 1) pass_turn(index);  // consumer 0 goes first
  mbarrier_wait(smem.q_full(), 0);

  Fragments p, p_next;
  c.first_tile<T>(p);
  int tile = 1;
  for (; tile + 1 < num_tiles; tile += 2) {
    c.next_tile<T>(p, p_next, tile);
    c.next_tile<T>(p_next, p, tile + 1);
  }
  if (tile < num_tiles) {
    c.next_tile<T>(p, p_next, tile);
    c.last_values<T>(p_next, p);
  } else {
    c.last_values<T>(p, p_next);
  }

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    c.l[half] += __shfl_xor_sync(kFullMask, c.l[half], 1);
    c.l[half] += __shfl_xor_sync(kFullMask, c.l[half], 2);
  }
#pragma unroll
  for (int i = 0; i < kOutputs; i += 2) {
    const int row = row0 + accumulator_row(i);
    if (row >= rows.count()) continue;
    const float inv = 1.f / c.l[i % 4 / 2];
    *reinterpret_cast<unsigned*>(out + rows.offset(row, kHeadDim) + accumulator_col(i)) =
        attn::pack_pair<T>(c.o[i] * inv, c.o[i + 1] * inv);
  }
}

#endif  // SPARKD_HAS_WGMMA

// Launch: grid (ceil(max_query_len * group / kBlockRows) * Hkv, B), kThreads threads, dynamic
// shared memory kSwizzleBytes + kQTileBytes + 2 * kStages * kKvTileBytes + 8 * (1 + 3 * kStages)
// (alignment slack, tiles, barriers). blockIdx.x = kv_head + Hkv * r, and r counts row tiles
// from the last, so the tiles that see the most keys start first. Preconditions (checked by the launcher): the
// operands are 16-byte aligned and contiguous.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_attention_wgmma_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k_cache,
                                   const T* __restrict__ v_cache, const int* __restrict__ query_start_loc,
                                   const int* __restrict__ seq_lens, const int* __restrict__ block_tables,
                                   int max_blocks_per_seq, int num_q_heads, int num_kv_heads, int block_size,
                                   float scale_log2) {
#if defined(SPARKD_HAS_WGMMA)
  const int seq = blockIdx.y, kv_head = blockIdx.x % num_kv_heads;
  const int row_tile = static_cast<int>(gridDim.x) / num_kv_heads - 1 - static_cast<int>(blockIdx.x) / num_kv_heads;
  const PackedRows rows = attn::packed_rows(query_start_loc, seq_lens, seq, kv_head, num_q_heads, num_kv_heads);
  const int first_row = row_tile * kBlockRows;
  if (first_row >= rows.count()) return;
  const int key_end = rows.position(min(first_row + kBlockRows, rows.count()) - 1) + 1;
  const int num_tiles = attn::ceil_div(key_end, kKeys);

  const Smem smem = shared_tiles();
  if (threadIdx.x == 0) {
    mbarrier_init(smem.q_full(), kWarpgroupThreads);  // every producer thread's copies
    for (int stage = 0; stage < kStages; ++stage) {
      mbarrier_init(smem.k_full(stage), kWarpgroupThreads);
      mbarrier_init(smem.v_full(stage), kWarpgroupThreads);
      mbarrier_init(smem.empty(stage), kConsumers * kWarpsPerConsumer);  // every consumer warp
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x < kWarpgroupThreads) {
    setmaxnreg_dec<kProducerRegisters>();
    produce<T>(smem, q, rows, first_row,
               attn::paged_kv<T, kHeadDim>(k_cache, v_cache, block_tables, max_blocks_per_seq, seq, kv_head,
                                           num_kv_heads, block_size),
               key_end, num_tiles);
  } else {
    setmaxnreg_inc<kConsumerRegisters>();
    consume<T>(smem, out, rows, first_row, num_tiles, scale_log2);
  }
#else
  __trap();  // built for another target: the host launches this on sm_90 only
#endif
}
