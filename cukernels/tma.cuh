// Hopper's tensor memory accelerator (TMA, PTX "cp.async.bulk.tensor"): one thread asks for a whole
// box of a tensor, described by a tensor map the host encodes (cuTensorMapEncodeTiled, passed as a
// __grid_constant__ kernel parameter), and the copy engine writes it to shared memory in the
// layout the map names (the 128-byte swizzle of wgmma.cuh's tiles), zero-filling what lies past
// the tensor's extents, and completes it on an mbarrier by counting its bytes. With .multicast
// the same box lands in several blocks of a cluster, read from L2 once. Also the cluster-scope
// mbarrier operations a pipeline shared by a cluster's blocks needs.
//
// These sit under SPARKD_HAS_WGMMA with wgmma.cuh's: the kernels that use them are sm_90a ones.
#pragma once

#include "wgmma.cuh"

namespace sparkd {
namespace tma {

// CUtensorMap: 128 opaque bytes, 64-byte aligned. Kernels take it by value as a
// `const __grid_constant__ TensorMap`, so that its address is a parameter-space one TMA reads.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

#if defined(SPARKD_HAS_WGMMA)

// One arrival on `barrier` that also expects `bytes` more transaction bytes in the current phase:
// the phase completes once every arrival is in and that many bytes have landed.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned barrier, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes) : "memory");
}

// One arrival on the barrier at `barrier` (a shared address of this block) as block `rank` of the
// cluster holds it. Release at the default (block) scope, as CUTLASS's cluster pipelines arrive:
// what it orders for the other block is this warp's completed wgmma reads of a stage, and a
// cluster-scope release costs a fence of the whole GPU (MEMBAR.ALL.GPU in the SASS) an arrival.
__device__ __forceinline__ void mbarrier_arrive_in_block(unsigned barrier, int rank) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(barrier),
      "r"(rank)
      : "memory");
}

// The box of `map` at element coordinates (c0, c1, c2), innermost first, into this block's shared
// memory at `dst` (on the swizzle's 1024-byte period), completing its bytes on `barrier`.
__device__ __forceinline__ void load_box_3d(unsigned dst, const TensorMap& map, unsigned barrier, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(barrier)
      : "memory");
}

// load_box_3d into every block of the cluster whose bit is set in `blocks`, at the same shared
// offsets `dst` and `barrier` in each (each block's barrier counts the bytes landing in it).
__device__ __forceinline__ void load_box_3d_multicast(unsigned dst, const TensorMap& map, unsigned barrier, int c0,
                                                      int c1, int c2, unsigned short blocks) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
      "%3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(barrier), "h"(blocks)
      : "memory");
}

// Brings the map into the constant cache ahead of its first use.
__device__ __forceinline__ void prefetch_map(const TensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(&map)) : "memory");
}

#endif  // SPARKD_HAS_WGMMA

}  // namespace tma
}  // namespace sparkd
