// GEGLU gate of diffusers' feed-forward: y = a * gelu(b), [a, b] = x.chunk(2, dim=-1).
#pragma once

#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

struct GegluParams {
  const void* x;  // [rows, 2 * half_dim] contiguous
  void* y;        // [rows, half_dim] contiguous
  int64_t rows;
  int64_t half_dim;
  GeluApprox approximate;
  DType dtype;  // of x and y
};

cudaError_t launch_geglu(const GegluParams& params, cudaStream_t stream);

}  // namespace mirage::cuda
