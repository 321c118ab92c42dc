// mirage::linear: checks and shapes shared by the CPU, Meta and CUDA kernels.
#pragma once

#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/util/DimVector.h>

namespace mirage::ops {

inline constexpr std::string_view kLinear = "mirage::linear";

// Checks every argument of input_activation(x) @ weight^T + bias + residual (x [..., K], weight
// [N, K], bias [N], residual [..., N]; one dtype for all; an activation of kBiasActivations).
// Returns the output's shape, [..., N] (symbolic sizes kept: checks.h).
c10::SymDimVector check_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& residual, std::string_view input_activation);

}  // namespace mirage::ops
