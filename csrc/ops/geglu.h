// mirage::geglu: checks and shape shared by the CPU, Meta and CUDA kernels.
#pragma once

#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/util/DimVector.h>

namespace mirage::ops {

inline constexpr std::string_view kGeglu = "mirage::geglu";

// Checks x and approximate; returns the output shape (x's, last dimension halved; symbolic sizes
// kept: checks.h).
c10::SymDimVector check_geglu(const at::Tensor& x, std::string_view approximate);

}  // namespace mirage::ops
