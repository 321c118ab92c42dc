// Message passing over a pair list (SchNet's continuous-filter convolution) and its companion
// gather-product, which together close under differentiation:
//   message_passing: out[i, f] = sum over p with pairs[0, p] == i of x[pairs[1, p], f] * filter[p, f]
//   pair_product:    out[p, f] = a[pairs[0, p], f] * b[pairs[1, p], f]
// Host-includable.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

struct MessagePassingParams {
  const void* x;         // [num_nodes, features] contiguous
  const void* filter;    // [num_pairs, features] contiguous, x's dtype
  const int64_t* pairs;  // [2, num_pairs] contiguous: row 0 receivers i, row 1 senders j
  void* out;             // [num_nodes, features] contiguous, x's dtype
  // Device scratch of message_passing_workspace_bytes(): a float32 accumulator for float16 and
  // bfloat16 output, and the invalid-pair flag. Zeroed by the launcher.
  void* workspace;
  int64_t num_nodes;
  int64_t num_pairs;
  int64_t features;
  DType dtype;  // of x, filter and out
};

struct PairProductParams {
  const void* a;         // [num_nodes, features] contiguous
  const void* b;         // [num_nodes, features] contiguous, a's dtype
  const int64_t* pairs;  // [2, num_pairs] contiguous
  void* out;             // [num_pairs, features] contiguous, a's dtype
  int64_t num_nodes;
  int64_t num_pairs;
  int64_t features;
  DType dtype;
};

size_t message_passing_workspace_bytes(int64_t num_nodes, int64_t features, DType dtype);

// Pairs with an index outside [0, num_nodes) are skipped (nothing out of bounds is read or
// written) and turn the whole output NaN; no value is read on the host.
cudaError_t launch_message_passing(const MessagePassingParams& params, cudaStream_t stream);

// Rows p whose pair has an index outside [0, num_nodes) are written NaN.
cudaError_t launch_pair_product(const PairProductParams& params, cudaStream_t stream);

}  // namespace mirage::cuda
