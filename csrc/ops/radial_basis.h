// mirage::radial_basis: checks and shape shared by the CPU, Meta and CUDA kernels.
#pragma once

#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

namespace mirage::ops {

inline constexpr std::string_view kRadialBasis = "mirage::radial_basis";

// Checks every argument; returns the output shape (distances' shape + [num]).
std::vector<int64_t> check_radial_basis(const at::Tensor& distances, std::string_view kind,
                                        int64_t num, double cutoff, std::string_view cutoff_fn);

}  // namespace mirage::ops
