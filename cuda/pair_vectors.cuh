// The pair geometry of a force field, fused: for p = (i, j) = (pairs[0, p], pairs[1, p]),
//   vectors[p]   = positions[j] - positions[i] + shifts[p]     (shifts: periodic images, or none)
//   distances[p] = |vectors[p]|
// and its gradient in the positions (float32), given those of vectors and distances:
//   g[p] = grad_vectors[p] + grad_distances[p] * vectors[p] / distances[p]   (2nd term 0 where d == 0)
//   grad_positions[j] += g[p],  grad_positions[i] -= g[p]
// An index outside [0, N) is never followed: the forward writes NaN to that pair; the backward
// skips it and writes NaN to every gradient (graph-safe: nothing is reported to the host).
// Host-includable.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

struct PairVectorsParams {
  const float* positions;  // [N, 3] contiguous
  const int64_t* pairs;    // [2, P] contiguous
  const float* shifts;     // [P, 3] contiguous, or null
  float* vectors;          // [P, 3] out
  float* distances;        // [P] out
  int64_t num_atoms;       // N
  int64_t num_pairs;       // P
};

struct PairVectorsBackwardParams {
  const float* grad_vectors;    // [P, 3] contiguous, or null: zero
  const float* grad_distances;  // [P] contiguous, or null: zero
  const float* positions;       // [N, 3]
  const int64_t* pairs;         // [2, P]
  const float* shifts;          // [P, 3] or null
  float* grad_positions;        // [N, 3] out
  const int* sender_order;      // [P] mirage::sender_order's, checked (pair_order.cuh), or null: sorted here
  int64_t num_atoms;
  int64_t num_pairs;
};

// Bytes of device scratch the backward launcher needs (the invalid-index flag, an [N, 4] float32
// accumulator and, for long lists, the sender order of pair_order.cuh: its sort's scratch unless
// an order is given), 256-byte aligned as the caching allocator's blocks are.
size_t pair_vectors_backward_workspace_bytes(int64_t num_atoms, int64_t num_pairs, bool given_order);

// Launch on `stream` into the current device; outputs need no initialization, `workspace` holds
// the bytes above (any content). Return the status of the last launch.
cudaError_t launch_pair_vectors(const PairVectorsParams& params, cudaStream_t stream);
cudaError_t launch_pair_vectors_backward(const PairVectorsBackwardParams& params, void* workspace,
                                         cudaStream_t stream);

}  // namespace mirage::cuda
