"""Host side of the Hopper wgmma expert GEMMs (kernels/moe_grouped_wgmma.py): the sm_90-only rule
CudaOps will pick them by, the sm_90a build (compiler.target_arch) next to a plain sm_120 one,
the persistent grid, the shared memory and register budgets, and the preconditions. No GPU:
launches are refused before a kernel loads, on tensors whose addresses are never touched."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from device_fakes import Sm120Device, fake_tensor
from moe_launcher_fakes import E, H, I, K, T, call_down, call_gate_up, grouped_plan

from sparkd.backend.cuda import compiler, tensor_map
from sparkd.backend.cuda.kernels import moe_grouped_gemm
from sparkd.backend.cuda.kernels import moe_grouped_wgmma as wgmma

HOPPER_SHARED_OPTIN = 232448  # 227 KiB a block
RESERVED_SHARED = 1024  # what sm_90 keeps of each block's shared memory


def _gate_up(plan=None, **operands):
    call_gate_up(wgmma.moe_grouped_gate_up, plan or grouped_plan(), **operands)


def _down(plan=None, **operands):
    call_down(wgmma.moe_grouped_down, plan or grouped_plan(), **operands)


@pytest.mark.parametrize("arch,expected", [("sm_90", True), ("sm_120", False), ("sm_100", False), ("sm_89", False),
                                           ("sm_80", False)])
def test_wgmma_is_picked_on_sm_90_only(arch, expected):
    assert wgmma.use_wgmma(arch) is expected


def test_a_launch_off_sm_90_is_refused_before_any_kernel_loads(monkeypatch):
    monkeypatch.setattr(wgmma, "current_device", lambda: Sm120Device())
    monkeypatch.setattr(wgmma, "get_kernel", lambda spec: pytest.fail(f"{spec} was loaded"))
    with pytest.raises(ValueError, match="the wgmma expert GEMMs run on sm_90 only, this device is sm_120"):
        _gate_up()
    with pytest.raises(ValueError, match="run on sm_90 only"):
        _down()


def test_every_kernel_is_registered_for_the_half_types_and_built_with_the_rest():
    names = {spec.name for spec in wgmma.SPECS}
    assert names == {f"{kernel}<{c_type}, {cluster}>" for kernel in ("moe_grouped_gate_up_wgmma_kernel",
                                                                     "moe_grouped_down_wgmma_kernel")
                     for c_type in ("__half", "__nv_bfloat16") for cluster in (1, 2)}


@pytest.mark.parametrize("model,tokens,gate_up,down", [
    ((8, 2, 4096, 14336), 4096, 2, 2), ((8, 2, 4096, 14336), 512, 2, 2),  # Mixtral
    ((128, 8, 4096, 1536), 4096, 2, 1), ((128, 8, 4096, 1536), 512, 1, 1),  # Qwen3-235B
    ((128, 8, 2048, 768), 4096, 1, 1), ((512, 10, 2048, 512), 4096, 1, 1)])  # Qwen3-30B, Qwen3-Next
def test_weight_slices_are_shared_in_pairs_where_k_is_long_and_experts_have_a_whole_m_tile(model, tokens, gate_up,
                                                                                        down):
    """The measured cases of session 23: pairs won each GEMM given 2 here and lost each given 1."""
    num_experts, top_k, hidden_size, inter = model
    num_pairs = tokens * top_k
    assert wgmma.cluster_size(num_pairs, num_experts, hidden_size) == gate_up
    assert wgmma.cluster_size(num_pairs, num_experts, inter) == down


def test_a_source_that_tests_the_sm90a_feature_macro_is_built_for_sm90a_on_sm_90_only():
    plain = {"k.cu": b'#include "h.cuh"\n', "h.cuh": b"__global__ void k() {}\n"}
    featured = {**plain, "h.cuh": b"#if defined(__CUDA_ARCH_FEAT_SM90_ALL)\n#endif\n"}
    assert compiler.target_arch(featured, "sm_90") == "sm_90a"
    assert compiler.target_arch(plain, "sm_90") == "sm_90"
    assert compiler.target_arch(featured, "sm_120") == "sm_120"


@pytest.mark.parametrize("arch,target", [("sm_90", "sm_90a"), ("sm_120", "sm_120")])
def test_the_kernels_build_for_sm90a_and_as_traps_for_sm_120(tmp_path, monkeypatch, arch, target):
    monkeypatch.setenv("SPARKD_CACHE_DIR", str(tmp_path))
    module = compiler.compile_specs("moe_grouped_wgmma.cu", [spec.name for spec in wgmma.SPECS], arch)
    assert module.arch == target
    assert (b"sm_90a" in module.cubin) is (target == "sm_90a")  # the CUBIN records its arch-specific target


def test_the_persistent_grid_is_the_clusters_the_device_holds_or_the_most_cluster_tiles_any_routing_has():
    # Qwen3-30B at 4096 tokens: P = 32768 over 128 experts makes up to 384 M-tiles (256 + 128 partial
    # ones), in pairs at most 128 + 128 cluster tiles; 6 gate_up weight tiles.
    assert moe_grouped_gemm.max_m_tiles(32768, 128) == 384
    assert moe_grouped_gemm.max_m_tiles(32768, 128, 2 * moe_grouped_gemm.TILE_M) == 256
    assert wgmma.persistent_blocks(32768, 128, 6, 132, cluster=1) == 132
    assert wgmma.persistent_blocks(32768, 128, 6, 66, cluster=2) == 132
    # 6 pairs over 8 experts: at most 1 + 6 cluster tiles of either size, 1 weight tile.
    assert wgmma.persistent_blocks(6, 8, 1, 132, cluster=1) == 7
    assert wgmma.persistent_blocks(6, 8, 1, 66, cluster=2) == 14


@pytest.mark.parametrize("cluster", [1, 2])
def test_the_cluster_tile_bound_holds_for_every_routing_of_a_few_pairs(cluster):
    """Exhaustive over the ways of placing P pairs on E experts (as row counts): sum_e ceil(count_e /
    (cluster * 128)) never passes the bound the grid is sized by, and meets it for some routing."""
    def routings(pairs, experts):
        if experts == 1:
            yield (pairs,)
            return
        for first in range(pairs + 1):
            for rest in routings(pairs - first, experts - 1):
                yield (first,) + rest

    rows = cluster * moe_grouped_gemm.TILE_M
    for pairs, experts in [(1, 3), (rows - 1, 3), (rows + 1, 3), (2 * rows + 2, 3)]:
        worst = max(sum(-(-count // rows) for count in counts) for counts in routings(pairs, experts))
        assert worst <= moe_grouped_gemm.max_m_tiles(pairs, experts, rows)


def test_the_ring_of_4_stages_fits_hoppers_shared_memory():
    """Alignment slack, 4 stages of 128 activation rows and 256 weight rows of 128 bytes, 8 barriers;
    beside them the static cluster_starts of up to 1024 experts (6144 bytes as ptxas lays it out)."""
    assert wgmma.SMEM_BYTES == 1024 + 4 * (128 + 256) * 128 + 8 * 8 == 197696
    static_shared = 6144
    assert 4 * (1024 + 1) <= static_shared
    assert wgmma.SMEM_BYTES + static_shared + RESERVED_SHARED <= HOPPER_SHARED_OPTIN


class _Kernel:
    name, function = "moe_grouped_down_wgmma_kernel<__nv_bfloat16, 2>", object()


@pytest.mark.parametrize("registers", [168, 160])
def test_a_build_with_fewer_registers_than_the_setmaxnreg_budgets_is_refused(monkeypatch, registers):
    """setmaxnreg moves registers within the block's pool: 128 * 56 + 256 * 224 = 384 * 168."""
    monkeypatch.setattr(wgmma, "call", lambda fn, attribute, function: registers)
    monkeypatch.setattr(wgmma, "_budgets_checked", set())
    if registers >= 168:
        wgmma._require_register_budget(_Kernel())
    else:
        with pytest.raises(RuntimeError, match="built with 160 registers a thread; its setmaxnreg budgets need 168"):
            wgmma._require_register_budget(_Kernel())


