"""The Hopper wgmma prefill attention (kernels/attention_prefill_wgmma.py) against the float64
dense reference of test_attention.py and against the mma.sync prefill kernel on the same inputs.

Relative error is max |out - ref| / max |ref| over the whole output, <= 1e-2 in bf16 / fp16.
Unused cache slots hold NaN, so a read past a sequence or through a wrong block fails loudly.
First, diagnostics of the new building blocks (wgmma_attention.cuh), so that a failing
end-to-end test says where: S = Q K^T of 64 keys over two 64-dim panels, and O += P V with P from
registers and V read MN-major through the transpose bit, each on known bf16-exact operands.
Every test skips off sm_90.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.base import AttentionMetadata
from sparkd.backend.cuda.kernels import attention_prefill_wgmma as wgmma_prefill
from sparkd.backend.dtypes import DType

from .test_attention import MIXED, attention, dense_attention, make_batch, upload_meta
from .test_wgmma_diagnostics import _where_wrong
from .wgmma_probes import probe_compiler, probe_source

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper(gpu):
    from sparkd.backend.cuda.driver import device_arch

    if not wgmma_prefill.use_wgmma_prefill(device_arch(), DType.bfloat16, 128, wgmma_prefill.MIN_QUERY_LEN):
        pytest.skip(f"the wgmma prefill runs on sm_90 only, this device is {device_arch()}")


PROBES = probe_source("wgmma_attention.cuh", r"""
// rows [n, 128] bf16 row-major -> a tile of n rows in 2 panels of 64 dims (panel_offset).
__device__ void store_tile(unsigned char* tile, const __nv_bfloat16* rows, int n) {
  for (int c = threadIdx.x; c < n * 16; c += blockDim.x)
    *reinterpret_cast<uint4*>(tile + panel_offset(n, c / 16, c % 16)) = reinterpret_cast<const uint4*>(rows)[c];
  fence_proxy_async();
  __syncthreads();
}

