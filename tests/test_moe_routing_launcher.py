"""Host side of the MoE routing launchers (sparkd/backend/cuda/kernels/moe_routing.py and
moe_router.py), no GPU: the preconditions each launcher checks before it launches, the grids
and arguments it launches with, and the layout of the alignment buffers. Tensors here point
nowhere; a check that let one through would reach the driver and fail there instead of
raising ValueError."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from device_fakes import FakeAllocator, fake_tensor

from sparkd.backend.cuda.kernels import moe_router, moe_routing
from sparkd.backend.cuda.kernels.moe_routing import MoeAlignment
from sparkd.backend.cuda.tensor import DeviceTensor
from sparkd.backend.dtypes import DType


def fake(shape, dtype="float32", **where) -> DeviceTensor:
    return fake_tensor(shape, dtype, **where)


def route(logits, weights=None, expert_ids=None):
    num_tokens = logits.shape[0]
    weights = weights if weights is not None else fake((num_tokens, 2))
    expert_ids = expert_ids if expert_ids is not None else fake(weights.shape, "int32")
    moe_routing.moe_route(weights, expert_ids, logits, True, None)


@pytest.mark.parametrize("logits,weights,expert_ids,message", [
    (fake((4, 8, 1)), None, None, r"router_logits must be \[T, E\]"),
    (fake((4, 8), "int32"), None, None, "router_logits must be float32 or float16 or bfloat16, got int32"),
    (fake((4, 8), strides=(16, 2)), None, None, "unit column stride"),
    (fake((4, 1025)), None, None, "1 to 1024 experts, got E = 1025"),
    (fake((4, 8)), fake((3, 2)), None, r"weights must be \[T=4, top_k\]"),
    (fake((4, 8)), fake((4, 9)), fake((4, 9), "int32"), r"top_k must be between 1 and min\(E=8, 16\), got 9"),
    (fake((4, 64)), fake((4, 17)), fake((4, 17), "int32"), r"top_k must be between 1 and min\(E=64, 16\), got 17"),
    (fake((4, 8)), fake((4, 0)), fake((4, 0), "int32"), "got 0"),
    (fake((4, 8)), None, fake((4, 3), "int32"), r"expert_ids must be \[T, top_k\] = \(4, 2\)"),
    (fake((4, 8)), fake((4, 2), "bfloat16"), None, "weights must be float32, got bfloat16"),
    (fake((4, 8)), None, fake((4, 2), "float32"), "expert_ids must be int32, got float32"),
    (fake((4, 8)), fake((4, 2), strides=(4, 1)), None, "weights must be contiguous"),
])
def test_route_rejects_bad_operands(logits, weights, expert_ids, message):
    with pytest.raises(ValueError, match=message):
        route(logits, weights, expert_ids)


class _RecordedLaunch:
    """Stands in for a loaded kernel: each launch appends (name, grid, block) to `launches`,
    and its args to `arg_lists` when given."""

    def __init__(self, spec, launches, arg_lists=None):
        self.spec, self.launches, self.arg_lists = spec, launches, arg_lists

    def launch(self, grid, block, args, stream=None):
        self.launches.append((self.spec.name, grid, block))
        if self.arg_lists is not None:
            self.arg_lists.append(args)


@pytest.mark.parametrize("num_tokens,top_k,expected", [
    (1, 8, ("moe_route_align_warp_kernel<float>", 1, 32)), (4, 8, ("moe_route_align_warp_kernel<float>", 1, 32)),
    (32, 1, ("moe_route_align_warp_kernel<float>", 1, 32)), (5, 8, ("moe_route_align_kernel<float>", 1, 512)),
    (16, 8, ("moe_route_align_kernel<float>", 1, 512))])
def test_route_align_takes_one_warp_up_to_32_pairs(monkeypatch, num_tokens, top_k, expected):
    launches = []
    monkeypatch.setattr(moe_routing, "get_kernel", lambda spec: _RecordedLaunch(spec, launches))
    alignment = MoeAlignment.allocate(FakeAllocator(), num_tokens * top_k, 128)
    moe_routing.moe_route_align(fake((num_tokens, top_k)), fake((num_tokens, top_k), "int32"), alignment,
                                fake((num_tokens, 128)), True, None)
    assert launches == [expected]


def test_alignment_views_share_one_allocation():
    allocator = FakeAllocator()
    alignment = MoeAlignment.allocate(allocator, num_pairs=12, num_experts=64)
    [storage] = allocator.allocations
    assert storage.dtype is DType.int32 and storage.shape == (65 + 12 + 12 + 12 + 1,)
    views = [alignment.offsets, alignment.sorted_pairs, alignment.row_of_pair, alignment.active_experts,
             alignment.num_active]
    assert [v.shape for v in views] == [(65,), (12,), (12,), (12,), (1,)]  # min(E, P) active slots
    assert [v.ptr - storage.ptr for v in views] == [0, 4 * 65, 4 * 77, 4 * 89, 4 * 101]
    assert all(v.dtype is DType.int32 and v.is_contiguous for v in views)
    assert (alignment.num_pairs, alignment.num_experts) == (12, 64)
    assert MoeAlignment.allocate(allocator, 300, 8).active_experts.shape == (8,)


@pytest.mark.parametrize("num_pairs,num_experts,message", [
    (-1, 8, "num_pairs must not be negative"),
    (4, 0, "1 to 1024 experts, got E = 0"),
    (4, 1025, "1 to 1024 experts, got E = 1025"),
])
def test_alignment_rejects_bad_sizes(num_pairs, num_experts, message):
    with pytest.raises(ValueError, match=message):
        MoeAlignment.allocate(FakeAllocator(), num_pairs, num_experts)


def test_align_rejects_ids_that_do_not_fit_the_alignment():
    alignment = MoeAlignment.allocate(FakeAllocator(), 12, 8)
    with pytest.raises(ValueError, match="expert_ids has 10 pairs but the alignment is sized for 12"):
        moe_routing.moe_align(alignment, fake((5, 2), "int32"), None)
    with pytest.raises(ValueError, match="expert_ids must be int32, got int64"):
        moe_routing.moe_align(alignment, fake((6, 2), "int64"), None)
    with pytest.raises(ValueError, match="expert_ids must be contiguous"):
        moe_routing.moe_align(alignment, fake((6, 2), "int32", strides=(4, 1)), None)


def combine(out=None, expert_out=None, weights=None, row_of_pair=None):
    """Defaults: T = 3 tokens, k = 2, H = 16."""
    moe_routing.moe_combine(out if out is not None else fake((3, 16), "bfloat16"),
                            expert_out if expert_out is not None else fake((6, 16), "bfloat16"),
                            weights if weights is not None else fake((3, 2)),
                            row_of_pair if row_of_pair is not None else fake((6,), "int32"), None)


@pytest.mark.parametrize("operands,message", [
    ({"out": fake((3, 16, 1))}, "must be 2-D"),
    ({"weights": fake((4, 2))}, r"weights must be \[T=3, k\]"),
    ({"expert_out": fake((6, 15))}, r"expert_out must be \[T\*k, H\] = \(6, 16\)"),
    ({"weights": fake((3, 3))}, r"expert_out must be \[T\*k, H\] = \(9, 16\)"),
    ({"row_of_pair": fake((5,), "int32")}, r"row_of_pair must be \[T\*k\] = \[6\]"),
    ({"out": fake((3, 16), "int32")}, "out must be float32 or float16 or bfloat16, got int32"),
    ({"expert_out": fake((6, 16))}, "expert_out must be bfloat16, got float32"),
    ({"weights": fake((3, 2), "float16")}, "weights must be float32, got float16"),
    ({"row_of_pair": fake((6,), "int64")}, "row_of_pair must be int32, got int64"),
    ({"out": fake((3, 16), "bfloat16", strides=(32, 1))}, "out must be contiguous"),
    ({"expert_out": fake((6, 16), "bfloat16", strides=(1, 6))}, "expert_out must be contiguous"),
])
def test_combine_rejects_bad_operands(operands, message):
    with pytest.raises(ValueError, match=message):
        combine(**operands)



@pytest.mark.parametrize("dtype,hidden,out_ptr,rows_ptr,expected", [
    ("bfloat16", 16, 0x10000, 0x20000, ("moe_combine_kernel<__nv_bfloat16, 8>", (3, 1), 32)),
    ("float16", 4096, 0x10000, 0x20000, ("moe_combine_kernel<__half, 8>", (3, 2), 256)),
    ("float32", 12, 0x10000, 0x20000, ("moe_combine_kernel<float, 4>", (3, 1), 32)),
    ("bfloat16", 12, 0x10000, 0x20000, ("moe_combine_kernel<__nv_bfloat16, 1>", (3, 1), 32)),  # H not 16-byte rows
    ("bfloat16", 16, 0x10000, 0x20008, ("moe_combine_kernel<__nv_bfloat16, 1>", (3, 1), 32)),  # rows misaligned
    ("bfloat16", 16, 0x10008, 0x20000, ("moe_combine_kernel<__nv_bfloat16, 1>", (3, 1), 32)),  # out misaligned
])
def test_combine_moves_16_bytes_of_its_dtype_where_rows_and_addresses_allow(monkeypatch, dtype, hidden, out_ptr,
                                                                            rows_ptr, expected):
    """expert_out is in out's dtype: 8 bf16/fp16 or 4 fp32 columns a load when every row and both
    tensors start on 16 bytes, else one."""
    launches = []
    monkeypatch.setattr(moe_routing, "get_kernel", lambda spec: _RecordedLaunch(spec, launches))
    combine(out=fake((3, hidden), dtype, ptr=out_ptr), expert_out=fake((6, hidden), dtype, ptr=rows_ptr))
    assert launches == [expected]
    assert expected[0] in {spec.name for spec in moe_routing.SPECS}


# ---- the router GEMV with the routing and alignment in one launch (moe_router) ----

def router_operands(num_tokens=1, top_k=8, num_experts=128, width=4096, dtype="bfloat16") -> dict:
    """moe_router_route_align's operands for T tokens, k choices, E experts and K = width, by name."""
    return {"weights": fake((num_tokens, top_k)), "expert_ids": fake((num_tokens, top_k), "int32"),
            "alignment": MoeAlignment.allocate(FakeAllocator(), num_tokens * top_k, num_experts),
            "router_logits": fake((num_tokens, num_experts)), "router_input": fake((num_tokens, width), dtype),
            "router": fake((num_experts, width), dtype, ptr=0x400000)}


