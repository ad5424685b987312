"""The CUDA backend: driver runtime, NVRTC compiler and cache, memory, cuBLASLt, graphs, CudaOps.

Import `sparkd.backend.cuda.ops.CudaOps` for the backend; the submodules import
cuda-bindings (and gemm imports nvmath-python) only when used.
"""
