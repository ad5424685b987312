"""Host side of the tensor-core expert GEMM launchers (kernels/moe_grouped_gemm.py): the rule
CudaOps picks them by, the grid bound, the shared memory and the preconditions. No GPU:
every call here is refused before a kernel loads, on tensors whose addresses are never touched."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cuda.bindings")

from device_fakes import fake_tensor
from moe_launcher_fakes import E, H, I, K, T, call_down, call_gate_up, grouped_plan

from sparkd.backend.cuda.kernels import moe_grouped_gemm as grouped
from sparkd.backend.dtypes import DType


def _gate_up(plan=None, **operands):
    call_gate_up(grouped.moe_grouped_gate_up, plan or grouped_plan(), **operands)


def _down(plan=None, **operands):
    call_down(grouped.moe_grouped_down, plan or grouped_plan(), **operands)


@pytest.mark.parametrize("num_pairs,num_experts,dtype,expected", [
    (2048 * 8, 128, "bfloat16", True), (2048, 128, "float16", True), (2047, 128, "bfloat16", False),
    (64 * 8, 128, "bfloat16", False), (4096 * 8, 128, "float32", False), (16, 1, "bfloat16", True)])
def test_tensor_cores_take_batches_with_16_rows_per_expert(num_pairs, num_experts, dtype, expected):
    assert grouped.use_grouped_gemm(num_pairs, num_experts, DType.parse(dtype)) is expected


def test_the_grid_covers_the_tiles_of_any_routing():
    """sum_e ceil(count_e / TILE_M) <= max_m_tiles(P, E) for even, skewed and one-hot routings."""
    rng = np.random.default_rng(0)
    for num_pairs, num_experts in [(1, 8), (63, 8), (65, 128), (2048 * 8, 128), (257 * 2, 128), (4096, 1)]:
        routings = [rng.integers(0, num_experts, num_pairs), np.zeros(num_pairs, np.int64),
                    np.arange(num_pairs) % num_experts, rng.integers(0, min(2, num_experts), num_pairs)]
        for expert_ids in routings:
            counts = np.bincount(expert_ids, minlength=num_experts)
            tiles = int(np.sum(-(-counts // grouped.TILE_M)))
            assert tiles <= grouped.max_m_tiles(num_pairs, num_experts)
    # Nearly tight: 8 experts of TILE_M + 1 rows need 16 tiles, the grid has 17 slots.
    assert grouped.max_m_tiles(8 * (grouped.TILE_M + 1), 8) == 17


def test_shared_memory_is_the_a_and_b_slices_of_every_stage():
    """A stage holds 128 activation rows and 256 weight rows of 64 16-bit elements, unpadded (swizzled)."""
    assert grouped.smem_bytes(4) == 4 * (128 + 256) * 64 * 2 == 196608
    assert grouped.smem_bytes(2) == 98304


def test_the_pipeline_is_as_deep_as_the_devices_shared_memory_allows():
    assert grouped.pipeline_stages(232448) == 4  # Hopper: 227 KiB per block
    assert grouped.pipeline_stages(101376) == 2  # sm_120: 99 KiB per block
    with pytest.raises(ValueError, match="need 98304 bytes of shared memory per block, this device allows 65536"):
        grouped.pipeline_stages(65536)
    with pytest.raises(ValueError, match=r"stages must be one of \(4, 2\) or None, got 3"):
        grouped.moe_grouped_down(fake_tensor((T * K, H)), fake_tensor((T * K, I)), fake_tensor((E, H, I)),
                                 *grouped_plan()[1:], None, stages=3)


def test_every_kernel_is_registered_for_the_half_types():
    names = {spec.name for spec in grouped.SPECS}
    assert "moe_tile_plan_kernel" in names
    for kernel in ("moe_grouped_gate_up_kernel", "moe_grouped_down_kernel"):
        assert {f"{kernel}<{c_type}, {stages}>" for c_type in ("__half", "__nv_bfloat16") for stages in (4, 2)} <= names
        assert not any(name.startswith(f"{kernel}<float") for name in names)
    assert all(spec.source == "moe_grouped_gemm.cu" for spec in grouped.SPECS)


def test_fp32_stays_on_moe_gemm():
    with pytest.raises(ValueError, match="x must be float16 or bfloat16, got float32"):
        _gate_up(hidden=fake_tensor((T * K, I), "float32"), x=fake_tensor((T, H), "float32"),
                 gate_up=fake_tensor((E, 2 * I, H), "float32"))
    with pytest.raises(ValueError, match="hidden must be float16 or bfloat16, got float32"):
        _down(hidden=fake_tensor((T * K, I), "float32"), down=fake_tensor((E, H, I), "float32"))


def test_k_must_be_whole_16_byte_chunks_and_operands_aligned():
    with pytest.raises(ValueError, match=r"H \(60\) must be a multiple of 8 for bfloat16"):
        _gate_up(x=fake_tensor((T, 60)), gate_up=fake_tensor((E, 2 * I, 60)))
    with pytest.raises(ValueError, match=r"I \(30\) must be a multiple of 8 for bfloat16"):
        _down(hidden=fake_tensor((T * K, 30)), down=fake_tensor((E, H, 30)))
    with pytest.raises(ValueError, match=r"x's row stride \(68\) must be a multiple of 8"):
        _gate_up(x=fake_tensor((T, H), strides=(68, 1)))
    with pytest.raises(ValueError, match="needs hidden 16-byte aligned, got 0x10004"):
        _gate_up(hidden=fake_tensor((T * K, I), ptr=0x10004))
    with pytest.raises(ValueError, match="needs expert_out 16-byte aligned"):
        _down(expert_out=fake_tensor((T * K, H), ptr=0x10008))


def test_shapes_and_dtypes_must_agree():
    with pytest.raises(ValueError, match="gate_up's last dim must be x's hidden size 64"):
        _gate_up(gate_up=fake_tensor((E, 2 * I, 72)))
    with pytest.raises(ValueError, match="gate_up must be bfloat16 like the activations, got float16"):
        _gate_up(gate_up=fake_tensor((E, 2 * I, H), "float16"))
    with pytest.raises(ValueError, match="top_k must be at least 1, got 0"):
        _gate_up(top_k=0)
    with pytest.raises(ValueError, match=r"expert_out must be \[6, 64\] bfloat16, got \[6, 64\] float32"):
        _down(expert_out=fake_tensor((T * K, H), "float32"))
    with pytest.raises(ValueError, match="down's last dim must be hidden's intermediate size 32"):
        _down(down=fake_tensor((E, H, 40)))


def test_plan_tensors_must_fit_pairs_and_experts():
    sorted_pairs, offsets, tile_starts = grouped_plan()
    with pytest.raises(ValueError, match=r"sorted_pairs must be \[6\] int32, got \[5\] int32"):
        _gate_up(plan=[fake_tensor((5,), "int32"), offsets, tile_starts])
    with pytest.raises(ValueError, match=r"tile_starts must be \[9\] int32, got \[8\] int32"):
        _down(plan=[sorted_pairs, offsets, fake_tensor((E,), "int32")])
    with pytest.raises(ValueError, match=r"tile_starts must be \[9\] int32, got \[9\] int64"):
        grouped.plan_tiles(fake_tensor((E + 1,), "int64"), offsets, None)
    # 2^30 pairs make 2^23 + 8 M-tile slots; 256 weight tiles of H = 65536 push the grid past 2^31 - 1.
    with pytest.raises(ValueError, match="at most 2147483647 blocks, got 2147485696"):
        _down(expert_out=fake_tensor((2**30, 65536)), hidden=fake_tensor((2**30, I)), down=fake_tensor((E, 65536, I)),
              plan=[None, offsets, tile_starts])
