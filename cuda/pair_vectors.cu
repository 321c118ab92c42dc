// The pair geometry and its gradient: one thread per pair. The backward scatters with float32
// atomics (a pair's receiver i repeats in neighbor_list's order, its sender j anywhere), where
// PyTorch's index_select backward (index_add of [2P, 3] rows) took 131 us for the 139k pairs of
// a 3,000-atom box on an H200.
#include <algorithm>
#include <cstdint>

#include "kernel_utils.cuh"
#include "pair_vectors.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ bool in_range(int64_t k, int64_t n) { return k >= 0 && k < n; }

// Pair p's vector (false when an index is out of range).
__device__ __forceinline__ bool pair_vector(const float* positions, const int64_t* pairs, const float* shifts,
                                            int64_t N, int64_t P, int64_t p, int64_t& i, int64_t& j,
                                            float (&v)[3]) {
  i = pairs[p];
  j = pairs[P + p];
  if (!in_range(i, N) || !in_range(j, N)) return false;
#pragma unroll
  for (int c = 0; c < 3; ++c) v[c] = positions[3 * j + c] - positions[3 * i + c] + (shifts ? shifts[3 * p + c] : 0.0f);
  return true;
}

__global__ void __launch_bounds__(kThreads) pair_vectors_kernel(PairVectorsParams p) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (k >= p.num_pairs) return;
  int64_t i, j;
  float v[3];
  if (!pair_vector(p.positions, p.pairs, p.shifts, p.num_atoms, p.num_pairs, k, i, j, v)) {
    const float nan = __int_as_float(0x7fc00000);
    v[0] = v[1] = v[2] = nan;
  }
#pragma unroll
  for (int c = 0; c < 3; ++c) p.vectors[3 * k + c] = v[c];
  p.distances[k] = sqrtf(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
}

// The senders j are scattered with one atomic per pair and component. The receivers i come in
// runs (neighbor_list sorts by i, ~46 pairs an atom at 3,000 atoms): lanes of a warp that hold
// one run first sum it with shuffles and its first lane adds the sum, since atomics on one address
// serialize (with an atomic per pair and component on both sides, the 3,000-atom box's
// energy+forces took 0.21 ms more GPU time than with PyTorch's index_add; H200). Any order stays
// correct: a lane whose neighbors differ adds its own value.
// Adds g to atom k's row of the [N, 4] float32 accumulator: one 16-byte atomic on sm_90 (a third
// of the atomic operations, which bound this kernel), three elsewhere.
__device__ __forceinline__ void add_row(float4* acc, int64_t k, const float (&g)[3], float sign) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(acc + k, make_float4(sign * g[0], sign * g[1], sign * g[2], 0.0f));
#else
  float* row = reinterpret_cast<float*>(acc + k);
  for (int c = 0; c < 3; ++c) atomicAdd(row + c, sign * g[c]);
#endif
}

// Pair k's terms of the gradient (none for k >= P): add(atom, g, sign) adds sign * g to the
// atom's row; an out-of-range index sets *invalid. Every lane of the warp calls it.
template <class Add>
__device__ __forceinline__ void backward_pair(const PairVectorsBackwardParams& p, int64_t k, int* invalid, Add add) {
  const int lane = threadIdx.x % 32;
  int64_t i = -1, j = -1;
  float g[3] = {0.0f, 0.0f, 0.0f};
  if (k < p.num_pairs) {
    float v[3];
    if (pair_vector(p.positions, p.pairs, p.shifts, p.num_atoms, p.num_pairs, k, i, j, v)) {
      const float d = sqrtf(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
      // The distance's gradient is taken as 0 at d = 0, as PyTorch's vector_norm does (only
      // there: a NaN distance passes NaN on).
      const float radial = d != 0.0f ? p.grad_distances[k] / d : 0.0f;
#pragma unroll
      for (int c = 0; c < 3; ++c) g[c] = p.grad_vectors[3 * k + c] + radial * v[c];
      add(j, g, 1.0f);
    } else {
      *invalid = 1;
      i = -1;  // adds nothing below
    }
  }
  // Runs of equal i among the warp's lanes: a run starts where i differs from the lane before.
  const int64_t before = __shfl_up_sync(0xffffffffu, i, 1);
  const unsigned starts = __ballot_sync(0xffffffffu, lane == 0 || before != i);
  const unsigned later = starts & ~((2u << lane) - 1u);  // starts after this lane (lane 31: none)
  const int run_end = (lane == 31 || later == 0) ? 31 : __ffs(later) - 2;
  // Suffix sums within the run (Hillis-Steele): after the loop a run's first lane holds its sum.
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
#pragma unroll
    for (int c = 0; c < 3; ++c) {
      const float other = __shfl_down_sync(0xffffffffu, g[c], offset);
      if (lane + offset <= run_end) g[c] += other;
    }
  }
  if (i >= 0 && (starts >> lane & 1u)) add(i, g, -1.0f);
}

