"""Host side of the Hopper wgmma prefill attention (kernels/attention_prefill_wgmma.py): the rule
CudaOps picks it by, the sm_90a build next to the sm_120 trap, the grid, the shared memory and
register budgets, and the preconditions. No GPU: launches are refused before a kernel loads, on
tensors whose addresses are never touched."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from device_fakes import Sm120Device, fake_tensor

from sparkd.backend.cuda import compiler
from sparkd.backend.cuda.attention_metadata import CudaAttentionMetadata
from sparkd.backend.cuda.kernels import attention_prefill_wgmma as wgmma_prefill
from sparkd.backend.cuda.kernels import moe_grouped_wgmma
from sparkd.backend.dtypes import DType

HOPPER_SHARED_OPTIN = 232448  # 227 KiB a block
RESERVED_SHARED = 1024  # what sm_90 keeps of each block's shared memory
T, HQ, HKV, D, NB, BS, B = 5, 8, 2, 128, 4, 16, 2


def _meta(num_seqs=B, max_query_len=3):
    return CudaAttentionMetadata(fake_tensor((num_seqs + 1,), "int32"), fake_tensor((num_seqs,), "int32"),
                                 fake_tensor((num_seqs, 2), "int32"), fake_tensor((T,), "int32"), max_query_len, 40)


def _launch(dtype="bfloat16", head_dim=D, meta=None):
    q = fake_tensor((T, HQ, head_dim), dtype)
    cache = fake_tensor((NB, HKV, BS, head_dim), dtype)
    wgmma_prefill.prefill_attention_wgmma(fake_tensor((T, HQ, head_dim), dtype), q, cache, cache,
                                          meta or _meta(), 0.1, None)


@pytest.mark.parametrize("arch,dtype,head_dim,expected", [
    ("sm_90", DType.bfloat16, 128, True), ("sm_90", DType.float16, 128, True),
    ("sm_90", DType.float32, 128, False), ("sm_90", DType.bfloat16, 64, False), ("sm_90", DType.bfloat16, 256, False),
    ("sm_120", DType.bfloat16, 128, False), ("sm_100", DType.bfloat16, 128, False), ("sm_80", DType.float16, 128, False)])
def test_wgmma_prefill_is_picked_on_sm_90_for_half_types_at_head_dim_128(arch, dtype, head_dim, expected):
    assert wgmma_prefill.use_wgmma_prefill(arch, dtype, head_dim, wgmma_prefill.MIN_QUERY_LEN) is expected


def test_wgmma_prefill_is_picked_only_for_a_long_enough_query():
    assert not wgmma_prefill.use_wgmma_prefill("sm_90", DType.bfloat16, 128, wgmma_prefill.MIN_QUERY_LEN - 1)


def test_a_launch_off_sm_90_is_refused_before_any_kernel_loads(monkeypatch):
    monkeypatch.setattr(wgmma_prefill, "current_device", lambda: Sm120Device())
    monkeypatch.setattr(wgmma_prefill, "get_kernel", lambda spec: pytest.fail(f"{spec} was loaded"))
    with pytest.raises(ValueError, match="the wgmma prefill attention runs on sm_90 only, this device is sm_120"):
        _launch()


@pytest.mark.parametrize("dtype,head_dim,message", [
    ("float32", D, "q dtype float32 is not supported by the wgmma prefill"),
    ("bfloat16", 64, "head_dim 64 is not supported by the wgmma prefill; expected 128"),
    ("bfloat16", 96, "head_dim 96 is not supported"),  # the shared check of attention.prefill_attention
])
def test_unsupported_dtypes_and_head_dims_are_refused(monkeypatch, dtype, head_dim, message):
    monkeypatch.setattr(wgmma_prefill, "get_kernel", lambda spec: pytest.fail(f"{spec} was loaded"))
    with pytest.raises(ValueError, match=message):
        _launch(dtype, head_dim)


def test_an_empty_step_launches_nothing(monkeypatch):
    monkeypatch.setattr(wgmma_prefill, "current_device", lambda: pytest.fail("the device was asked"))
    _launch(meta=_meta(num_seqs=0))


def test_every_kernel_is_registered_for_the_half_types_and_built_with_the_rest():
    assert {spec.name for spec in wgmma_prefill.SPECS} == {
        "prefill_attention_wgmma_kernel<__nv_bfloat16>", "prefill_attention_wgmma_kernel<__half>"}
    assert all(spec.source == "attention_prefill_wgmma.cu" for spec in wgmma_prefill.SPECS)
    assert set(wgmma_prefill.SPECS) <= set(compiler.all_kernel_specs())


@pytest.mark.parametrize("arch,target", [("sm_90", "sm_90a"), ("sm_120", "sm_120")])
def test_the_kernels_build_for_sm90a_and_as_traps_for_sm_120(tmp_path, monkeypatch, arch, target):
    monkeypatch.setenv("SPARKD_CACHE_DIR", str(tmp_path))
    module = compiler.compile_specs("attention_prefill_wgmma.cu", [spec.name for spec in wgmma_prefill.SPECS], arch)
    assert module.arch == target
    assert (b"sm_90a" in module.cubin) is (target == "sm_90a")


def test_the_grid_puts_kv_heads_fastest_and_counts_row_tiles_of_the_longest_query():
    # Qwen3-30B at 4096 tokens: 4096 tokens x 8 heads a kv head = 256 tiles of 128 rows, 4 kv heads.
    assert wgmma_prefill.grid(4096, 8, 4, 1) == (1024, 1)
    # 8 prompts of 1024 with Llama heads: 1024 x 4 / 128 = 32 tiles x 8 kv heads, 8 sequences.
    assert wgmma_prefill.grid(1024, 4, 8, 8) == (256, 8)
    # One token of a group of 4 still gets one (mostly empty) tile.
    assert wgmma_prefill.grid(1, 4, 8, 3) == (8, 3)


def test_the_q_tile_and_four_stages_of_k_and_v_fit_hoppers_shared_memory():
    # A Q tile of 128 rows, 4 stages of a K and a V tile of 64 keys, rows of 128 bf16; 13 barriers.
    assert wgmma_prefill.SMEM_BYTES == 1024 + (128 + 4 * 2 * 64) * 128 * 2 + 8 * 13 == 164968
    assert wgmma_prefill.SMEM_BYTES + RESERVED_SHARED <= HOPPER_SHARED_OPTIN


def test_the_register_budgets_are_those_the_shared_check_enforces():
    """setmaxnreg moves 56 / 224 / 224 registers within a pool of 384 x 168, as in the expert GEMMs,
    whose launch check (168 registers a thread) this launcher reuses."""
    assert wgmma_prefill._THREADS == 384 and moe_grouped_wgmma._LAUNCH_REGISTERS == 168
    assert 128 * (56 + 2 * 224) <= 384 * 168
