// mirage::bias_act: checks and shape shared by the CPU, Meta and CUDA kernels.
#pragma once

#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>

#include "checks.h"

namespace mirage::ops {

inline constexpr std::string_view kBiasAct = "mirage::bias_act";

// The activation names bias_act accepts, in the order of cuda::Activation.
inline constexpr std::string_view kBiasActivations[] = {"none", "silu", "gelu", "gelu_tanh", "relu"};

// activation's position in kBiasActivations (its cuda::Activation value), or -1 if unknown.
int bias_activation_index(std::string_view activation);

// Throws, naming op and argument, unless activation is one of kBiasActivations.
void check_bias_activation(std::string_view op, std::string_view argument, std::string_view activation);

// activation(x) with PyTorch's ops, in x's dtype (differentiable): the backward's of bias_act and
// linear, linear's CPU reference and, on CUDA past its few-rows kernel, a pass of its own.
at::Tensor apply_activation(const at::Tensor& x, std::string_view activation);

// Checks every argument (symbolic sizes kept: checks.h). The output is x's shape and dtype in
// channels_layout(x).
void check_bias_act(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& residual, std::string_view activation, double scale);

// bias ([C] or [N, C]) reshaped to broadcast against x: [1, C, 1, ...] or [N, C, 1, ...] (sizes
// kept symbolic: the autograd formula runs under torch.compile).
at::Tensor broadcastable_bias(const at::Tensor& bias, const at::Tensor& x);

}  // namespace mirage::ops
