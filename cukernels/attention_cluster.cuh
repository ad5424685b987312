// Thread-block clusters (sm_90 and later): the blocks of a cluster run at the
// same time and read each other's shared memory, so they can merge partial
// results on chip instead of through global memory and a second kernel.
//
// The helpers take the cluster size as a template argument; with 1 they fall
// back to the block alone, so one kernel body serves clustered and plain launches.
#pragma once

#include "attention_common.cuh"

namespace sparkd {
namespace attn {

// Barrier over every thread of the cluster: shared-memory writes before it are
// visible to reads after it from any block of the cluster (release / acquire).
// With CLUSTER 1 it is __syncthreads.
template <int CLUSTER>
__device__ __forceinline__ void cluster_sync() {
  if constexpr (CLUSTER > 1) {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  } else {
    __syncthreads();
  }
}

// The value at `local`, an address in this block's shared memory, as block
// `rank` of the cluster holds it at the same address. Volatile keeps the loads
// after the cluster_sync that published the values; they still overlap each other.
template <int CLUSTER>
__device__ __forceinline__ float load_from_rank(const float* local, int rank) {
  if constexpr (CLUSTER > 1) {
    unsigned remote;
    float value;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(value) : "r"(remote));
    return value;
  } else {
    return *local;
  }
}

template <int CLUSTER>
__device__ __forceinline__ float2 load_from_rank(const float2* local, int rank) {
  if constexpr (CLUSTER > 1) {
    unsigned remote;
    float2 value;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(value.x), "=f"(value.y) : "r"(remote));
    return value;
  } else {
    return *local;
  }
}

}  // namespace attn
}  // namespace sparkd
