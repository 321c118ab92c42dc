// mirage::pair_vectors (and its backward): checks and shapes shared by the CPU, Meta and CUDA
// kernels. The formulas: cuda/pair_vectors.cuh.
#pragma once

#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>

namespace mirage::ops {

inline constexpr std::string_view kPairVectors = "mirage::pair_vectors";
inline constexpr std::string_view kPairVectorsBackward = "mirage::pair_vectors_backward";

struct PairVectorsShape {
  int64_t atoms;  // N
  int64_t pairs;  // P
};

// positions [N, 3] float32 (float64 off the GPU), pairs [2, P] int64, shifts None or [P, 3] in
// positions' dtype, all on positions' device, sender_order as pair_order.h says. `op` names the op
// in messages.
PairVectorsShape check_pair_vectors(std::string_view op, const at::Tensor& positions, const at::Tensor& pairs,
                                    const std::optional<at::Tensor>& shifts,
                                    const std::optional<at::Tensor>& sender_order);

// The above plus grad_vectors [P, 3] and grad_distances [P] in positions' dtype and device, each
// None where the energy does not depend on it (zero).
PairVectorsShape check_pair_vectors_backward(const std::optional<at::Tensor>& grad_vectors,
                                             const std::optional<at::Tensor>& grad_distances,
                                             const at::Tensor& positions, const at::Tensor& pairs,
                                             const std::optional<at::Tensor>& shifts,
                                             const std::optional<at::Tensor>& sender_order);

}  // namespace mirage::ops
