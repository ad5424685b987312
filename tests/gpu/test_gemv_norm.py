"""The skinny GEMM with its RMSNorm prologue (gemv_norm.cu) against numpy in float64, its
preconditions, and CudaOps' choice of it.

The reference: h = x + residual in fp32 (exactly as the device adds them), y = rmsnorm(h) *
weight in float64, rounded to the model dtype as the kernel rounds it (through the device's
own upload), then y @ W^T in float64. Relative error is max |a - b| / max |b|: <= 1e-5 for
fp32, <= 1e-2 for bf16 / fp16 (`tolerance`). The fp32 residual' must equal x + residual bit
for bit. The precondition tests need no GPU: they run on tensors that are never launched.
"""

from __future__ import annotations

import numpy as np
import pytest
from device_fakes import fake_tensor

from sparkd.backend.cuda.kernels import gemv_norm

DTYPES = ["float32", "bfloat16", "float16"]
EPS = 1e-5
# (N, K): one 16-byte chunk of K; K not a multiple of the block's threads; a thread holding
# two chunks (Llama's 4096 in bf16, four in fp32); N not a multiple of a block's 4 rows.
SHAPES = [(1, 8), (33, 296), (1003, 2048), (257, 4104), (512, 4096)]
RESIDUALS = ["none", "like x", "float32"]


def _norm_case(gpu, n, k, dtype, residual_kind, seed, rows=None):
    """Device operands and their float64 reference: (x, residual, norm_weight, weight, y_ref [1, K], h [1, K] fp32)."""
    rng = np.random.default_rng(seed)
    x = gpu.upload(rng.standard_normal((1, k), dtype=np.float32), dtype)
    residual = None if residual_kind == "none" else gpu.upload(
        3 * rng.standard_normal((1, k), dtype=np.float32), dtype if residual_kind == "like x" else "float32")
    norm_weight = gpu.upload((1.0 + 0.2 * rng.standard_normal(k)).astype(np.float32), dtype)
    weight = gpu.upload((rng.standard_normal((rows or n, k)) / np.sqrt(k)).astype(np.float32), dtype)
    h = gpu.download(x).astype(np.float32) + (gpu.download(residual).astype(np.float32) if residual is not None else 0)
    h64 = h.astype(np.float64)
    y = h64 / np.sqrt(np.mean(h64 * h64) + EPS) * gpu.download(norm_weight).astype(np.float64)
    y_held = gpu.download(gpu.upload(y.astype(np.float32), dtype)).astype(np.float64)  # rounded as the kernel rounds
    return x, residual, norm_weight, weight, y_held, h


def _residual_out(gpu, residual, k):
    return None if residual is None else gpu.empty((1, k), "float32")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("residual_kind", RESIDUALS)
def test_gemv_norm_matches_numpy(gpu, rel_error, tolerance, dtype, n, k, residual_kind):
    if k > 4096 and dtype == "float32":
        pytest.skip("fp32 K is at most 4096 (four 16-byte chunks a thread)")
    x, residual, norm_weight, weight, y, h = _norm_case(gpu, n, k, dtype, residual_kind, seed=n + k)
    bias = gpu.upload(np.random.default_rng(1).standard_normal(n).astype(np.float32), dtype)
    out, residual_out = gpu.empty((1, n), dtype), _residual_out(gpu, residual, k)
    gemv_norm.gemv_norm(out, residual_out, x, residual, norm_weight, EPS, weight, bias, gpu.stream)
    expected = y @ gpu.download(weight).astype(np.float64).T + gpu.download(bias)
    assert rel_error(gpu.download(out), expected) <= tolerance[dtype]
    if residual is not None:
        np.testing.assert_array_equal(gpu.download(residual_out), h)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter,k", [(1, 8), (7, 296), (1003, 2048), (514, 4096)])
