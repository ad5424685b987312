"""GEMM: y = x @ W^T (+ bias), through cuBLASLt (nvmath-python's low-level bindings)
or, at decode-sized M where the measured table says it wins, the skinny-GEMM
kernel (kernels/gemv.py; the table and how it is measured: gemm_table.py).

Weights stay in the Hugging Face layout W [N, K] row-major. cuBLASLt is
column-major, where row-major y [M, N] is y^T [N, M]; so it computes
y^T = W x^T with A = W (a [K, N] column-major matrix, transposed) and
B = x (a [K, M] column-major matrix, as is).

Accumulation is fp32 for every input type, and fp32 inputs never use TF32:
fp32 results must match numpy to 1e-5. A plan (descriptors and the algorithm) is
cached per shape, types, leading dimension and pointer alignment: the algorithm the
table measured fastest for the shape and M tile where cuBLASLt accepts it for these
operands (cublasLtMatmulAlgoCheck), else the heuristic's first. Building one needs
no device work, so a new shape may appear even while a graph is being captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from nvmath import CudaDataType
from nvmath.bindings import cublas
from nvmath.bindings import cublasLt as lt

from ..dtypes import DType
from .driver import Stream, current_device, ensure_context
from .gemm_table import GEMV, GemmTable, load_table
from .kernels import gemv
from .memory import DeviceAllocator
from .tensor import DeviceTensor

WORKSPACE_BYTES = 32 << 20  # what cuBLAS itself uses on Hopper

_DATA_TYPES = {
    DType.float32: CudaDataType.CUDA_R_32F,
    DType.float16: CudaDataType.CUDA_R_16F,
    DType.bfloat16: CudaDataType.CUDA_R_16BF,
}


class GemmError(RuntimeError):
    """cuBLASLt rejected or failed a matmul; the message names the shape."""


def pointer_alignment(ptr: int) -> int:
    """The largest power of two up to 256 dividing `ptr` (cuBLASLt's alignment preference)."""
    return min(256, ptr & -ptr) if ptr else 256


@dataclass(frozen=True)
class GemmKey:
    m: int
    n: int
    k: int
    in_dtype: DType
    out_dtype: DType
    has_bias: bool
    ld_x: int
    ld_out: int
    alignments: tuple[int, ...]  # x, weight, out, bias


def gemm_key(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor | None) -> GemmKey:
    """Validate the operands and name their plan. x [M, K] (rows may be spaced), weight [N, K], out [M, N]."""
    m, n, k = gemv.check_linear_operands(out, x, weight, bias)
    ptrs = (x.ptr, weight.ptr, out.ptr, bias.ptr if bias is not None else 0)
    return GemmKey(m, n, k, x.dtype, out.dtype, bias is not None, max(x.row_stride, k), max(out.row_stride, n),
                   tuple(pointer_alignment(p) for p in ptrs))


def _set_desc(desc: int, attr: lt.MatmulDescAttribute, value) -> None:
    buf = np.array([value], dtype=lt.get_matmul_desc_attribute_dtype(attr))
    lt.matmul_desc_set_attribute(desc, attr, buf.ctypes.data, buf.itemsize)


def _set_pref(preference: int, attr: lt.MatmulPreferenceAttribute, value) -> None:
    buf = np.array([value], dtype=lt.get_matmul_preference_attribute_dtype(attr))
    lt.matmul_preference_set_attribute(preference, attr, buf.ctypes.data, buf.itemsize)


class _Plan:
    """Descriptors and the chosen algorithm for one GemmKey."""

    def __init__(self, handle: int, key: GemmKey, algo: bytes | None = None):
        in_type, out_type = _DATA_TYPES[key.in_dtype], _DATA_TYPES[key.out_dtype]
        self.desc = lt.matmul_desc_create(cublas.ComputeType.COMPUTE_32F, CudaDataType.CUDA_R_32F)
        _set_desc(self.desc, lt.MatmulDescAttribute.TRANSA, cublas.Operation.T)
        _set_desc(self.desc, lt.MatmulDescAttribute.TRANSB, cublas.Operation.N)
        if key.has_bias:
            _set_desc(self.desc, lt.MatmulDescAttribute.EPILOGUE, lt.Epilogue.BIAS)
        self.a_layout = lt.matrix_layout_create(in_type, key.k, key.n, key.k)
        self.b_layout = lt.matrix_layout_create(in_type, key.k, key.m, key.ld_x)
        self.d_layout = lt.matrix_layout_create(out_type, key.n, key.m, key.ld_out)
        self.algo = self._checked(handle, algo) if algo is not None else None
        if self.algo is None:
            self.algo = self.heuristic(handle, key, 1)[0]
        self.algo_ptr = self.algo.ctypes.data  # self.algo keeps the struct's memory alive

    def _checked(self, handle: int, algo: bytes) -> np.ndarray | None:
        """A stored algorithm as a struct, if cuBLASLt runs these operands with it within the workspace."""
        if len(algo) != lt.matmul_algo_dtype.itemsize:
            return None
        struct = np.frombuffer(algo, dtype=lt.matmul_algo_dtype).copy()
        result = lt.MatmulHeuristicResult()
        try:
            lt.matmul_algo_check(handle, self.desc, self.a_layout, self.b_layout, self.d_layout, self.d_layout,
                                 struct.ctypes.data, result.ptr)
        except lt.cuBLASLtError:
            return None
        return struct if int(result.workspace_size) <= WORKSPACE_BYTES else None

    def heuristic(self, handle: int, key: GemmKey, count: int) -> list[np.ndarray]:
        """The heuristic's first `count` algorithms (fewer where it has fewer), its best first."""
        x_align, w_align, out_align, _ = key.alignments
        preference = lt.matmul_preference_create()
        try:
            attr = lt.MatmulPreferenceAttribute
            _set_pref(preference, attr.MAX_WORKSPACE_BYTES, WORKSPACE_BYTES)
            # A is the weight, B is x; C and D are both the output.
            _set_pref(preference, attr.MIN_ALIGNMENT_A_BYTES, w_align)
            _set_pref(preference, attr.MIN_ALIGNMENT_B_BYTES, x_align)
            _set_pref(preference, attr.MIN_ALIGNMENT_C_BYTES, out_align)
            _set_pref(preference, attr.MIN_ALIGNMENT_D_BYTES, out_align)
            results = lt.MatmulHeuristicResult(count)
            found = np.zeros(1, dtype=np.int32)
            lt.matmul_algo_get_heuristic(handle, self.desc, self.a_layout, self.b_layout, self.d_layout,
                                         self.d_layout, preference, count, results.ptr, found.ctypes.data)
        finally:
            lt.matmul_preference_destroy(preference)
        if found[0] == 0:
            raise GemmError(f"cuBLASLt has no algorithm for {key}")
        return [results[i]["algo"].copy() for i in range(int(found[0]))]

    def destroy(self) -> None:
        for layout in (self.a_layout, self.b_layout, self.d_layout):
            lt.matrix_layout_destroy(layout)
        lt.matmul_desc_destroy(self.desc)


class Gemm:
    """Matmuls on one stream: cuBLASLt with one workspace and cached plans, or the gemv
    kernel where `table` (default: this device's measured one) says it is faster; cuBLASLt
    with the algorithm the table measured fastest where it has one.

    Capturable in CUDA graphs: the workspace and the host-side alpha/beta never move."""

    def __init__(self, allocator: DeviceAllocator, stream: Stream, table: GemmTable | None = None):
        ensure_context()
        self.stream = stream
        self.handle = lt.create()
        self.workspace = allocator.empty((WORKSPACE_BYTES,), DType.uint8)
        self._alpha = np.ones(1, dtype=np.float32)
        self._beta = np.zeros(1, dtype=np.float32)
        self._plans: dict[tuple[GemmKey, bytes | None], _Plan] = {}
        if table is None:
            device = current_device()
            table = load_table(device.name, device.arch)
        self.table = table

    def __call__(self, out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor,
                 bias: DeviceTensor | None = None) -> None:
        """out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N])."""
        gemv.check_linear_operands(out, x, weight, bias)
        if self.picks_gemv(x, weight):
            gemv.gemv(out, x, weight, bias, self.stream)
        else:
            self.cublaslt(out, x, weight, bias)

    def picks_gemv(self, x: DeviceTensor, weight: DeviceTensor) -> bool:
        """Whether x [M, K] @ weight [N, K]^T (valid operands) runs on the gemv kernel:
        the table says it wins at this shape and M, and it can run these operands."""
        (m, k), n = x.shape, weight.shape[0]
        return self.table.pick(n, k, x.dtype, m) == GEMV and gemv.unsupported_reason(x, weight) is None

    def cublaslt(self, out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor,
                 bias: DeviceTensor | None = None, algo: bytes | None = None) -> None:
        """out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]) through cuBLASLt, whatever the table
        says of gemv: with `algo` (one of `candidates`) where given and accepted, else the table's
        measured algorithm for the shape, else the heuristic's first."""
        key = gemm_key(out, x, weight, bias)
        if key.m == 0:
            return
        plan = self._plan(key, algo)
        if bias is not None:
            # The pointer is read when the matmul is enqueued (and baked into a captured graph).
            _set_desc(plan.desc, lt.MatmulDescAttribute.BIAS_POINTER, bias.ptr)
        try:
            lt.matmul(self.handle, plan.desc, self._alpha.ctypes.data, weight.ptr, plan.a_layout, x.ptr, plan.b_layout,
                      self._beta.ctypes.data, out.ptr, plan.d_layout, out.ptr, plan.d_layout, plan.algo_ptr,
                      self.workspace.ptr, WORKSPACE_BYTES, int(self.stream.handle))
        except lt.cuBLASLtError as err:
            raise GemmError(f"cuBLASLt matmul failed for {key}: {err}") from err

    def _plan(self, key: GemmKey, algo: bytes | None) -> _Plan:
        plan = self._plans.get((key, algo))
        if plan is None:
            plan = self._plans[(key, algo)] = _Plan(self.handle, key, algo or self._measured_algo(key))
        return plan

    def algorithm(self, out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor,
                  bias: DeviceTensor | None = None) -> bytes:
        """The cuBLASLt algorithm `cublaslt` runs this product with (its plan is made if new)."""
        return self._plan(gemm_key(out, x, weight, bias), None).algo.tobytes()

    def candidates(self, out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, count: int = 16) -> list[bytes]:
        """cuBLASLt's heuristic's first `count` algorithms for this product (what bench_gemm.py times)."""
        key = gemm_key(out, x, weight, None)
        plan = _Plan(self.handle, key)
        try:
            return [algo.tobytes() for algo in plan.heuristic(self.handle, key, count)]
        finally:
            plan.destroy()

    def _measured_algo(self, key: GemmKey) -> bytes | None:
        if self.table.cublaslt_version != lt.get_version():
            return None  # measured with another cuBLASLt: its algorithms may mean something else here
        return self.table.cublaslt_algo(key.n, key.k, key.in_dtype, key.m)

    @property
    def num_plans(self) -> int:
        return len(self._plans)

    def close(self) -> None:
        for plan in self._plans.values():
            plan.destroy()
        self._plans.clear()
        lt.destroy(self.handle)
