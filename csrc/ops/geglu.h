// mirage::geglu: checks and shape shared by the CPU, Meta and CUDA kernels.
#pragma once

#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

namespace mirage::ops {

inline constexpr std::string_view kGeglu = "mirage::geglu";

// Checks x and approximate; returns the output shape (x's, last dimension halved).
std::vector<int64_t> check_geglu(const at::Tensor& x, std::string_view approximate);

}  // namespace mirage::ops
