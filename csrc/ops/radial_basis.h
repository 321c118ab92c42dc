// mirage::radial_basis and its backward: checks and shapes shared by the CPU, Meta and CUDA
// kernels.
#pragma once

#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

namespace mirage::ops {

inline constexpr std::string_view kRadialBasis = "mirage::radial_basis";
inline constexpr std::string_view kRadialBasisBackward = "mirage::radial_basis_backward";

// Checks every argument; returns the output shape (distances' shape + [num]). `op` names the
// operator in the messages.
std::vector<int64_t> check_radial_basis(const at::Tensor& distances, std::string_view kind,
                                        int64_t num, double cutoff, std::string_view cutoff_fn,
                                        std::string_view op = kRadialBasis);

// The checks of radial_basis plus grad: distances' device and dtype, shape distances' + [num].
void check_radial_basis_backward(const at::Tensor& grad, const at::Tensor& distances,
                                 std::string_view kind, int64_t num, double cutoff,
                                 std::string_view cutoff_fn);

}  // namespace mirage::ops