// s [64, 64] fp32 = q[64 consumer .. + 63] . k^T, q [128, 128] and k [64 keys, 128] bf16, as the
// kernel's consumer computes it: 8 wgmma m64n64k16, descriptors advanced by panel and 32-byte step.
__global__ void __launch_bounds__(128) qk_probe_kernel(float* s_out, const __nv_bfloat16* q,
                                                       const __nv_bfloat16* k, int consumer) {
#if defined(SPARKD_HAS_WGMMA)
  unsigned char* q_tile = aligned_shared();
  unsigned char* k_tile = q_tile + 128 * 256;
  store_tile(q_tile, q, 128);
  store_tile(k_tile, k, 64);
  float s[kM64N64Outputs];
  const unsigned long long q_desc = tile_descriptor(attn::smem_addr(q_tile) + consumer * 64 * kRowBytes);
  const unsigned long long k_desc = tile_descriptor(attn::smem_addr(k_tile));
  wgmma_fence();
  wgmma_m64n64k16_ss_first<__nv_bfloat16>(s, q_desc, k_desc);
  for (int step = 1; step < 8; ++step) {
    const unsigned in_row = step % 4 * kStepBytes;
    wgmma_m64n64k16_ss<__nv_bfloat16>(s, q_desc + ((step / 4 * 128 * kRowBytes + in_row) >> 4),
                                      k_desc + ((step / 4 * 64 * kRowBytes + in_row) >> 4));
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(s);
  for (int i = 0; i < kM64N64Outputs; ++i) s_out[accumulator_row(i) * 64 + accumulator_col(i)] = s[i];
#endif
}

// o [64, 128] fp32 = p [64, 64 keys] . v [64 keys, 128], p fp32 read in the accumulator layout
// and turned into A fragments by p_fragment, v bf16 stored as the kernel's V tile; the fragments
// are kept live by fence_fragments until the wait, as the kernel's pipelined loop needs.
__global__ void __launch_bounds__(128) pv_probe_kernel(float* o_out, const float* p, const __nv_bfloat16* v) {
#if defined(SPARKD_HAS_WGMMA)
  unsigned char* v_tile = aligned_shared();
  store_tile(v_tile, v, 64);
  float s[kM64N64Outputs], o[kM64N128Outputs];
  for (int i = 0; i < kM64N64Outputs; ++i) s[i] = p[accumulator_row(i) * 64 + accumulator_col(i)];
  for (int i = 0; i < kM64N128Outputs; ++i) o[i] = 0.f;
  unsigned a[4][kFragmentRegisters];
  for (int step = 0; step < 4; ++step) p_fragment<__nv_bfloat16>(a[step], s, step);
  const unsigned long long v_desc = mn_major_descriptor(attn::smem_addr(v_tile), 64 * kRowBytes);
  fence_operands(o);
  wgmma_fence();
  for (int step = 0; step < 4; ++step)
    wgmma_m64n128k16_rs_tb<__nv_bfloat16>(o, a[step], v_desc + (step * 16 * kRowBytes >> 4));
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(o);
  fence_fragments(a);
  for (int i = 0; i < kM64N128Outputs; ++i) o_out[accumulator_row(i) * 128 + accumulator_col(i)] = o[i];
#endif
}
""")


@pytest.fixture
def probe(compile_test_kernel, tmp_path):
    """name -> that kernel of PROBES, built (for sm_90a) against copies of wgmma_attention.cuh and its headers."""
    return probe_compiler(compile_test_kernel, tmp_path, "wgmma_attention.cuh", PROBES)


_ROW, _COL = np.arange(128)[:, None], np.arange(128)[None, :]
_INTS = np.random.default_rng(3)
_KEY, _KEYS = _ROW[:64], _COL[:, :64]  # the 64 keys of a K or V tile, as rows and as columns
# name: (q [128, 128], k [64 keys, 128], what a mismatch points at); bf16-exact integers, so S is exact.
QK_PROBES = {
    "rows": ((_COL == 0) * (_ROW + 1.0), (_COL == 0) * np.ones((64, 1)),
             "S[m, n] = m + 1: Q's rows in the tile, the consumer's 64-row offset, accumulator_row"),
    "keys": ((_COL == 0) * np.ones((128, 1)), (_COL == 0) * (_KEY + 1.0),
             "S[m, n] = n + 1: K's rows in the tile (N = 64 keys), accumulator_col"),
    "second_panel": ((_COL == 64 + _ROW % 64) * 1.0, (_COL >= 64) * (_COL - 63.0) * np.ones((64, 1)),
                     "S[m, n] = m % 64 + 1 from dims 64-127 only: the step into the second 64-dim panel "
                     "(Q's and K's panels differ in size)"),
    "all_dims": (_INTS.integers(-3, 4, (128, 128)) * 1.0, _INTS.integers(-3, 4, (64, 128)) * 1.0,
                 "S = Q K^T over 128 dims: the descriptors' 32-byte advance per step within a panel"),
}
# name: (p [64, 64 keys], v [64 keys, 128 dims], what a mismatch points at).
PV_PROBES = {
    "p_rows": ((_KEYS == 0) * (_ROW[:64] + 1.0), (_KEY == 0) * np.ones((1, 128)),
               "O[m, d] = m + 1: the rows of the register A fragment (p_fragment)"),
    "v_dims": ((_KEYS == 0) * np.ones((64, 1)), (_KEY == 0) * (_COL + 1.0),
               "O[m, d] = d + 1: V's dims within a 128-byte row (the transpose bit) or the leading byte "
               "offset to the second panel (dims 64-127)"),
    "keys_in_a_step": ((_KEYS == _ROW[:64] % 16) * 1.0, (_KEY < 16) * (_KEY + 1.0) * np.ones((1, 128)),
                       "O[m, d] = m % 16 + 1: which keys each A register holds, or the stride byte offset "
                       "between a step's two 8-key halves"),
    "key_steps": (_INTS.integers(-3, 4, (64, 64)) * 1.0, _INTS.integers(-3, 4, (64, 128)) * 1.0,
                  "O = P V over 64 keys: the V descriptor's advance of 16 keys (2048 bytes) per step"),
}


@pytest.mark.parametrize("consumer", [0, 1])
@pytest.mark.parametrize("name", QK_PROBES)
def test_s_equals_q_k_transposed_on_known_operands(gpu, probe, name, consumer):
    q, k, suspect = QK_PROBES[name]
    s = gpu.upload(np.full((64, 64), np.nan, np.float32))
    args = [s, gpu.upload(q.astype(np.float32), DType.bfloat16), gpu.upload(k.astype(np.float32), DType.bfloat16),
            np.int32(consumer)]
    probe("qk_probe_kernel").launch(1, 128, args, shared_mem=1024 + (128 + 64) * 256, stream=gpu.stream)
    got, expected = gpu.download(s), q[64 * consumer:64 * consumer + 64] @ k.T
    assert np.array_equal(got, expected), f"{suspect}\n{_where_wrong(got, expected)}"


@pytest.mark.parametrize("name", PV_PROBES)
def test_o_equals_p_v_with_p_in_registers_on_known_operands(gpu, probe, name):
    p, v, suspect = PV_PROBES[name]
    o = gpu.upload(np.full((64, 128), np.nan, np.float32))
    args = [o, gpu.upload(p.astype(np.float32)), gpu.upload(v.astype(np.float32), DType.bfloat16)]
    probe("pv_probe_kernel").launch(1, 128, args, shared_mem=1024 + 64 * 256, stream=gpu.stream)
    got, expected = gpu.download(o), p @ v
    assert np.array_equal(got, expected), f"{suspect}\n{_where_wrong(got, expected)}"


# ---- the kernel, end to end ----

def upload_batch(gpu, batch, dtype: str):
    """(q, k_cache, v_cache) on the device, the same as float32 host arrays, and the metadata."""
    tensors = tuple(gpu.upload(a, dtype) for a in (batch.q, batch.k_cache, batch.v_cache))
    return tensors, tuple(gpu.download(t).astype(np.float32) for t in tensors), upload_meta(gpu, batch.meta)


def run_both(gpu, batch, dtype: str, scale: float):
    """(wgmma output, mma.sync output, (q, k_cache, v_cache) as the device holds them), float32."""
    (q, k_cache, v_cache), held, meta = upload_batch(gpu, batch, dtype)
    outs = []
    for launcher in (wgmma_prefill.prefill_attention_wgmma, attention.prefill_attention):
        out = gpu.empty(q.shape, q.dtype)
        launcher(out, q, k_cache, v_cache, meta, scale, gpu.stream)
        outs.append(gpu.download(out))
    return outs[0], outs[1], held


def check(gpu, rel_error, tolerance, batch, dtype: str, scale: float) -> None:
    by_wgmma, by_mma, held = run_both(gpu, batch, dtype, scale)
    assert rel_error(by_wgmma, dense_attention(*held, batch.meta, scale)) <= tolerance[dtype]
    assert rel_error(by_wgmma, by_mma) <= tolerance[dtype]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("query_len", [1, 63, 64, 65, 127, 128, 129])
def test_one_prompt_matches_dense_and_mma_sync(gpu, rel_error, tolerance, dtype, query_len):
    batch = make_batch(np.random.default_rng(query_len), [query_len], [query_len], 32, 4, 128, 16)
    check(gpu, rel_error, tolerance, batch, dtype, 128 ** -0.5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
# The producer steps each thread's key through the blocks 64 keys a tile: blocks that divide a
# tile (8, 16, 32), that straddle it (24, 48) and that span several tiles (128).
@pytest.mark.parametrize("block_size", [8, 16, 24, 32, 48, 128])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 4), (12, 1), (8, 8)])
def test_mixed_step_with_chunks_after_cached_context(gpu, rel_error, tolerance, dtype, block_size, num_q_heads,
                                                     num_kv_heads):
    """MIXED: a single token, a fresh odd prompt, chunks after cached context, a decode, a long prompt."""
    batch = make_batch(np.random.default_rng(block_size + num_q_heads), *MIXED, num_q_heads, num_kv_heads, 128,
                       block_size)
    check(gpu, rel_error, tolerance, batch, dtype, 128 ** -0.5)


@pytest.mark.parametrize("block_size", [16, 32, 48])
def test_chunked_prefill_of_long_cached_prefixes(gpu, rel_error, tolerance, block_size):
    """Chunks whose first rows already see many key tiles, and whose last tile is partial."""
    batch = make_batch(np.random.default_rng(block_size), [256, 100, 1, 77], [1280, 137, 700, 77 + 515], 32, 8, 128,
                       block_size)
    check(gpu, rel_error, tolerance, batch, "bfloat16", 0.1)


def sampled_dense(held, meta: AttentionMetadata, scale: float, tokens: np.ndarray) -> np.ndarray:
    """dense_attention of some tokens of a one-sequence step: each as a one-token sequence at its position."""
    q, k_cache, v_cache = held
    context = int(meta.seq_lens[0]) - int(meta.query_start_loc[1])
    seq_lens = (context + tokens + 1).astype(np.int32)
    single = AttentionMetadata(query_start_loc=np.arange(len(tokens) + 1, dtype=np.int32), seq_lens=seq_lens,
                               block_tables=np.repeat(meta.block_tables[:1], len(tokens), axis=0),
                               slot_mapping=np.zeros(len(tokens), np.int32), max_query_len=1,
                               max_seq_len=int(seq_lens.max()))
    return dense_attention(q[tokens], k_cache, v_cache, single, scale)


@pytest.mark.parametrize("num_kv_heads", [4, 8])  # Qwen3-30B-A3B and Llama-3.1-8B heads
def test_4096_token_prompt(gpu, rel_error, tolerance, num_kv_heads):
    """The whole output against mma.sync; sampled tokens (block edges, the end) against float64."""
    batch = make_batch(np.random.default_rng(num_kv_heads), [4096], [4096], 32, num_kv_heads, 128, 16)
    by_wgmma, by_mma, held = run_both(gpu, batch, "bfloat16", 128 ** -0.5)
    assert rel_error(by_wgmma, by_mma) <= tolerance["bfloat16"]
    tokens = np.unique(np.r_[0, 1, 15, 16, 127, 128, 129, 2047, 4094, 4095,
                             np.random.default_rng(0).integers(0, 4096, 22)])
    expected = sampled_dense(held, batch.meta, 128 ** -0.5, tokens)
    assert rel_error(by_wgmma[tokens], expected) <= tolerance["bfloat16"]


def test_graph_replay_is_deterministic_and_reads_new_inputs(gpu, rel_error, tolerance):
    from cuda.bindings import driver

    from sparkd.backend.cuda.driver import call
    from sparkd.backend.cuda.graphs import capture
    from sparkd.backend.cuda.transfer import copy_to_device
    from sparkd.backend.dtypes import encode

    batch = make_batch(np.random.default_rng(12), *MIXED, 32, 4, 128, 16)
    (q, k_cache, v_cache), held, meta = upload_batch(gpu, batch, "bfloat16")
    out = gpu.empty(q.shape, q.dtype)

    def launch() -> None:
        wgmma_prefill.prefill_attention_wgmma(out, q, k_cache, v_cache, meta, 0.1, gpu.stream)

    launch()  # eagerly first: loads the kernel outside the capture
    eager = gpu.download(out)
    graph, _ = capture(gpu.stream, launch)
    try:
        call(driver.cuMemsetD16Async, out.ptr, 0x7FC0, out.numel, gpu.stream.handle)  # NaN: unwritten rows show
        graph.replay(gpu.stream)
        assert np.array_equal(gpu.download(out), eager)
        copy_to_device(q, encode(-batch.q, DType.bfloat16), gpu.stream)
        gpu.stream.synchronize()
        graph.replay(gpu.stream)
        expected = dense_attention(gpu.download(q), *held[1:], batch.meta, 0.1)
        assert rel_error(gpu.download(out), expected) <= tolerance["bfloat16"]
    finally:
        graph.destroy()
