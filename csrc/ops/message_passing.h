// mirage::message_passing and mirage::pair_product: checks and shapes shared by the CPU, Meta
// and CUDA kernels.
#pragma once

#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

namespace mirage::ops {

inline constexpr std::string_view kMessagePassing = "mirage::message_passing";
inline constexpr std::string_view kPairProduct = "mirage::pair_product";

// Checks every argument (not the index values); returns the output shape [N, F].
std::vector<int64_t> check_message_passing(const at::Tensor& x, const at::Tensor& filter,
                                           const at::Tensor& pairs);

// Checks every argument (not the index values); returns the output shape [P, F].
std::vector<int64_t> check_pair_product(const at::Tensor& a, const at::Tensor& b,
                                        const at::Tensor& pairs);

}  // namespace mirage::ops