__global__ void __launch_bounds__(kThreads) pair_vectors_backward_kernel(PairVectorsBackwardParams p,
                                                                         float4* acc,   // [N] rows, zeroed
                                                                         int* invalid) {  // [1], zeroed
  backward_pair(p, static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x, invalid,
                [acc](int64_t atom, const float (&g)[3], float sign) { add_row(acc, atom, g, sign); });
}

// The [N, 4] accumulator into the [N, 3] gradient; NaN everywhere after an out-of-range index.
__global__ void __launch_bounds__(kThreads) pair_vectors_finish_kernel(const float4* acc,  // [N]
                                                                       const int* invalid,  // [1]
                                                                       float* grad,         // [N, 3] out
                                                                       int64_t values) {    // 3N
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= values) return;
  grad[e] = *invalid ? __int_as_float(0x7fc00000) : reinterpret_cast<const float*>(acc + e / 3)[e % 3];
}

// Small systems: the whole backward in one block, the accumulator in shared memory: one launch
// where the grid takes three (a memset, the scatter and the conversion), each of which costs a
// CUDA graph 1-2 us however little it does (benzene: 12 atoms, 132 pairs).
constexpr int kOneBlockMaxAtoms = 1024;
constexpr int64_t kOneBlockMaxPairs = 8192;
constexpr int kOneBlockThreads = 1024;

__global__ void __launch_bounds__(kOneBlockThreads)
    pair_vectors_backward_one_block_kernel(PairVectorsBackwardParams p) {
  __shared__ float acc[3 * kOneBlockMaxAtoms];
  __shared__ int invalid;
  const int values = static_cast<int>(3 * p.num_atoms);
  for (int e = threadIdx.x; e < values; e += blockDim.x) acc[e] = 0.0f;
  if (threadIdx.x == 0) invalid = 0;
  __syncthreads();
  for (int64_t k0 = 0; k0 < p.num_pairs; k0 += blockDim.x)  // the same trip count in every warp
    backward_pair(p, k0 + threadIdx.x, &invalid, [](int64_t atom, const float (&g)[3], float sign) {
      for (int c = 0; c < 3; ++c) atomicAdd(&acc[3 * atom + c], sign * g[c]);
    });
  __syncthreads();
  for (int e = threadIdx.x; e < values; e += blockDim.x)
    p.grad_positions[e] = invalid ? __int_as_float(0x7fc00000) : acc[e];
}

unsigned blocks_for(int64_t pairs) { return static_cast<unsigned>(ceil_div(pairs, kThreads)); }

}  // namespace

// The flag, then the accumulator 16 bytes aligned: zeroed by one memset.
size_t pair_vectors_backward_workspace_bytes(int64_t num_atoms) {
  return 16 + static_cast<size_t>(num_atoms) * sizeof(float4);
}

cudaError_t launch_pair_vectors(const PairVectorsParams& params, cudaStream_t stream) {
  if (params.num_pairs == 0) return cudaSuccess;
  if (ceil_div(params.num_pairs, kThreads) > INT32_MAX) return cudaErrorInvalidValue;
  pair_vectors_kernel<<<blocks_for(params.num_pairs), kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t launch_pair_vectors_backward(const PairVectorsBackwardParams& params, void* workspace,
                                         cudaStream_t stream) {
  const int64_t values = params.num_atoms * 3;
  if (params.num_atoms <= kOneBlockMaxAtoms && params.num_pairs <= kOneBlockMaxPairs) {
    if (values > 0) pair_vectors_backward_one_block_kernel<<<1, kOneBlockThreads, 0, stream>>>(params);
    return cudaGetLastError();
  }
  if (ceil_div(std::max(params.num_pairs, values), kThreads) > INT32_MAX) return cudaErrorInvalidValue;
  int* invalid = static_cast<int*>(workspace);
  float4* acc = reinterpret_cast<float4*>(static_cast<char*>(workspace) + 16);
  cudaError_t status =
      cudaMemsetAsync(workspace, 0, pair_vectors_backward_workspace_bytes(params.num_atoms), stream);
  if (status != cudaSuccess || values == 0) return status;
  if (params.num_pairs > 0) {
    pair_vectors_backward_kernel<<<blocks_for(params.num_pairs), kThreads, 0, stream>>>(params, acc, invalid);
    status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  pair_vectors_finish_kernel<<<blocks_for(values), kThreads, 0, stream>>>(acc, invalid, params.grad_positions,
                                                                           values);
  return cudaGetLastError();
}

}  // namespace mirage::cuda