@pytest.mark.parametrize("residual_kind", RESIDUALS)
def test_gemv_norm_silu_and_mul_matches_numpy(gpu, rel_error, tolerance, dtype, inter, k, residual_kind):
    """silu(g) * u of the float64 product, an odd number of output columns (a group owns two) included."""
    from sparkd.backend.cpu.moe import silu_and_mul

    x, residual, norm_weight, weight, y, h = _norm_case(gpu, 2 * inter, k, dtype, residual_kind, seed=inter + k)
    out, residual_out = gpu.empty((1, inter), dtype), _residual_out(gpu, residual, k)
    gemv_norm.gemv_norm_silu_and_mul(out, residual_out, x, residual, norm_weight, EPS, weight, None, gpu.stream)
    assert rel_error(gpu.download(out), silu_and_mul(y @ gpu.download(weight).astype(np.float64).T)) \
        <= tolerance[dtype]
    if residual is not None:
        np.testing.assert_array_equal(gpu.download(residual_out), h)


@pytest.mark.gpu
@pytest.mark.parametrize("groups_per_block", [2, 3, 7])
def test_groups_per_block_change_no_bit(gpu, groups_per_block):
    """A block that runs several groups computes the same sums in the same order as one per group:
    the same bits, a last block with fewer groups included (1003 rows: 251 groups)."""
    x, residual, norm_weight, weight, _, _ = _norm_case(gpu, 1003, 4096, "bfloat16", "float32", seed=2)
    results = []
    for per_block in (1, groups_per_block):
        out = gpu.empty((1, 1003), "bfloat16")
        gemv_norm.gemv_norm(out, gpu.empty((1, 4096), "float32"), x, residual, norm_weight, EPS, weight, None,
                            gpu.stream, groups_per_block=per_block)
        gated = gpu.empty((1, 501), "bfloat16")
        gemv_norm.gemv_norm_silu_and_mul(gated, gpu.empty((1, 4096), "float32"), x, residual, norm_weight, EPS,
                                         _rows(weight, 1002), None, gpu.stream, groups_per_block=per_block)
        results.append((gpu.download(out), gpu.download(gated)))
    for first, second in zip(*results):
        np.testing.assert_array_equal(first, second)


def _rows(weight, rows):
    """The first `rows` rows of a contiguous weight, as a view."""
    from sparkd.backend.cuda.tensor import DeviceTensor

    return DeviceTensor(weight.ptr, (rows, weight.shape[1]), weight.dtype)


@pytest.mark.gpu
def test_gemv_norm_replays_inside_a_cuda_graph(gpu, rel_error, tolerance):
    from sparkd.backend.cuda.graphs import capture
    from sparkd.backend.cuda.transfer import copy_to_device
    from sparkd.backend.dtypes import encode

    x, residual, norm_weight, weight, _, _ = _norm_case(gpu, 384, 2048, "bfloat16", "float32", seed=3)
    out, residual_out = gpu.empty((1, 384), "bfloat16"), gpu.empty((1, 2048), "float32")

    def launch():
        gemv_norm.gemv_norm(out, residual_out, x, residual, norm_weight, EPS, weight, None, gpu.stream)

    launch()  # load the kernel outside the capture, as the warm-up does
    graph, _ = capture(gpu.stream, launch)
    try:
        new_x = np.random.default_rng(4).standard_normal((1, 2048)).astype(np.float32)
        copy_to_device(x, encode(new_x, x.dtype), gpu.stream)
        graph.replay(gpu.stream)
        h = gpu.download(x).astype(np.float32) + gpu.download(residual)
        np.testing.assert_array_equal(gpu.download(residual_out), h)
        h64 = h.astype(np.float64)
        y = h64 / np.sqrt(np.mean(h64 * h64) + EPS) * gpu.download(norm_weight)
        y = gpu.download(gpu.upload(y.astype(np.float32), "bfloat16")).astype(np.float64)
        assert rel_error(gpu.download(out), y @ gpu.download(weight).astype(np.float64).T) <= tolerance["bfloat16"]
    finally:
        graph.destroy()


# ---- CudaOps' choice ----