def test_the_operand_rules_are_the_grouped_gemms():
    with pytest.raises(ValueError, match="x must be float16 or bfloat16, got float32"):
        _gate_up(hidden=fake_tensor((T * K, I), "float32"), x=fake_tensor((T, H), "float32"),
                 gate_up=fake_tensor((E, 2 * I, H), "float32"))
    with pytest.raises(ValueError, match="hidden must be float16 or bfloat16, got float32"):
        _down(hidden=fake_tensor((T * K, I), "float32"), down=fake_tensor((E, H, I), "float32"))
    with pytest.raises(ValueError, match=r"H \(60\) must be a multiple of 8 for bfloat16"):
        _gate_up(x=fake_tensor((T, 60)), gate_up=fake_tensor((E, 2 * I, 60)))
    with pytest.raises(ValueError, match=r"x's row stride \(68\) must be a multiple of 8"):
        _gate_up(x=fake_tensor((T, H), strides=(68, 1)))
    with pytest.raises(ValueError, match="needs expert_out 16-byte aligned"):
        _down(expert_out=fake_tensor((T * K, H), ptr=0x10008))
    with pytest.raises(ValueError, match=r"expert_out must be \[6, 64\] bfloat16, got \[6, 64\] float32"):
        _down(expert_out=fake_tensor((T * K, H), "float32"))


def test_the_plan_tensors_must_fit_pairs_and_experts():
    sorted_pairs, offsets, tile_starts = grouped_plan()
    with pytest.raises(ValueError, match=r"sorted_pairs must be \[6\] int32, got \[5\] int32"):
        _gate_up(plan=[fake_tensor((5,), "int32"), offsets, tile_starts])
    with pytest.raises(ValueError, match=r"tile_starts must be \[9\] int32, got \[8\] int32"):
        _down(plan=[sorted_pairs, offsets, fake_tensor((E,), "int32")])


def test_the_weights_tensor_map_refuses_what_tma_cannot_describe(monkeypatch):
    """swizzled_boxes checks before it encodes (the encoding is the driver's, on a GPU machine)."""
    monkeypatch.setattr(tensor_map, "_encode", lambda *args: pytest.fail("encoded"))
    with pytest.raises(ValueError, match="maps bf16 or fp16 tensors, got float32"):
        tensor_map.swizzled_boxes(fake_tensor((E, H, I), "float32"), 128)
    with pytest.raises(ValueError, match="maps a contiguous 3-D tensor"):
        tensor_map.swizzled_boxes(fake_tensor((H, I)), 128)
    with pytest.raises(ValueError, match="maps a contiguous 3-D tensor"):
        tensor_map.swizzled_boxes(fake_tensor((E, H, I), strides=(H * I * 2, I * 2, 1)), 128)
    with pytest.raises(ValueError, match="16-byte aligned rows and address"):
        tensor_map.swizzled_boxes(fake_tensor((E, H, 12)), 128)
    with pytest.raises(ValueError, match="16-byte aligned rows and address"):
        tensor_map.swizzled_boxes(fake_tensor((E, H, I), ptr=0x10008), 128)
    with pytest.raises(ValueError, match="a box has 1 to 256 rows, got 512"):
        tensor_map.swizzled_boxes(fake_tensor((E, H, I)), 512)
