// The pair geometry and its gradient: one thread per pair. The backward scatters with float32
// atomics (a pair's receiver i repeats in neighbor_list's order, its sender j anywhere), where
// PyTorch's index_select backward (index_add of [2P, 3] rows) took 131 us for the 139k pairs of
// a 3,000-atom box on an H200.
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

__global__ void __launch_bounds__(kThreads) pair_vectors_backward_kernel(PairVectorsBackwardParams p, int* invalid) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (k >= p.num_pairs) return;
  int64_t i, j;
  float v[3];
  if (!pair_vector(p.positions, p.pairs, p.shifts, p.num_atoms, p.num_pairs, k, i, j, v)) {
    *invalid = 1;
    return;
  }
  const float d = sqrtf(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
  // The distance's gradient is taken as 0 at d = 0, as PyTorch's vector_norm does.
  const float radial = d > 0.0f ? p.grad_distances[k] / d : 0.0f;
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    const float g = p.grad_vectors[3 * k + c] + radial * v[c];
    atomicAdd(p.grad_positions + 3 * j + c, g);
    atomicAdd(p.grad_positions + 3 * i + c, -g);
  }
}

unsigned blocks_for(int64_t pairs) { return static_cast<unsigned>(ceil_div(pairs, kThreads)); }

}  // namespace

size_t pair_vectors_backward_workspace_bytes() { return sizeof(int); }

cudaError_t launch_pair_vectors(const PairVectorsParams& params, cudaStream_t stream) {
  if (params.num_pairs == 0) return cudaSuccess;
  if (ceil_div(params.num_pairs, kThreads) > INT32_MAX) return cudaErrorInvalidValue;
  pair_vectors_kernel<<<blocks_for(params.num_pairs), kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t launch_pair_vectors_backward(const PairVectorsBackwardParams& params, void* workspace,
                                         cudaStream_t stream) {
  if (ceil_div(params.num_pairs, kThreads) > INT32_MAX) return cudaErrorInvalidValue;
  int* invalid = static_cast<int*>(workspace);
  const int64_t values = params.num_atoms * 3;
  cudaError_t status = cudaMemsetAsync(invalid, 0, sizeof(int), stream);
  if (status == cudaSuccess && values > 0)
    status = cudaMemsetAsync(params.grad_positions, 0, values * sizeof(float), stream);
  if (status != cudaSuccess || params.num_pairs == 0) return status;
  pair_vectors_backward_kernel<<<blocks_for(params.num_pairs), kThreads, 0, stream>>>(params, invalid);
  status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  return launch_finish<float>(Segments{{{nullptr, params.grad_positions, values}}}, invalid, stream);
}

}  // namespace mirage::cuda
