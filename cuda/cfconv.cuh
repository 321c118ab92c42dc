// mirage::cfconv: SchNet's continuous-filter convolution with its filter network fused in, and
// its backward (docs/ops.md). float32, on tensor cores (sm_80 on, where the shared memory per
// block holds a filter weight and two 64-pair tiles: cfconv_supported).
//   filters[p] = W2 act(W1 basis[p] + b1) + b2                    [P, M]
//   out[i]     = sum over p with pairs[0, p] == i of x[pairs[1, p]] * filters[p] * envelope[p]
// Host-includable.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.cuh"
#include "radial_basis.cuh"

namespace mirage::cuda {

// The filter network's parameters, nn.Linear layout, contiguous; a null bias is zero.
struct CfconvWeights {
  const float* w1;  // [H, R]
  const float* b1;  // [H]
  const float* w2;  // [M, H]
  const float* b2;  // [M]
  int num_rbf;      // R
  int width;        // H == M: 64 or 128 (cfconv_supported)
  Activation activation;
  // The products' precision: false splits every float32 operand into two TF32 parts and adds
  // three tensor-core products (float32-accurate, the default); true rounds the operands to TF32
  // once (the op's tf32 argument).
  bool tf32;
};

struct CfconvParams {
  CfconvWeights weights;
  const float* x;         // [N, M] contiguous, 16-byte aligned
  const float* basis;     // [P, R] contiguous
  const float* envelope;  // [P]
  const int64_t* pairs;   // [2, P]: row 0 receivers i, row 1 senders j
  float* out;             // [N, M], 16-byte aligned
  float* filters;         // [P, M], 16-byte aligned
  int* invalid;           // device flag (4 bytes of scratch), zeroed by the launcher
  // [1] neighbor_list's count, or null: the pairs from sender_order.h's walked_pairs on are
  // padding, skipped (no messages; their filters 0).
  const int64_t* live_pairs;
  int64_t num_nodes, num_pairs;
};

struct CfconvBackwardParams {
  CfconvWeights weights;
  const float* grad;      // [N, M]: the gradient of out, 16-byte aligned
  const float* x;         // [N, M], 16-byte aligned
  const float* basis;     // [P, R]
  const float* envelope;  // [P]
  const int64_t* pairs;   // [2, P]
  const float* filters;   // [P, M] (cfconv's second output), 16-byte aligned
  float* grad_x;          // [N, M], 16-byte aligned
  float* grad_basis;      // [P, R]
  float* grad_envelope;   // [P]
  int* invalid;           // as above
  const int* sender_order;  // [P] mirage::sender_order's, checked (pair_order.cuh), or null: sorted here
  const int64_t* live_pairs;  // as above (the skipped pairs' gradients 0); an order must then keep them last
  int64_t num_nodes, num_pairs;
};

// Whether the kernels take these sizes on the current device (H == M in {64, 128}, R <= 64,
// enough shared memory per block, tensor cores with TF32).
bool cfconv_supported(int64_t num_rbf, int64_t hidden, int64_t width);

// Bytes of device scratch (256-byte aligned) the backward launchers below take for these sizes and
// whether a sender order is given (less: no sort): long lists are walked in sender order
// (pair_order.cuh), the messages onto senders summed over runs of equal senders. 0 for short
// lists (the workspace may be null).
size_t cfconv_backward_workspace_bytes(int64_t num_nodes, int64_t num_pairs, bool given_order);

// Pairs with an index outside [0, num_nodes) are skipped and turn every output NaN (no host sync).
cudaError_t launch_cfconv(const CfconvParams& params, cudaStream_t stream);
cudaError_t launch_cfconv_backward(const CfconvBackwardParams& params, void* workspace, cudaStream_t stream);

// mirage::radial_cfconv: cfconv with the basis and the envelope formed from the distances in the
// kernel, and the filters' derivative in the distance carried forward beside them:
//   filters[p]     = (W2 act(W1 basis(d_p) + b1) + b2) * envelope(d_p)     [P, M]
//   derivatives[p] = d filters[p] / d d_p                                   [P, M]
//   out[i]         = sum over p with pairs[0, p] == i of x[pairs[1, p]] * filters[p]
// Its backward is then a pass over the pairs with no products:
//   grad_x[j] += grad[i] * filters[p],  grad_distances[p] = sum_c grad[i, c] x[j, c] derivatives[p, c].
struct RadialCfconvParams {
  CfconvWeights weights;
  const float* x;          // [N, M] contiguous, 16-byte aligned
  const float* distances;  // [P]
  const int64_t* pairs;    // [2, P]
  RadialBasisKind basis;   // radial_basis' functions (no cutoff function of their own)
  CutoffFn envelope;       // the filters' envelope
  float cutoff;
  float* out;              // [N, M], 16-byte aligned
  float* filters;          // [P, M], 16-byte aligned
  float* derivatives;      // [P, M]
  int* invalid;            // as above
  int64_t num_nodes, num_pairs;
};

struct RadialCfconvBackwardParams {
  const float* grad;         // [N, M], 16-byte aligned
  const float* x;            // [N, M], 16-byte aligned
  const int64_t* pairs;      // [2, P]
  const float* filters;      // [P, M], 16-byte aligned
  const float* derivatives;  // [P, M], 16-byte aligned
  float* grad_x;             // [N, M], 16-byte aligned
  float* grad_distances;     // [P]
  int* invalid;
  const int* sender_order;   // as CfconvBackwardParams'
  int64_t num_nodes, num_pairs, width;  // width M: a multiple of 4
};

// Whether the forward kernel takes these sizes on the current device: it is Hopper's (compute
// capability 9.0, this library built for sm_90a) for H == M == 128 and R <= 23. The backward
// runs on any GPU.
bool radial_cfconv_supported(int64_t num_rbf, int64_t hidden, int64_t width);

cudaError_t launch_radial_cfconv(const RadialCfconvParams& params, cudaStream_t stream);
// Its workspace: cfconv_backward_workspace_bytes(num_nodes, num_pairs, sender_order != nullptr).
cudaError_t launch_radial_cfconv_backward(const RadialCfconvBackwardParams& params, void* workspace,
                                          cudaStream_t stream);

}  // namespace mirage::cuda
