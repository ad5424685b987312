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
