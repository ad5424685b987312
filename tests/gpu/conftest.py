"""Shared fixtures of the GPU tests: they skip cleanly where no CUDA device answers.

Mark a test `@pytest.mark.gpu` and take the `gpu` fixture:
  gpu.upload(array, dtype) -> DeviceTensor     gpu.download(tensor) -> np.ndarray (bf16 as float32)
  gpu.empty(shape, dtype)                      gpu.stream (pass it to launchers)
Compare with `rel_error(actual, expected)` = max |a - b| / max |b| against
`TOLERANCE[dtype]` (1e-5 fp32, 1e-2 bf16/fp16).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}


def _device_present() -> bool:
    try:
        from sparkd.backend.cuda.driver import cuda_driver_available
    except ImportError:  # cuda-bindings not installed
        return False
    return cuda_driver_available()


@pytest.fixture(autouse=True)
def _skip_without_gpu(request):
    if request.node.get_closest_marker("gpu") and not _device_present():
        pytest.skip("needs a CUDA device")


@dataclass
class GpuHarness:
    """Allocation and copies on one stream, without the kernels CudaOps needs."""

    stream: object
    allocator: object
    staging: object

    def empty(self, shape, dtype):
        return self.allocator.empty(shape, dtype)

    def upload(self, array: np.ndarray, dtype=None):
        from sparkd.backend.cuda.tensor import as_dtype
        from sparkd.backend.cuda.transfer import copy_to_device
        from sparkd.backend.dtypes import encode

        target = as_dtype(dtype if dtype is not None else array.dtype)
        host = encode(np.asarray(array), target)
        out = self.allocator.empty(host.shape, target)
        copy_to_device(out, host, self.stream)
        self.stream.synchronize()  # `host` is pageable and local: let the copy land before it goes
        return out

    def download(self, tensor) -> np.ndarray:
        """bf16 comes back as float32; a row-strided view (a column slice) is gathered first."""
        from sparkd.backend.cuda.transfer import copy_device, copy_to_host
        from sparkd.backend.dtypes import decode

        if not tensor.is_contiguous:
            packed = self.allocator.empty(tensor.shape, tensor.dtype)
            copy_device(packed, tensor, self.stream)
            tensor = packed
        raw = np.empty(tensor.shape, dtype=tensor.dtype.host)
        copy_to_host(raw, tensor, self.stream)
        return decode(raw, tensor.dtype)


@pytest.fixture(scope="session")
def gpu() -> GpuHarness:
    if not _device_present():
        pytest.skip("needs a CUDA device")
    from sparkd.backend.cuda.driver import Stream, init_device
    from sparkd.backend.cuda.memory import DeviceAllocator
    from sparkd.backend.cuda.transfer import StagingRing

    init_device()
    stream = Stream()
    allocator = DeviceAllocator()
    return GpuHarness(stream, allocator, StagingRing(allocator, stream))


@pytest.fixture(scope="session")
def cuda_ops_factory():
    """dtype name -> a CudaOps of that dtype, one per dtype for the session."""
    if not _device_present():
        pytest.skip("needs a CUDA device")
    from sparkd.backend.cuda.ops import CudaOps

    made = {}

    def make(dtype: str = "float32"):
        if dtype not in made:
            made[dtype] = CudaOps(dtype=dtype)
        return made[dtype]

    return make


def rel_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = np.max(np.abs(expected)) if expected.size else 0.0
    return float(np.max(np.abs(actual - expected)) / scale) if scale else float(np.max(np.abs(actual), initial=0.0))


@pytest.fixture
def tolerance():
    return TOLERANCE


@pytest.fixture(name="rel_error")
def rel_error_fixture():
    return rel_error


@pytest.fixture
def compile_test_kernel(gpu, tmp_path, monkeypatch):
    """(CUDA source text, name expression) -> a loaded Kernel, compiled through the real path."""
    from cuda.bindings import driver

    from sparkd.backend.cuda.compiler import compile_specs
    from sparkd.backend.cuda.driver import call, device_arch
    from sparkd.backend.cuda.launch import Kernel

    monkeypatch.setenv("SPARKD_CACHE_DIR", str(tmp_path / "cache"))

    def build(source: str, name: str) -> Kernel:
        (tmp_path / "test_kernel.cu").write_text(source)
        module = compile_specs("test_kernel.cu", [name], device_arch(), kernel_dir=tmp_path)
        image = np.frombuffer(module.cubin, dtype=np.uint8)
        handle = call(driver.cuModuleLoadData, image.ctypes.data)
        return Kernel(name, call(driver.cuModuleGetFunction, handle, module.lowered_names[name].encode()))

    return build


@pytest.fixture
def gemm_with_table(gpu):
    """(entries {ShapeKey: Measurement}, cublaslt_version=None) -> a Gemm on gpu's stream that reads
    a table of those entries, measured by that cuBLASLt version (None: the one loaded here)."""
    pytest.importorskip("nvmath")
    from nvmath.bindings import cublasLt

    from sparkd.backend.cuda.gemm import Gemm
    from sparkd.backend.cuda.gemm_table import GemmTable

    made = []

    def make(entries, cublaslt_version: int | None = None):
        version = cublasLt.get_version() if cublaslt_version is None else cublaslt_version
        table = GemmTable("test", "sm_00", entries=entries, cublaslt_version=version)
        made.append(Gemm(gpu.allocator, gpu.stream, table=table))
        return made[-1]

    yield make
    gpu.stream.synchronize()
    for gemm in made:
        gemm.close()
