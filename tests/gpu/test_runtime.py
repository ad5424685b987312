"""The CUDA runtime: allocator, copies, events, staging, errors.

Host-only tests (size classes, memory plan, tensor views, packing layout) run
everywhere; the rest are marked gpu."""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.base import AttentionMetadata
from sparkd.backend.cuda.memory import GiB, check_weights_fit, plan_kv_cache, round_size
from sparkd.backend.cuda.tensor import DeviceTensor
from sparkd.backend.cuda.transfer import ALIGNMENT, pack_layout
from sparkd.backend.dtypes import DType, decode, encode

# ---- host-only ----

@pytest.mark.parametrize("nbytes", [1, 511, 512, 513, 1000, 4096, 4097, 10**6, (64 << 20) - 1, 64 << 20, 10**9])
def test_size_classes_cover_the_request_with_bounded_waste(nbytes):
    size = round_size(nbytes)
    assert size >= nbytes
    assert size % 512 == 0
    if nbytes >= 64 << 20:
        assert size - nbytes < 2 << 20
    elif nbytes > 2048:
        assert size <= 1.25 * nbytes
    else:
        assert size - nbytes < 512 or nbytes <= 1024


def test_size_classes_are_shared_by_nearby_sizes():
    assert round_size(4097) == round_size(5000) == 5120


