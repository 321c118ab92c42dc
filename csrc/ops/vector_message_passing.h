// mirage::vector_message_passing (and its backward): checks and shapes shared by the CPU, Meta and
// CUDA kernels.
#pragma once

#include <optional>
#include <string_view>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace mirage::ops {

inline constexpr std::string_view kVectorMessagePassing = "mirage::vector_message_passing";
inline constexpr std::string_view kVectorMessagePassingBackward =
    "mirage::vector_message_passing_backward";

struct VectorMessagePassingShape {
  int64_t nodes;     // N
  int64_t pairs;     // P
  int64_t features;  // F
  int64_t width;     // the filter argument's columns: 3F, or K with filter_weight (the basis)
};

// Checks x [N, 3F], filter [P, 3F] (with filter_weight [3F, K]: filter is the basis [P, K]),
// vectors [N, 3, F], directions [P, 3], pairs [2, P] int64: shapes, dtypes (all floating inputs
// in x's dtype) and devices, sender_order and num_pairs as pair_order.h says. `op` names the op in
// messages.
VectorMessagePassingShape check_vector_message_passing(std::string_view op, const at::Tensor& x,
                                                       const at::Tensor& filter,
                                                       const at::Tensor& vectors,
                                                       const at::Tensor& directions,
                                                       const at::Tensor& pairs,
                                                       const std::optional<at::Tensor>& filter_weight,
                                                       const std::optional<at::Tensor>& sender_order,
                                                       const std::optional<at::Tensor>& num_pairs);

// The above plus grad_scalar [N, F] and grad_vector [N, 3, F] in x's dtype on x's device.
VectorMessagePassingShape check_vector_message_passing_backward(
    const at::Tensor& grad_scalar, const at::Tensor& grad_vector, const at::Tensor& x,
    const at::Tensor& filter, const at::Tensor& vectors, const at::Tensor& directions,
    const at::Tensor& pairs, const std::optional<at::Tensor>& filter_weight,
    const std::optional<at::Tensor>& sender_order, const std::optional<at::Tensor>& num_pairs);

// The filter [P, 3F]: `filter` itself, or the basis through filter_weight (filter @ weight^T).
at::Tensor formed_filter(const at::Tensor& filter, const std::optional<at::Tensor>& filter_weight);

// (scalar [N, F], vector [N, 3, F]), uninitialized: the shapes every kernel returns.
std::tuple<at::Tensor, at::Tensor> empty_vector_message_passing_outputs(
    const VectorMessagePassingShape& s, const at::TensorOptions& options);

// (grad_x [N, 3F], grad_filter [P, width], grad_vectors [N, 3, F], grad_directions [P, 3]),
// uninitialized: the backward's outputs (grad_filter the gradient of the filter argument: with
// filter_weight, of the basis).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> empty_vector_message_passing_gradients(
    const VectorMessagePassingShape& s, const at::TensorOptions& options);

}  // namespace mirage::ops
