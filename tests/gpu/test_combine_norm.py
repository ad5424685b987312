"""The MoE combine inside the next norm (norm.combine_add_rmsnorm, cukernels/norm.cu) against the
two launches it replaces, moe_combine then add_rmsnorm, bit for bit, and against numpy; and
CudaOps.add_rmsnorm of a MoE block's ExpertSum, fused where the kernel takes the row and combined
first where it does not."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.cpu.ops import NumpyOps
from sparkd.backend.cuda.kernels import moe_routing, norm
from sparkd.backend.cuda.moe_ops import ExpertSum

from .moe_cases import as_stored, reference_combine

pytestmark = pytest.mark.gpu
EPS = 1e-6


def random_sum(gpu, rng, rows: int, top_k: int, dim: int, dtype: str) -> ExpertSum:
    """Expert rows in dtype, in a random expert order, and weights that sum to one per token;
    gpu: the `gpu` harness or a CudaOps (both upload)."""
    expert_out = gpu.upload(rng.standard_normal((rows * top_k, dim)).astype(np.float32), dtype)
    weights = gpu.upload(rng.dirichlet(np.ones(top_k), size=rows).astype(np.float32))
    row_of_pair = gpu.upload(rng.permutation(rows * top_k).astype(np.int32))
    return ExpertSum(expert_out, weights, row_of_pair)


def two_launches(gpu, x: ExpertSum, residual, weight, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(out, residual') of moe_combine then add_rmsnorm, residual' in a fresh buffer."""
    combined = gpu.empty(x.shape, dtype)
    moe_routing.moe_combine(combined, x.expert_out, x.weights, x.row_of_pair, gpu.stream)
    out, residual_out = gpu.empty(x.shape, dtype), gpu.empty(x.shape, "float32")
    norm.add_rmsnorm(out, residual_out, residual, combined, weight, EPS, gpu.stream)
    return gpu.download(out), gpu.download(residual_out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("residual_dtype", ["like x", "float32"])
@pytest.mark.parametrize("rows,top_k,dim", [(1, 8, 2048), (1, 11, 2048), (3, 2, 2048), (64, 8, 256), (5, 3, 130),
                                            (300, 1, 64)])
def test_combine_add_rmsnorm_is_the_combine_then_the_norm(gpu, rel_error, tolerance, dtype, residual_dtype, rows,
                                                          top_k, dim):
    """Bit for bit the two launches (D 130 takes the scalar path), an fp32 residual updated in
    place, one in x's dtype (the first layer's) into a new fp32 buffer; and within the dtype's
    tolerance of numpy's norm of the numpy combine rounded to the dtype."""
    rng = np.random.default_rng(rows * 97 + top_k * 7 + dim)
    residual_dtype = dtype if residual_dtype == "like x" else residual_dtype
    x = random_sum(gpu, rng, rows, top_k, dim, dtype)
    residual = gpu.upload(2 * rng.standard_normal((rows, dim)).astype(np.float32), residual_dtype)
    weight = gpu.upload((1 + 0.1 * rng.standard_normal(dim)).astype(np.float32), dtype)
    expected_out, expected_residual = two_launches(gpu, x, residual, weight, dtype)
    residual_host = gpu.download(residual)

    out = gpu.empty(x.shape, dtype)
    residual_out = residual if residual_dtype == "float32" else gpu.empty(x.shape, "float32")
    assert norm.combine_unsupported_reason(out, residual_out, residual, x.expert_out, weight) is None
    norm.combine_add_rmsnorm(out, residual_out, residual, x.expert_out, x.weights, x.row_of_pair, weight, EPS,
                             gpu.stream)
    np.testing.assert_array_equal(gpu.download(out), expected_out)
    np.testing.assert_array_equal(gpu.download(residual_out), expected_residual)

    combined = as_stored(reference_combine(gpu.download(x.expert_out), gpu.download(x.weights),
                                           gpu.download(x.row_of_pair)), dtype)
    summed = combined + residual_host.astype(np.float32)
    np.testing.assert_array_equal(expected_residual, summed)
    assert rel_error(expected_out, NumpyOps().rmsnorm(summed, gpu.download(weight), EPS)) <= tolerance[dtype]


@pytest.mark.parametrize("dtype,dim,fused", [("bfloat16", 2048, True), ("bfloat16", 4096, True),
                                             ("bfloat16", 8192, False), ("float32", 2048, True),
                                             ("float32", 4096, False)])
def test_cuda_ops_norms_an_expert_sum_fused_where_the_kernel_takes_the_row(cuda_ops_factory, dtype, dim, fused):
    """Rows that would need more than combine_add_rmsnorm's 512 threads (bf16 8192 at 8 elements a
    thread, fp32 4096 at 4) are combined first by CudaOps.add_rmsnorm, with the same result."""
    ops = cuda_ops_factory(dtype)
    rng = np.random.default_rng(dim)
    x = random_sum(ops, rng, 2, 8, dim, dtype)
    residual = ops.upload(rng.standard_normal((2, dim)).astype(np.float32), "float32")
    weight = ops.upload((1 + 0.1 * rng.standard_normal(dim)).astype(np.float32), dtype)
    probe = ops.allocator.empty(x.shape, x.dtype)
    assert (norm.combine_unsupported_reason(probe, residual, residual, x.expert_out, weight) is None) == fused

    expected_residual = ops.download(residual) + ops.download(ops.combined(x))
    expected, _ = ops.add_rmsnorm(ops.combined(x), ops.upload(ops.download(residual), "float32"), weight, EPS)
    out, residual_out = ops.add_rmsnorm(x, residual, weight, EPS)
    np.testing.assert_array_equal(ops.download(out), ops.download(expected))
    np.testing.assert_array_equal(ops.download(residual_out), expected_residual)

