// The epilogue a convolution leaves to a separate pass: y = (act(x + bias) + residual) * scale,
// for x of shape [N, C, *spatial] in NCHW or channels-last order, in one read and one write.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

struct BiasActParams {
  const void* x;         // [N, C, S] in memory order [N, C, S] or, channels_last, [N, S, C]
  const void* bias;      // [C] or [N, C] (bias_per_sample), dtype bias_dtype; null: none
  const void* residual;  // x's shape, dtype and memory order; null: none
  void* y;               // x's shape, dtype and memory order
  int64_t batch, channels, spatial;
  bool channels_last;
  bool bias_per_sample;
  Activation activation;
  float scale;
  DType dtype;       // of x, residual and y
  DType bias_dtype;  // x's dtype or float32
};

cudaError_t launch_bias_act(const BiasActParams& params, cudaStream_t stream);

}  // namespace mirage::cuda