@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_cuda_ops_fuses_the_norm_only_at_one_row_on_gemv_shapes(cuda_ops_factory, rel_error, gated):
    """add_rmsnorm_linear[_silu_and_mul] at M = 1 on a shape the table gives to gemv runs the fused
    kernel, and matches the unfused ops (pre_norm, then the product) to bf16's bound; residual'
    is the same fp32 sum either way. M = 2 takes the two ops."""
    from sparkd.backend.cuda.gemm_table import GemmTable, Measurement, ShapeKey

    ops = cuda_ops_factory("bfloat16")
    rng = np.random.default_rng(5)
    n, k = 512, 2048
    weight = ops.upload((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), "bfloat16")
    norm_weight = ops.upload((1 + 0.1 * rng.standard_normal(k)).astype(np.float32), "bfloat16")
    op = ops.add_rmsnorm_linear_silu_and_mul if gated else ops.add_rmsnorm_linear
    table, fuse_norms = ops.gemm.table, ops.fuse_norms
    ops.gemm.table = GemmTable("test", "sm_00", entries={ShapeKey(n, k, "bfloat16", m): Measurement(0.5, 0.9)
                                                          for m in (1, 2)})
    try:
        for m in (1, 2):
            x = ops.upload(rng.standard_normal((m, k)).astype(np.float32), "bfloat16")
            residual = ops.upload(rng.standard_normal((m, k)).astype(np.float32), "float32")
            residual_host = ops.download(residual)
            results = []
            for fuse in (True, False):
                ops.fuse_norms = fuse
                fresh = ops.upload(residual_host, "float32")  # the unfused path updates it in place
                out, residual_out = op(x, fresh, norm_weight, EPS, weight)
                results.append((ops.download(out), ops.download(residual_out), residual_out.ptr != fresh.ptr))
            (fused, fused_residual, fresh_buffer), (plain, plain_residual, _) = results
            assert fresh_buffer == (m == 1), "only the fused path writes residual' to a new buffer"
            np.testing.assert_array_equal(fused_residual, plain_residual)
            assert rel_error(fused, plain) <= 1e-2
    finally:
        ops.fuse_norms = fuse_norms
        ops.gemm.table = table


# ---- preconditions (no launch, no GPU) ----

def test_launcher_rejects_what_the_fused_kernel_cannot_run():
    x, weight, norm_weight = fake_tensor((1, 64)), fake_tensor((32, 64), ptr=0x20000), fake_tensor((64,), ptr=0x30000)
    residual = fake_tensor((1, 64), "float32", ptr=0x40000)
    out = fake_tensor((1, 32), ptr=0x50000)
    with pytest.raises(ValueError, match="one row of x, got M = 2"):
        gemv_norm.gemv_norm(fake_tensor((2, 32), ptr=0x50000), None, fake_tensor((2, 64)), None, norm_weight, EPS,
                            weight, None, None)
    with pytest.raises(ValueError, match="norm weight must be"):
        gemv_norm.gemv_norm(out, None, x, None, fake_tensor((32,), ptr=0x30000), EPS, weight, None, None)
    with pytest.raises(ValueError, match="residual_out must not overlap"):
        gemv_norm.gemv_norm(out, residual, x, residual, norm_weight, EPS, weight, None, None)
    with pytest.raises(ValueError, match="no residual_out"):
        gemv_norm.gemv_norm(out, residual, x, None, norm_weight, EPS, weight, None, None)
    long_x = fake_tensor((1, 16384), "float32")
    assert "longer than" in gemv_norm.unsupported_reason(long_x, None, fake_tensor((16384,), "float32", ptr=0x30000),
                                                         fake_tensor((8, 16384), "float32", ptr=0x20000))
    with pytest.raises(ValueError, match=r"multiple of 8"):
        gemv_norm.gemv_norm(out, None, fake_tensor((1, 12)), None, fake_tensor((12,), ptr=0x30000), EPS,
                            fake_tensor((32, 12), ptr=0x20000), None, None)


@pytest.mark.parametrize("k,dtype,threads,chunks", [(8, "bfloat16", 32, 1), (2048, "bfloat16", 256, 1),
                                                     (4096, "bfloat16", 256, 2), (4104, "bfloat16", 256, 4),
                                                     (8192, "bfloat16", 256, 4), (4096, "float32", 256, 4)])
def test_launch_shape_is_gemvs_one_row_launch(k, dtype, threads, chunks):
    from sparkd.backend.dtypes import DType

    assert gemv_norm._launch_shape(k, DType[dtype]) == (threads, chunks)
