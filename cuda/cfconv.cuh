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

// mirage::radial_cfconv: cfconv whose filters are a function of the pair's distance alone,
//   F(d)           = envelope(d) (W2 act(W1 basis(d) + b1) + b2)            [M]
//   out[i]         = sum over p with pairs[0, p] == i of x[pairs[1, p]] * F(d_p)
//   grad_x[j]     += grad[i] * F(d_p),  grad_distances[p] = sum_c grad[i, c] x[j, c] F'(d_p)[c]
// read from a table of F (filter_table.h) that the forward builds from the network in float64, so
// that neither pass runs the network per pair. Pairs at or past the cutoff add nothing (their
// gradients 0); negative or NaN distances give NaN.
struct FilterTableParams {
  const float* w1;  // [H, R], nn.Linear layout, contiguous
  const float* b1;  // [H] or null (zero)
  const float* w2;  // [M, H]
  const float* b2;  // [M] or null
  int num_rbf, hidden, width;  // R, H, M
  Activation activation;       // smooth: not relu
  RadialBasisKind basis;       // Gaussian or Bessel
  CutoffFn envelope;           // cosine or polynomial: F vanishes at the cutoff
  float cutoff;
  int64_t intervals;           // filter_table::intervals_for
  float* table;                // [intervals, 6, M]
};

// One pass over the pairs: forward (out = the messages onto the receivers) or backward (out =
// grad_x, onto the senders, and grad_distances).
struct RadialCfconvParams {
  const float* rows;       // [N, M], 16-byte aligned: forward x (at the senders), backward grad (at the receivers)
  const float* x;          // backward: [N, M], 16-byte aligned; forward: null
  const float* distances;  // [P]
  const int64_t* pairs;    // [2, P]
  const float* table;      // [intervals, 6, M], 16-byte aligned
  int64_t intervals;
  float cutoff;
  float* out;              // [N, M], 16-byte aligned
  float* grad_distances;   // backward: [P]; forward: null
  int* invalid;            // as above
  const int* sender_order; // backward: as CfconvBackwardParams'; forward: null (list order)
  int64_t num_nodes, num_pairs, width;  // width M: a multiple of 4
};

// Whether the kernels take these sizes on the current device: M a multiple of 4, and the table
// kernel's shared memory (float64 jets of R basis functions, H hidden features and 128 outputs at
// 9 ends, and a W2 tile: about 216 (R + H) + 36,000 bytes) within the device's.
bool radial_cfconv_supported(int64_t num_rbf, int64_t hidden, int64_t width);

// The table alone (mirage::schnet_energy_prepare's tables).
cudaError_t launch_filter_table(const FilterTableParams& table, cudaStream_t stream);
// The table (table.table, an output of the op), then the forward pass over params.table.
cudaError_t launch_radial_cfconv(const FilterTableParams& table, const RadialCfconvParams& params,
                                 cudaStream_t stream);
// Its workspace: cfconv_backward_workspace_bytes(num_nodes, num_pairs, sender_order != nullptr).
cudaError_t launch_radial_cfconv_backward(const RadialCfconvParams& params, void* workspace, cudaStream_t stream);

}  // namespace mirage::cuda