def route_router(operands: dict) -> None:
    moe_router.moe_router_route_align(**operands, renormalize=True, stream=None)


@pytest.mark.parametrize("num_experts,num_chunks,expected", [
    (128, 512, (128, 256, 8)),  # Qwen3-30B-A3B: K = 2 x 2048 bf16, a block of 8 warps an expert, ~one an SM
    (256, 512, (256, 256, 8)),
    (60, 512, (60, 256, 8)),
    (128, 1024, (128, 512, 16)),  # K 8192 bf16: 16 warps still load 2 chunks a thread
    (8, 1536, (8, 512, 16)),  # past 16 warps: 3 chunks a thread, two passes
    (64, 513, (64, 288, 9)),  # K 4104 bf16: 9 warps, one pass
    (128, 256, (64, 256, 4)),  # two experts of 4 warps a block
    (128, 8, (16, 256, 1)),  # K 64 bf16: 8 experts a block, a warp each
    (60, 16, (8, 256, 1)),  # the last block's 4 slots past E load row E - 1 and store nothing
    (8, 1, (1, 256, 1)),  # K 8 bf16: one block holds every expert
    # Past one wave of 16 x 128 warps a warp plays two of the rows' warps (4 chunks a thread):
    (512, 512, (128, 512, 4)),  # Qwen3-Next: E 512, K 4096 bf16, not 512 blocks of 8 warps
    (1024, 512, (256, 512, 4)),
    (301, 512, (76, 512, 4)),  # the last block's 12 slots past E
    (256, 1026, (128, 512, 8)),  # K 8208 bf16: 17 warps of 2 chunks cap at 16, folded to 8
])
def test_router_grid_keeps_every_load_of_a_thread_in_one_pass(num_experts, num_chunks, expected):
    blocks, threads, warps_per_expert = moe_router.router_grid(num_experts, num_chunks)
    assert (blocks, threads, warps_per_expert) == expected
    experts_per_block = threads // (32 * warps_per_expert)
    assert (blocks - 1) * experts_per_block < num_experts <= blocks * experts_per_block
    # A folded grid's blocks are 16 warps of rows with at most 8 each; its warps play two.
    order_warps = warps_per_expert * (2 if threads == 512 and warps_per_expert <= 8 else 1)
    assert threads <= 512 and (num_chunks <= 32 * order_warps * 2 or order_warps == 16)


