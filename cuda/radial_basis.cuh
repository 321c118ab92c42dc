// Radial basis with a cutoff envelope, fused: out[p, k] = basis_k(d_p) * envelope(d_p), and its
// backward: grad_distances[p] = sum_k grad[p, k] * d/dd (basis_k * envelope)(d_p).
// Host-includable.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

struct RadialBasisParams {
  const void* distances;  // [count] contiguous
  void* out;              // [count, num] contiguous, distances' dtype
  int64_t count;
  int64_t num;            // basis functions
  float cutoff;
  RadialBasisKind kind;
  CutoffFn cutoff_fn;
  DType dtype;            // of distances and out
};

struct RadialBasisBackwardParams {
  const void* grad;       // [count, num] contiguous
  const void* distances;  // [count] contiguous
  void* grad_distances;   // [count]
  int64_t count;
  int64_t num;
  float cutoff;
  RadialBasisKind kind;
  CutoffFn cutoff_fn;
  DType dtype;            // of grad, distances and grad_distances
};

cudaError_t launch_radial_basis(const RadialBasisParams& params, cudaStream_t stream);
cudaError_t launch_radial_basis_backward(const RadialBasisBackwardParams& params,
                                         cudaStream_t stream);

}  // namespace mirage::cuda
