"""Host side of norm.combine_add_rmsnorm (sparkd/backend/cuda/kernels/norm.py), no GPU: which rows
its kernel takes (combine_unsupported_reason: at most 512 threads a row, at add_rmsnorm's width)
and the operands it refuses before it launches. Tensors here point nowhere; a check that let one
through would reach the driver and fail there instead of raising ValueError."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from device_fakes import FakeAllocator

from sparkd.backend.cuda.kernels import norm
from sparkd.backend.dtypes import DType

T, K = 2, 8  # tokens, pairs a token


def operands(dim: int, dtype: str = "bfloat16", allocator: FakeAllocator | None = None, **changed):
    """(out, residual_out, residual, expert_out, weights, row_of_pair, weight) of a T-token step,
    each the default unless given by name."""
    make = (allocator or FakeAllocator()).empty
    model = DType.parse(dtype)
    defaults = {"out": ((T, dim), model), "residual": ((T, dim), DType.float32),
                "expert_out": ((T * K, dim), model), "weights": ((T, K), DType.float32),
                "row_of_pair": ((T * K,), DType.int32), "weight": ((dim,), model)}
    made = {name: changed.get(name) or make(*spec) for name, spec in defaults.items()}
    return (made["out"], made["residual"], made["residual"], made["expert_out"], made["weights"],
            made["row_of_pair"], made["weight"])


@pytest.mark.parametrize("dtype,dim,takes", [
    ("bfloat16", 2048, True), ("bfloat16", 4096, True), ("bfloat16", 4104, False), ("bfloat16", 8192, False),
    ("float32", 2048, True), ("float32", 4096, False), ("float16", 130, True), ("float16", 1030, False),
])
def test_the_kernel_takes_rows_of_up_to_512_threads(dtype, dim, takes):
    """16-byte accesses where every operand allows (bf16 4104: 513 threads, a warp too many), else one
    element a thread (fp16 130 and 1030: not multiples of 8)."""
    out, residual_out, residual, expert_out, _, _, weight = operands(dim, dtype)
    reason = norm.combine_unsupported_reason(out, residual_out, residual, expert_out, weight)
    assert (reason is None) == takes
    if not takes:
        assert "at most 512 threads" in reason and f"D = {dim}" in reason


def test_a_misaligned_expert_row_takes_the_scalar_width():
    """expert_out 8 bytes off a 16-byte boundary: one element a thread, so 2048 needs 2048 threads."""
    out, residual_out, residual, expert_out, _, _, weight = operands(2048)
    shifted = type(expert_out)(expert_out.ptr + 8, expert_out.shape, expert_out.dtype)
    assert "1 elements" in norm.combine_unsupported_reason(out, residual_out, residual, shifted, weight)


@pytest.mark.parametrize("name,shape,dtype,message", [
    ("weights", (T + 1, K), "float32", r"weights must be \[R, k\] for residual"),
    ("expert_out", (T * K + 1, 64), "bfloat16", r"expert_out must be \[R\*k, D\]"),
    ("expert_out", (T * K, 64), "float16", r"expert_out must be \[R\*k, D\]"),
    ("row_of_pair", (T * K + 1,), "int32", r"row_of_pair must be \[R\*k\]"),
    ("row_of_pair", (T * K,), "float32", "row_of_pair must be int32"),
    ("weights", (T, K), "bfloat16", "weights must be float32"),
    ("weight", (63,), "bfloat16", r"weight must be \[64\]"),
    ("residual", (T, 64), "float16", "residual must be"),
])
def test_combine_add_rmsnorm_rejects_bad_operands(name, shape, dtype, message):
    allocator = FakeAllocator()
    bad = allocator.empty(shape, DType.parse(dtype))
    out, residual_out, residual, expert_out, weights, row_of_pair, weight = operands(64, allocator=allocator,
                                                                                     **{name: bad})
    with pytest.raises(ValueError, match=message):
        norm.combine_add_rmsnorm(out, residual_out, residual, expert_out, weights, row_of_pair, weight, 1e-6, None)
