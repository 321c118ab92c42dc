// mirage::radial_basis and its backward: checks and shapes shared by the CPU, Meta and CUDA
// kernels.
#pragma once

#include <string_view>
#include <utility>
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

// float64 references of radial_basis' functions, for its CPU kernels: the
// basis without envelope and its derivative in d, each [P, num], of the P distances (any shape,
// flattened); the envelope `cutoff_fn` and its derivative, each [P]. The arguments as
// check_radial_basis takes them.
std::pair<at::Tensor, at::Tensor> reference_basis(const at::Tensor& distances, std::string_view kind, int64_t num,
                                                  double cutoff);
std::pair<at::Tensor, at::Tensor> reference_envelope(const at::Tensor& distances, std::string_view cutoff_fn,
                                                     double cutoff);

}  // namespace mirage::ops
