// PaiNN's update block around its MLP, elementwise over atoms n and features f (c = 0, 1, 2 the
// vector components). Host-includable.
//
// The MLP's input:  input[n] = [s[n], sqrt(sum_c vv[n, c]^2 + eps)]
// After the MLP, with a[n] = (a_vv, a_sv, a_ss), each F wide:
//   s_out[n]    = s[n] + a_ss + a_sv * sum_c uv[n, c] * vv[n, c]
//   v_out[n, c] = v[n, c] + a_vv * uv[n, c]
// Every value is computed in float32 and rounded once to the tensors' dtype.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

struct PainnUpdateInputParams {
  const void* s;   // [N, F] contiguous
  const void* vv;  // [N, 3, F] contiguous
  void* input;     // [N, 2F] out
  int64_t nodes;     // N
  int64_t features;  // F
  float eps;
  DType dtype;  // of every tensor above
};

// vv's gradient; s's is the first half of grad, which needs no kernel.
struct PainnUpdateInputBackwardParams {
  const void* grad;  // [N, 2F] contiguous
  const void* vv;    // [N, 3, F] contiguous
  void* grad_vv;     // [N, 3, F] out
  int64_t nodes;
  int64_t features;
  float eps;
  DType dtype;
};

struct PainnUpdateParams {
  const void* s;   // [N, F] contiguous
  const void* v;   // [N, 3, F] contiguous
  const void* uv;  // [N, 3, F] contiguous
  const void* vv;  // [N, 3, F] contiguous
  const void* a;   // [N, 3F] contiguous, parts (a_vv, a_sv, a_ss)
  void* s_out;     // [N, F] out
  void* v_out;     // [N, 3, F] out
  int64_t nodes;
  int64_t features;
  DType dtype;
};

// The gradients in uv, vv and a; those in s and v are grad_s and grad_v themselves.
struct PainnUpdateBackwardParams {
  const void* grad_s;  // [N, F] contiguous
  const void* grad_v;  // [N, 3, F] contiguous
  const void* uv;      // [N, 3, F] contiguous
  const void* vv;      // [N, 3, F] contiguous
  const void* a;       // [N, 3F] contiguous
  void* grad_uv;       // [N, 3, F] out
  void* grad_vv;       // [N, 3, F] out
  void* grad_a;        // [N, 3F] out
  int64_t nodes;
  int64_t features;
  DType dtype;
};

// Launch on `stream` into the current device; the outputs need no initialization. Return the
// launch status.
cudaError_t launch_painn_update_input(const PainnUpdateInputParams& params, cudaStream_t stream);
cudaError_t launch_painn_update_input_backward(const PainnUpdateInputBackwardParams& params,
                                               cudaStream_t stream);
cudaError_t launch_painn_update(const PainnUpdateParams& params, cudaStream_t stream);
cudaError_t launch_painn_update_backward(const PainnUpdateBackwardParams& params, cudaStream_t stream);

}  // namespace mirage::cuda
