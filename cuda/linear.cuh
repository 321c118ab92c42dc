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

// mirage::linear with few outputs and many rows, float32 (PaiNN's basis gradient: [139k, 384] x
// [384, 21] at 3,000 atoms, on which cuBLAS's float32 kernels reached a quarter of the GPU's
// FMA rate): the weight in shared memory, each warp a tile of 16 rows by the outputs (one to four
// n8 tiles) on TF32 tensor
// cores with every operand split into two TF32 parts (three products: float32's accuracy; an
// infinite x gives NaN where F.linear gives an infinity, as in mirage::cfconv), x read once,
// straight from memory into the products' fragments.
inline constexpr int64_t kNarrowLinearMaxOutputs = 32;
// The weight in shared memory, [K, 34] floats: 136 KiB at most.
inline constexpr int64_t kNarrowLinearMaxInputs = 1024;

struct NarrowLinearParams {
  const float* x;       // [m, k], rows ldx floats apart; x and ldx 16-byte aligned, k % 4 == 0
  const float* weight;  // element (n, k) at weight[n * wn + k * wk]
  const float* bias;    // [n], or null
  float* y;             // [m, n], contiguous
  int64_t m, ldx, wn, wk;
  int n, k;             // 1 <= n <= kNarrowLinearMaxOutputs, 1 <= k <= kNarrowLinearMaxInputs
};

// Whether the current device's shared memory per block holds the weight of k inputs (every k up
// to kNarrowLinearMaxInputs on compute capability 8.0 and 9.0; up to 704 on 8.6 and 8.9).
bool narrow_linear_fits(int64_t k);

// y = x @ weight^T + bias, summed in float32 (three TF32 products each).
cudaError_t launch_narrow_linear(const NarrowLinearParams& params, cudaStream_t stream);

// mirage::linear in float32 on many rows, any width: 64 x 64 output tiles (32 x 32 where those
// would be too few to fill the GPU) on TF32 tensor cores, every operand split into two TF32 parts
// (three products: float32's accuracy) unless TF32 is allowed (one product), x and the weight
// staged in shared memory by cp.async in three stages (two slices of k fetched ahead of the one
// in use). cuBLAS's float32 kernels ran a force field's [3,000, 128] x [128, 128] products at ~8 us
// on an H200, a sixth of the FMA rate. The caller times it against cuBLASLt's candidates.
struct TiledLinearParams {
  const float* x;         // [m, k], rows ldx floats apart
  const float* weight;    // element (n, k) at weight[n * ldw + k] or, column-major, weight[k * ldw + n]
  const float* bias;      // [n], or null
  const float* residual;  // [m, n], rows ldr floats apart, or null
  float* y;               // [m, n], contiguous
  int64_t m, ldx, ldw, ldr;
  int n, k;
  bool weight_columns;    // the weight column-major (the transpose of a row-major [k, n] matrix)
  bool split;             // three TF32 products (float32's accuracy); one where TF32 is allowed
};

// Whether the tiled kernel takes these operands: k a multiple of 4, x's and the weight's rows
// 16-byte aligned (and, for a column-major weight, n a multiple of 4), the grid's rows and columns
// within CUDA's limits.
bool tiled_linear_applies(const TiledLinearParams& params);

// y = x @ weight^T + bias + residual, summed in float32.
cudaError_t launch_tiled_linear(const TiledLinearParams& params, cudaStream_t stream);

}  // namespace mirage::cuda
