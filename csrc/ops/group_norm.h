// mirage::group_norm: checks shared by the CPU, Meta and CUDA kernels.
#pragma once

#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>

#include "checks.h"

namespace mirage::ops {

inline constexpr std::string_view kGroupNorm = "mirage::group_norm";

// Checks every argument (symbolic sizes kept: checks.h). The output is x's shape and dtype in
// channels_layout(x).
void check_group_norm(const at::Tensor& x, int64_t num_groups, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps, std::string_view activation);

}  // namespace mirage::ops
