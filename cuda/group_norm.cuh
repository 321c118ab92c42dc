// GroupNorm (+ fused activation) launchers. Host-includable.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

struct GroupNormParams {
  const void* x;       // [N, C, *spatial] contiguous, or [N, *spatial, C] when channels_last
  const void* weight;  // [C] or nullptr
  const void* bias;    // [C] or nullptr
  void* y;             // same shape and layout as x
  int64_t batch;       // N
  int64_t channels;    // C
  int64_t spatial;     // product of the spatial sizes (H * W)
  int64_t groups;      // divides C
  float eps;
  bool channels_last;
  Activation activation;
  DType dtype;        // of x and y
  DType param_dtype;  // of weight and bias
};

// Bytes of device scratch launch_group_norm needs for these params (0 when none).
size_t group_norm_workspace_bytes(const GroupNormParams& params);

// Launches on `stream` into the current device; `workspace` holds group_norm_workspace_bytes.
// Returns the launch status (cudaGetLastError after the last launch).
cudaError_t launch_group_norm(const GroupNormParams& params, void* workspace, cudaStream_t stream);

}  // namespace mirage::cuda
