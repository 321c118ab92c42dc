// PaiNN's scalar/vector message passing and its first-order backward. Host-includable.
//
// For pairs p = (i, j) (pairs[0] = receiver i, pairs[1] = sender j), with m = x[j] * filter[p]
// split into (m_s, m_vv, m_vs), each F wide:
//   scalar[i]    += m_s
//   vector[i, c] += vectors[j, c] * m_vv + m_vs * directions[p, c]
// Pairs may come in any order and repeat; an index outside [0, N) is never followed: the pair is
// skipped and every output is written NaN (graph-safe: nothing is reported to the host).
// The filter is read from memory, or formed in the kernel from its Linear's input (FusedFilter):
// PaiNN's filter is a Linear of the pair's radial basis, 3F wide for a basis of ~20, so forming
// it where it is used saves writing and reading [P, 3F] and a GEMM of poor shape.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

// filter[p] = basis[p] @ weight^T, formed in the kernel when basis is not null (the params'
// filter is then not read). float32 only, F % 4 == 0 and K <= kMaxFusedFilterWidth:
// fused_filter_supported.
struct FusedFilter {
  const float* basis = nullptr;   // [P, K] contiguous
  const float* weight = nullptr;  // [3F, K] contiguous (nn.Linear's layout)
  int width = 0;                  // K
};

inline constexpr int kMaxFusedFilterWidth = 32;

struct VectorMessagePassingParams {
  const void* x;           // [N, 3F] contiguous, parts (s, vv, vs)
  const void* filter;      // [P, 3F] contiguous, same part order
  const void* vectors;     // [N, 3, F] contiguous
  const void* directions;  // [P, 3] contiguous
  const int64_t* pairs;    // [2, P] contiguous: row 0 receivers i, row 1 senders j
  void* scalar;            // [N, F] out
  void* vector;            // [N, 3, F] out
  // [1] neighbor_list's count, or null: the pairs from pairs_to_walk on are padding, skipped.
  const int64_t* live_pairs;
  int64_t nodes;           // N
  int64_t num_pairs;       // P
  int64_t features;        // F
  DType dtype;             // of every floating tensor above
  FusedFilter fused;       // or the filter formed from a basis
};

// The gradients of the op with respect to x, filter, vectors and directions.
struct VectorMessagePassingBackwardParams {
  const void* grad_scalar;  // [N, F] contiguous
  const void* grad_vector;  // [N, 3, F] contiguous
  const void* x;            // [N, 3F]
  const void* filter;       // [P, 3F]
  const void* vectors;      // [N, 3, F]
  const void* directions;   // [P, 3]
  const int64_t* pairs;     // [2, P]
  void* grad_x;             // [N, 3F] out
  void* grad_filter;        // [P, 3F] out (null with grad_basis)
  void* grad_vectors;       // [N, 3, F] out
  void* grad_directions;    // [P, 3] out
  const int* sender_order;  // [P] mirage::sender_order's, checked (pair_order.cuh), or null: sorted here
  const int64_t* live_pairs;  // as the forward's (the skipped pairs' gradients 0); an order must then keep them last
  int64_t nodes;
  int64_t num_pairs;
  int64_t features;
  DType dtype;
  FusedFilter fused;        // the filter formed from a basis (grad_filter [P, 3F] unless grad_basis)
  // [P, K] out, or null: with a fused filter where basis_gradient_supported, on a list walked in
  // sender order (use_sender_order), the basis' gradient (grad_filter @ weight) formed on tensor
  // cores in place of grad_filter, which is then not written.
  void* grad_basis = nullptr;
};

// Whether the kernels form the filter of F features from a basis of K on the current device
// (float32, F % 4 == 0, 1 <= K <= kMaxFusedFilterWidth, the weight fits in shared memory).
bool fused_filter_supported(int64_t features, int64_t width, DType dtype);

// Whether the backward forms the basis' gradient itself (grad_basis) for F features and a basis of
// K on the current device: a fused filter with F % 16 == 0, K <= 24, and 1152 F bytes of shared
// memory a block (F <= 192 on compute capability 9.0, 144 on 8.0, 80 on 8.6 and 8.9).
bool basis_gradient_supported(int64_t features, int64_t width, DType dtype);

// Bytes of device scratch the launchers need: the invalid-index flag (and the basis kernel's count
// of windows handed out), float32 accumulators for float16/bfloat16 outputs, the sender order.
size_t vector_message_passing_workspace_bytes(const VectorMessagePassingParams& params);
size_t vector_message_passing_backward_workspace_bytes(const VectorMessagePassingBackwardParams& params);

// Launch on `stream` into the current device; `workspace` holds the bytes above (any content).
// The outputs need no initialization. Return the status of the last launch.
cudaError_t launch_vector_message_passing(const VectorMessagePassingParams& params, void* workspace,
                                          cudaStream_t stream);
cudaError_t launch_vector_message_passing_backward(const VectorMessagePassingBackwardParams& params,
                                                   void* workspace, cudaStream_t stream);

}  // namespace mirage::cuda
