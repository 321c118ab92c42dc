// mirage::group_norm: checks and the shape function shared by the CPU, Meta and CUDA kernels.
#pragma once

#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>

#include "checks.h"

namespace mirage::ops {

inline constexpr std::string_view kGroupNorm = "mirage::group_norm";

using GroupNormShape = ChannelsShape;

// Checks every argument; the shape and layout the kernels use.
GroupNormShape check_group_norm(const at::Tensor& x, int64_t num_groups,
                                const std::optional<at::Tensor>& weight,
                                const std::optional<at::Tensor>& bias, double eps,
                                std::string_view activation);

// The output: x's shape and dtype, in `shape.layout`.
at::Tensor empty_group_norm_output(const at::Tensor& x, const GroupNormShape& shape);

}  // namespace mirage::ops
