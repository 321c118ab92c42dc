// LayerNorm over the last dimension, with an optional fused residual add. Host-includable.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

struct LayerNormParams {
  const void* x;         // [rows, dim] contiguous
  const void* residual;  // [rows, dim] contiguous, or nullptr
  const void* weight;    // [dim] or nullptr
  const void* bias;      // [dim] or nullptr
  void* y;               // [rows, dim]: layer_norm(x + residual)
  void* sum;             // [rows, dim]: x + residual, rounded to dtype; written iff residual
  int64_t rows;
  int64_t dim;
  float eps;
  DType dtype;        // of x, residual, y and sum
  DType param_dtype;  // of weight and bias
};

// The longest row (in elements) launch_layer_norm accepts for a dtype: a row lives in registers.
int64_t layer_norm_max_dim(DType dtype);

cudaError_t launch_layer_norm(const LayerNormParams& params, cudaStream_t stream);

}  // namespace mirage::cuda
