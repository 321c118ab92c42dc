// mirage::subpixel_shuffle: checks and shape shared by the CPU, Meta and CUDA kernels.
#pragma once

#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/util/DimVector.h>

namespace mirage::ops {

inline constexpr std::string_view kSubpixelShuffle = "mirage::subpixel_shuffle";

// Checks x ([N, 4C, H+1, W+1]) and bias ([C]); returns the output shape [N, C, 2H, 2W] (symbolic
// sizes kept: checks.h).
c10::SymDimVector check_subpixel_shuffle(const at::Tensor& x, const std::optional<at::Tensor>& bias);

// The op in differentiable PyTorch ops (bias undefined when absent), in x's dtype: the CPU
// reference (in float64) and the autograd formula.
at::Tensor subpixel_shuffle_composite(const at::Tensor& x, const at::Tensor& bias);

}  // namespace mirage::ops
