"""Host side of the expert GEMM launchers (sparkd/backend/cuda/kernels/moe_gemm.py): the tile
rule and the preconditions. No GPU: every call here is refused before a kernel loads,
on tensors whose addresses are never touched."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings")

from device_fakes import fake_tensor
from moe_launcher_fakes import E, H, I, K, T, call_down, call_gate_up, gemm_routing

from sparkd.backend.cuda.kernels import moe_gemm


def _gate_up(routing=None, **operands):
    call_gate_up(moe_gemm.moe_gate_up, routing or gemm_routing(), **operands)


def _down(routing=None, **operands):
    call_down(moe_gemm.moe_down, routing or gemm_routing(), **operands)


@pytest.mark.parametrize("num_pairs,num_experts,tile", [
    (1, 128, 8), (8, 128, 8), (128, 128, 8), (129, 128, 8), (256, 128, 8), (257, 128, 16), (512, 128, 16),
    (513, 128, 32), (10, 8, 8), (16, 8, 8), (17, 8, 16), (32, 8, 16), (33, 8, 32), (2056, 8, 32), (5, 1, 32)])
def test_tile_holds_four_times_the_mean_rows_per_expert(num_pairs, num_experts, tile):
    """The smallest tile >= 4 x P / E rows (so a Poisson-spread expert rarely needs a second
    pass over its weights), at most the largest."""
    assert moe_gemm.expert_tile(num_pairs, num_experts) == tile


@pytest.mark.parametrize("tiles,slots,k_steps,split", [
    (96, 8, 64, 2), (128, 8, 24, 1), (96, 128, 64, 1), (256, 2, 448, 2), (97, 4, 64, 4), (97, 4, 24, 2)])
def test_k_split_keeps_one_wave_of_warps(tiles, slots, k_steps, split):
    assert moe_gemm.choose_k_split(tiles, slots, k_steps, 132) == split


def test_every_kernel_and_tile_is_registered():
    names = {spec.name for spec in moe_gemm.SPECS}
    for kernel in ("moe_gate_up_kernel", "moe_down_kernel"):
        for c_type in ("float", "__half", "__nv_bfloat16"):
            assert {f"{kernel}<{c_type}, {tile}>" for tile in moe_gemm.M_TILES} <= names
    assert all(spec.source == "moe_gemm.cu" for spec in moe_gemm.SPECS)


def test_k_must_be_whole_16_byte_chunks():
    with pytest.raises(ValueError, match=r"H \(60\) must be a multiple of 8 for bfloat16"):
        _gate_up(x=fake_tensor((T, 60)), gate_up=fake_tensor((E, 2 * I, 60)))
    with pytest.raises(ValueError, match=r"I \(30\) must be a multiple of 8 for bfloat16"):
        _gate_up(hidden=fake_tensor((T * K, 30)), gate_up=fake_tensor((E, 60, H)))
    with pytest.raises(ValueError, match=r"I \(6\) must be a multiple of 4 for float32"):
        _down(expert_out=fake_tensor((T * K, H), "float32"), hidden=fake_tensor((T * K, 6), "float32"),
              down=fake_tensor((E, H, 6), "float32"))
    with pytest.raises(ValueError, match=r"x's row stride \(68\) must be a multiple of 8"):
        _gate_up(x=fake_tensor((T, H), strides=(68, 1)))


def test_one_token_needs_no_row_stride():
    with pytest.raises(ValueError, match="needs gate_up 16-byte aligned"):  # past the stride check, stopped after
        _gate_up(hidden=fake_tensor((K, I)), x=fake_tensor((1, H), strides=(68, 1)), gate_up=fake_tensor((E, 2 * I, H), ptr=0x10008),
                 routing=gemm_routing(K))


def test_operands_must_be_16_byte_aligned():
    with pytest.raises(ValueError, match="needs x 16-byte aligned, got 0x10008"):
        _gate_up(x=fake_tensor((T, H), ptr=0x10008))
    with pytest.raises(ValueError, match="needs down 16-byte aligned"):
        _down(down=fake_tensor((E, H, I), ptr=0x10004))


def test_shapes_and_dtypes_must_agree():
    with pytest.raises(ValueError, match=r"gate_up must be \[E, 2I, H\]"):
        _gate_up(gate_up=fake_tensor((E, 2 * I)))
    with pytest.raises(ValueError, match="gate_up's last dim must be x's hidden size 64"):
        _gate_up(gate_up=fake_tensor((E, 2 * I, 72)))
    with pytest.raises(ValueError, match="gate_up must be bfloat16 like the activations, got float16"):
        _gate_up(gate_up=fake_tensor((E, 2 * I, H), "float16"))
    with pytest.raises(ValueError, match=r"hidden must be \[6, 32\] bfloat16, got \[6, 32\] float32"):
        _gate_up(hidden=fake_tensor((T * K, I), "float32"))
    with pytest.raises(ValueError, match="x must be float32 or float16 or bfloat16, got int32"):
        _gate_up(x=fake_tensor((T, H), "int32"))
    with pytest.raises(ValueError, match="top_k must be at least 1, got 0"):
        _gate_up(top_k=0)
    with pytest.raises(ValueError, match=r"expert_out must be \[6, 64\] bfloat16, got \[6, 64\] float32"):
        _down(expert_out=fake_tensor((T * K, H), "float32"))
    with pytest.raises(ValueError, match=r"expert_out must be \[6, 64\] float16, got \[6, 64\] bfloat16"):
        _down(hidden=fake_tensor((T * K, I), "float16"), down=fake_tensor((E, H, I), "float16"))
    with pytest.raises(ValueError, match="down's last dim must be hidden's intermediate size 32"):
        _down(down=fake_tensor((E, H, 40)))
    with pytest.raises(ValueError, match="down must be contiguous"):
        _down(down=fake_tensor((E, H, I), strides=(H * I * 2, I, 1)))


def test_routing_tensors_must_fit_pairs_and_experts():
    sorted_pairs, offsets, active, num_active = gemm_routing()
    with pytest.raises(ValueError, match=r"sorted_pairs must be \[6\] int32, got \[5\] int32"):
        _gate_up(routing=[fake_tensor((5,), "int32"), offsets, active, num_active])
    with pytest.raises(ValueError, match=r"offsets must be \[9\] int32, got \[9\] int64"):
        _down(routing=[sorted_pairs, fake_tensor((E + 1,), "int64"), active, num_active])
    with pytest.raises(ValueError, match=r"active_experts must be \[6\] int32"):
        _down(routing=[sorted_pairs, offsets, fake_tensor((E,), "int32"), num_active])
    with pytest.raises(ValueError, match=r"num_active must be \[1\] int32"):
        _gate_up(routing=[sorted_pairs, offsets, active, fake_tensor((2,), "int32")])
