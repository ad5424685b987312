// Thread-block clusters (sm_90 and later), whatever their size: the blocks of a cluster run at the
// same time and read each other's shared memory (distributed shared memory), so they can merge
// partial results on chip instead of through global memory and a second kernel. PTX rather than
// cooperative_groups: its cluster API needs libcu++ headers that the CUDA runtime wheel NVRTC
// compiles against does not ship.
//
// A cluster of 1 is valid too, and the size is read at run time, so these serve a kernel whose
// cluster size comes from the launch (a launch attribute) as well as one fixed by __cluster_dims__.
#pragma once

#include "common.cuh"

namespace sparkd {

// Every thread of every block of the cluster: shared-memory writes before it are visible to
// reads after it from any block of the cluster (release / acquire); a block's own threads meet
// too, as at __syncthreads. Each warp must reach it converged.
__device__ __forceinline__ void cluster_barrier() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The address in the cluster's shared window of `local`, an address in this block's shared
// memory, as block `rank` of the cluster holds it.
__device__ __forceinline__ unsigned shared_rank_address(const void* local, int rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(remote) : "r"(static_cast<unsigned>(__cvta_generic_to_shared(local))), "r"(rank));
  return remote;
}

// The value at `local` as block `rank` holds it. Volatile keeps the loads after the
// cluster_barrier that published the values; they still overlap each other.
__device__ __forceinline__ float load_shared_rank(const float* local, int rank) {
  float value;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(value) : "r"(shared_rank_address(local, rank)));
  return value;
}

__device__ __forceinline__ float2 load_shared_rank(const float2* local, int rank) {
  float2 value;
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n"
               : "=f"(value.x), "=f"(value.y) : "r"(shared_rank_address(local, rank)));
  return value;
}

// Blocks in this block's cluster.
__device__ __forceinline__ int cluster_blocks() {
  unsigned count;
  asm("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(count));
  return static_cast<int>(count);
}

// This block's rank in its cluster (0 in a launch without clusters: each block is its own).
__device__ __forceinline__ int cluster_rank() {
  unsigned rank;
  asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return static_cast<int>(rank);
}

// This block's cluster, and the clusters of the grid, along x.
__device__ __forceinline__ int cluster_index() {
  unsigned index;
  asm("mov.u32 %0, %%clusterid.x;\n" : "=r"(index));
  return static_cast<int>(index);
}

__device__ __forceinline__ int cluster_count() {
  unsigned count;
  asm("mov.u32 %0, %%nclusterid.x;\n" : "=r"(count));
  return static_cast<int>(count);
}

// The sum of v over every thread of the cluster, on every thread (the same bits on each: one
// order of the same partial sums). Every thread of the cluster calls it; blockDim.x is a multiple
// of 32 and the cluster's warps are 32 at most. partials: blockDim.x / 32 floats of shared memory
// that must not be written again before the next cluster_barrier after this call, since other
// blocks may still be reading them: a kernel that calls it in a loop alternates two buffers, and
// one that calls it last meets a cluster_barrier before it exits.
__device__ __forceinline__ float cluster_sum(float v, float* partials) {
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  v = warp_reduce(v, SumOp());
  if (lane == 0) partials[threadIdx.x / 32] = v;
  cluster_barrier();
  // Lane r * warps + w reads warp w's partial of block r.
  const float part = lane < cluster_blocks() * warps ? load_shared_rank(partials + lane % warps, lane / warps) : 0.f;
  return warp_reduce(part, SumOp());
}

}  // namespace sparkd
