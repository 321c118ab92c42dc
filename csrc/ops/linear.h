// mirage::linear: checks and shapes shared by the CPU, Meta and CUDA kernels.
#pragma once

#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>

namespace mirage::ops {

inline constexpr std::string_view kLinear = "mirage::linear";

// Checks every argument of input_activation(x) @ weight^T + bias + residual (x [..., K], weight
// [N, K], bias [N], residual [..., N]; one dtype for all; an activation name of bias_act's).
// Returns the output's shape, [..., N].
std::vector<int64_t> check_linear(const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& residual,
                                  std::string_view input_activation);

// activation(x) with PyTorch's ops, in x's dtype (differentiable): the CPU reference's, the
// backward's and, on CUDA past the few-rows kernel, a pass of its own before the matmul.
at::Tensor apply_activation(const at::Tensor& x, std::string_view activation);

}  // namespace mirage::ops