def test_kv_plan_takes_weights_and_reserve_off_the_budget():
    total, free = 100 * GiB, 80 * GiB  # 20 GiB used by weights and the context
    plan = plan_kv_cache(free, total, 0.9, block_bytes=GiB // 4, reserve_bytes=2 * GiB)
    assert plan.num_blocks == (90 - 20 - 2) * 4
    assert "272 blocks" in plan.describe()


def test_weights_that_cannot_fit_are_refused_before_loading_with_both_sizes():
    check_weights_fit(60 * GiB, free_bytes=90 * GiB, total_bytes=100 * GiB, gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match=r"need 85.00 GiB but only 80.00 GiB .*gpu_memory_utilization=0.9"):
        check_weights_fit(85 * GiB, free_bytes=90 * GiB, total_bytes=100 * GiB, gpu_memory_utilization=0.9)


def test_kv_plan_names_the_parameter_when_nothing_is_left():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_kv_cache(10 * GiB, 100 * GiB, 0.5, block_bytes=GiB, reserve_bytes=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_kv_cache(90 * GiB, 100 * GiB, 1.5, block_bytes=GiB, reserve_bytes=0)


def test_tensor_views_address_the_right_elements():
    qkv = DeviceTensor(0x1000, (5, 48), DType.bfloat16)
    k = qkv.column_slice(32, 8).split_last(2, 4)
    assert k.shape == (5, 2, 4) and k.strides == (48, 4, 1)
    assert k.ptr == 0x1000 + 32 * 2 and not k.is_contiguous and k.rows_contiguous
    row3 = qkv.narrow(3, 2)
    assert row3.ptr == 0x1000 + 3 * 48 * 2 and row3.shape == (2, 48)
    assert qkv.view((-1, 4, 12)).shape == (5, 4, 12)
    with pytest.raises(ValueError):
        k.view((5, 8))
    with pytest.raises(ValueError):
        qkv.view((7, -1))


def test_pack_layout_aligns_every_buffer():
    offsets, total = pack_layout([4, 300, 0, 256])
    assert offsets == [0, ALIGNMENT, 3 * ALIGNMENT, 3 * ALIGNMENT]
    assert total == 4 * ALIGNMENT


def test_bf16_encoding_round_trips_through_the_device_representation():
    x = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    bits = encode(x, DType.bfloat16)
    assert bits.dtype == np.uint16
    np.testing.assert_allclose(decode(bits, DType.bfloat16), x, rtol=2**-8)
    with pytest.raises(ValueError):
        encode(bits, DType.bfloat16)


# ---- on the device ----

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32"])
def test_round_trip_host_device_host(gpu, dtype):
    x = np.random.default_rng(1).standard_normal((37, 129)) * 100
    expected = x.astype(np.int32) if dtype == "int32" else x.astype(np.float32)
    back = gpu.download(gpu.upload(expected, dtype))
    if dtype == "float32" or dtype == "int32":
        np.testing.assert_array_equal(back, expected)
    else:
        np.testing.assert_allclose(back, expected, rtol=2**-7 if dtype == "bfloat16" else 2**-10)


@pytest.mark.gpu
def test_allocator_reuses_freed_blocks_and_keeps_live_ones_apart(gpu):
    a = gpu.empty((1000,), DType.float32)
    b = gpu.empty((1000,), DType.float32)
    assert a.ptr != b.ptr
    freed = a.ptr
    del a
    c = gpu.empty((900,), DType.float32)  # same size class as 1000 floats
    assert c.ptr == freed
    views = c.view((30, 30))
    del c
    d = gpu.empty((1000,), DType.float32)
    assert d.ptr != views.ptr  # a live view keeps its block out of the free list


@pytest.mark.gpu
def test_graph_pool_blocks_never_serve_the_default_pool(gpu):
    from sparkd.backend.cuda.memory import MemoryPool

    pool = MemoryPool("test graphs")
    with gpu.allocator.use_pool(pool):
        scratch = gpu.empty((4096,), DType.float32)
    ptr = scratch.ptr
    del scratch
    outside = gpu.empty((4096,), DType.float32)
    assert outside.ptr != ptr
    with gpu.allocator.use_pool(pool):
        again = gpu.empty((4096,), DType.float32)
    assert again.ptr == ptr
    del again
    assert gpu.allocator.release_cached(pool) == round_size(4096 * 4)


@pytest.mark.gpu
def test_device_to_device_copy_of_a_strided_view(gpu):
    from sparkd.backend.cuda.transfer import copy_device

    x = np.arange(6 * 10, dtype=np.float32).reshape(6, 10)
    src = gpu.upload(x).column_slice(3, 4)
    dst = gpu.empty((6, 4), DType.float32)
    copy_device(dst, src, gpu.stream)
    np.testing.assert_array_equal(gpu.download(dst), x[:, 3:7])


@pytest.mark.gpu
def test_staging_ring_uploads_several_arrays_in_one_copy(gpu):
    rng = np.random.default_rng(2)
    for step in range(10):  # more steps than slots: slots are reused behind their events
        arrays = [rng.integers(-9, 9, size=n, dtype=np.int32) for n in (1 + step, 7, 64)]
        arrays.append(rng.standard_normal((3, 5)).astype(np.float32))
        tensors = gpu.staging.upload(arrays)
        assert len({t.owner for t in tensors}) == 1  # one device buffer, one copy
        for tensor, array in zip(tensors, arrays):
            assert tensor.ptr % ALIGNMENT == 0
            np.testing.assert_array_equal(gpu.download(tensor), array)


@pytest.mark.gpu
def test_events_order_and_time_work(gpu):
    from sparkd.backend.cuda.driver import Event

    start, end = Event(timing=True), Event(timing=True)
    start.record(gpu.stream)
    big = gpu.upload(np.ones(1 << 22, dtype=np.float32))
    end.record(gpu.stream)
    end.synchronize()
    assert end.query()
    assert start.elapsed_ms(end) >= 0.0
    assert gpu.download(big).sum() == 1 << 22


@pytest.mark.gpu
def test_event_wait_resolves_in_the_event_loop(gpu):
    import asyncio

    from sparkd.backend.cuda.driver import Event

    async def wait_while_the_loop_runs():
        ticker = asyncio.create_task(asyncio.sleep(0.001, result="loop ran"))
        await event.wait()
        return await ticker

    gpu.upload(np.ones(1 << 22, dtype=np.float32))
    event = Event()
    event.record(gpu.stream)
    # Plain asyncio.run: the GPU host has no pytest-asyncio.
    assert asyncio.run(wait_while_the_loop_runs()) == "loop ran"
    assert event.query()


@pytest.mark.gpu
def test_cuda_errors_name_the_error(gpu):
    from cuda.bindings import driver

    from sparkd.backend.cuda.driver import (
        CudaError,
        DeviceLostError,
        call,
        error_from_status,
    )

    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE") as info:
        call(driver.cuMemAlloc, 0)
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE" and "cuMemAlloc" in str(info.value)
    assert isinstance(error_from_status(driver.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS), DeviceLostError)
    assert not isinstance(error_from_status(driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY), DeviceLostError)


AXPY = ("template <typename T> __global__ void axpy(T* y, const T* x, float a, long long n, int bias) {\n"
        "  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n"
        "  if (i < n) y[i] = a * x[i] + y[i] + bias; }\n")


@pytest.mark.gpu
def test_kernel_launch_packs_scalars_of_every_width(gpu, compile_test_kernel):
    kernel = compile_test_kernel(AXPY, "axpy<float>")
    x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    y = np.random.default_rng(4).standard_normal(1000).astype(np.float32)
    x_dev, y_dev = gpu.upload(x), gpu.upload(y)
    kernel.launch((1000 + 255) // 256, 256, [y_dev, x_dev, np.float32(2.5), np.int64(1000), np.int32(-3)],
                  stream=gpu.stream)
    # The float64 reference is exact to ~2^-53. The kernel rounds to fp32 at most three
    # times, a*x, +y and +bias (nvcc may fuse the first two into one fma); each rounding
    # errs by at most half an ulp of the value rounded, and an ulp is at most 2^-23 of it
    # (the whole ulp allowed here covers rounding the computed, not the exact, terms).
    product = 2.5 * x.astype(np.float64)
    partial = product + y
    expected = partial - 3
    bound = 2.0**-23 * (np.abs(product) + np.abs(partial) + np.abs(expected))
    assert np.all(np.abs(gpu.download(y_dev) - expected) <= bound)
    with pytest.raises(TypeError, match="argument 2"):
        kernel.launch(1, 256, [y_dev, x_dev, 2.5, np.int64(1000), np.int32(0)], stream=gpu.stream)


@pytest.mark.gpu
def test_prepare_attention_uploads_the_metadata(cuda_ops_factory):
    ops = cuda_ops_factory("float32")
    meta = AttentionMetadata(
        query_start_loc=np.array([0, 3, 4], np.int32), seq_lens=np.array([3, 9], np.int32),
        block_tables=np.array([[2, 0], [5, 7]], np.int32), slot_mapping=np.array([32, 33, 34, 120], np.int32),
        max_query_len=3, max_seq_len=9)
    attn = ops.prepare_attention(meta)
    assert attn.num_seqs == 2 and attn.num_tokens == 4 and not attn.is_decode_only
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        np.testing.assert_array_equal(ops.download(getattr(attn, name)), getattr(meta, name))
