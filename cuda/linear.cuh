// mirage::linear for a few rows (a diffusion model's time embedding: 1-8 samples): one warp per
// output feature streams its weight row once for every row of x, with an activation applied to
// x on the way in. cuBLASLt's kernels for two rows took 4.9 us at [2, 1280] x [1280, 320] on an
// H200, with the activation a kernel of its own before them.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

// The most rows of x the kernel takes, and the most x values (rows x in_features): every warp
// reads all of x, and one warp per output feature suits short rows only (longer ones are
// cuBLASLt's, whose split-k kernels spread a row over the GPU).
inline constexpr int64_t kSmallLinearMaxRows = 8;
inline constexpr int64_t kSmallLinearMaxInputs = 12288;

struct SmallLinearParams {
  const void* x;         // [m, k], rows ldx elements apart
  const void* weight;    // [n, k], rows ldw elements apart
  const void* bias;      // [n], or null
  const void* residual;  // [m, n], rows ldr elements apart (0: one row for all), or null
  void* y;               // [m, n], contiguous
  int64_t m, n, k, ldx, ldw, ldr;
  Activation activation;  // applied to x, rounded to dtype (as a separate activation would be)
  DType dtype;            // of every operand
};

// y = activation(x) @ weight^T + bias + residual, summed in float32 and rounded once.
// Requires 1 <= m <= kSmallLinearMaxRows and m * k <= kSmallLinearMaxInputs.
cudaError_t launch_small_linear(const SmallLinearParams& params, cudaStream_t stream);

}  // namespace mirage::cuda
