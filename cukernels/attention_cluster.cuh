// Thread-block clusters in the decode attention: the blocks of a cluster (CLUSTER of them, fixed
// by the kernel's __cluster_dims__) merge their splits on chip (cluster.cuh's primitives).
//
// The helpers take the cluster size as a template argument; with 1 they fall
// back to the block alone, so one kernel body serves clustered and plain launches.
#pragma once

#include "attention_common.cuh"
#include "cluster.cuh"

namespace sparkd {
namespace attn {

// Barrier over every thread of the cluster: shared-memory writes before it are
// visible to reads after it from any block of the cluster (release / acquire).
// With CLUSTER 1 it is __syncthreads.
template <int CLUSTER>
__device__ __forceinline__ void cluster_sync() {
  if constexpr (CLUSTER > 1) {
    cluster_barrier();
  } else {
    __syncthreads();
  }
}

// The value at `local`, an address in this block's shared memory, as block
// `rank` of the cluster holds it at the same address (float or float2).
template <int CLUSTER, typename V>
__device__ __forceinline__ V load_from_rank(const V* local, int rank) {
  if constexpr (CLUSTER > 1) {
    return load_shared_rank(local, rank);
  } else {
    return *local;
  }
}

}  // namespace attn
}  // namespace sparkd
