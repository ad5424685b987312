"""The opening of the wgmma probe kernels' sources (test_wgmma_diagnostics.py,
test_attention_prefill_wgmma.py): the header under test, its namespaces, and aligned_shared(),
the dynamic shared memory from its first 128-byte-swizzle period on."""

from __future__ import annotations

_AFTER_INCLUDE = r"""
using namespace sparkd;
using namespace sparkd::wgmma;

__device__ unsigned char* aligned_shared() {
  extern __shared__ __align__(1024) unsigned char smem[];
  return smem + (kSwizzleBytes - attn::smem_addr(smem) % kSwizzleBytes) % kSwizzleBytes;
}
"""


def probe_source(header: str, kernels: str) -> str:
    """`#include "header"`, the shared opening, then the probe kernels' own source."""
    return f'\n#include "{header}"\n' + _AFTER_INCLUDE + kernels


def probe_compiler(compile_test_kernel, directory, header: str, source: str):
    """name -> that kernel of `source`, built (for sm_90a) by the `compile_test_kernel` fixture
    against copies of `header` and the headers it includes, written to its `directory` (tmp_path)."""
    from sparkd.backend.cuda.compiler import source_files

    for rel, text in source_files(header).items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_bytes(text)
    return lambda name: compile_test_kernel(source, name)