@pytest.mark.parametrize("dtype,num_tokens,top_k,width,c_type,expected_stride", [
    ("bfloat16", 1, 8, 4096, "__nv_bfloat16", 4096),  # one row: its stride does not matter
    ("bfloat16", 4, 8, 4096, "__nv_bfloat16", 8192),  # [y | y_lo]'s y: a column slice of a [T, 2K] row
    ("float16", 16, 2, 2048, "__half", 4096),
    ("float32", 32, 1, 2048, "float", 4096),
])
def test_router_launches_one_kernel_with_the_gemv_grid(monkeypatch, dtype, num_tokens, top_k, width, c_type,
                                                       expected_stride):
    launches, arg_lists = [], []
    monkeypatch.setattr(moe_router, "get_kernel", lambda spec: _RecordedLaunch(spec, launches, arg_lists))
    operands = router_operands(num_tokens, top_k, 128, width, dtype)
    operands["router_input"] = fake((num_tokens, width), dtype, strides=(2 * width, 1))
    route_router(operands)
    blocks, threads, warps_per_expert = moe_router.router_grid(128, width * DType.parse(dtype).itemsize // 16)
    assert launches == [(f"moe_router_route_align_kernel<{c_type}>", blocks, threads)]
    assert launches[0][0] in {spec.name for spec in moe_router.SPECS}
    [args] = arg_lists
    alignment = operands["alignment"]
    assert args[:10] == [operands["weights"], operands["expert_ids"], *alignment.outputs(), operands["router_logits"],
                         operands["router_input"], operands["router"]]
    assert args[10:] == [num_tokens, 128, top_k, width, expected_stride, warps_per_expert, 1, 0]  # not shared
    assert [type(a) for a in args[10:]] == [np.int32] * 4 + [np.int64] + [np.int32] * 3


def test_router_takes_operands_its_loads_can_read():
    assert moe_router.unsupported_reason(fake((2, 4096), "bfloat16"), fake((128, 4096), "bfloat16")) is None
    assert "16-byte chunks" in moe_router.unsupported_reason(fake((2, 34)), fake((8, 34)))
    assert "16-byte aligned" in moe_router.unsupported_reason(fake((2, 64)), fake((8, 64), ptr=0x10004))


def _with(**changes) -> dict:
    """router_operands() with some operands replaced."""
    return {**router_operands(), **changes}


@pytest.mark.parametrize("operands,message", [
    (_with(router_input=fake((1, 4096, 1), "bfloat16")), r"router_input must be \[T, K\] and router \[E, K\]"),
    (_with(router_input=fake((1, 4096), "int32")), "router_input must be float32 or float16 or bfloat16, got int32"),
    (_with(router=fake((128, 4096), "float32")), "router must be bfloat16, got float32"),
    (_with(router=fake((128, 2048), "bfloat16")), r"router must be \[E, K=4096\]"),
    (_with(router_input=fake((1, 4096), "bfloat16", strides=(8192, 2))), "router_input needs unit column stride"),
    (_with(router=fake((128, 4096), "bfloat16", strides=(8192, 1))), "router must be contiguous"),
    (_with(router_logits=fake((1, 64))), r"router_logits must be \[T=1, E=128\]"),
    (_with(router_logits=fake((1, 128), "bfloat16")), "router_logits must be float32, got bfloat16"),
    ({**router_operands(num_tokens=2, top_k=2), "router_logits": fake((2, 128), strides=(256, 1))},
     "router_logits must be contiguous"),
    (_with(weights=fake((1, 8), "float16")), "weights must be float32, got float16"),
    (_with(expert_ids=fake((1, 4), "int32")), r"expert_ids must be \[T, top_k\]"),
    (_with(alignment=MoeAlignment.allocate(FakeAllocator(), 8, 64)), "the alignment is sized for 8 pairs of 64"),
    (_with(router=fake((1025, 4096), "bfloat16"), router_logits=fake((1, 1025))), "1 to 1024 experts, got E = 1025"),
    (router_operands(num_tokens=5, top_k=8), r"at most 32 \(token, expert\) pairs, got T=5 \* top_k=8 = 40"),
    (router_operands(num_tokens=33, top_k=1), r"got T=33 \* top_k=1 = 33"),
    (router_operands(width=4100), r"K \(4100\) and router_input's row stride \(4100\) must be multiples of 8"),
    (router_operands(width=4098, dtype="float32"), "must be multiples of 4 for float32"),
    ({**router_operands(num_tokens=2, top_k=2), "router_input": fake((2, 4096), "bfloat16", strides=(4100, 1))},
     r"row stride \(4100\)"),
    (_with(router_input=fake((1, 4096), "bfloat16", ptr=0x10008)), "16-byte aligned, got router_input at 0x10008"),
    (_with(router=fake((128, 4096), "bfloat16", ptr=0x400004)), "router at 0x400004"),
])
def test_router_rejects_bad_operands(monkeypatch, operands, message):
    monkeypatch.setattr(moe_router, "get_kernel", lambda spec: pytest.fail(f"{spec} was loaded"))
    with pytest.raises(ValueError, match=message):
        route_router(operands)
