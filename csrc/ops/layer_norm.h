// mirage::layer_norm and mirage::add_layer_norm: checks shared by the CPU, Meta and CUDA kernels.
#pragma once

#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>

namespace mirage::ops {

inline constexpr std::string_view kLayerNorm = "mirage::layer_norm";
inline constexpr std::string_view kAddLayerNorm = "mirage::add_layer_norm";

// Checks x (normalized over its last dimension), the affine and eps (symbolic sizes kept:
// checks.h). The outputs are contiguous, of x's shape and dtype.
void check_layer_norm(std::string_view op, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps);

// check_layer_norm for add_layer_norm, plus: residual must match x in shape, dtype and device.
void check_add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                          const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                          double eps);

}  // namespace mirage::ops
