// mirage::painn_update and mirage::painn_update_input (and their backward ops): checks and
// shapes shared by the CPU, Meta and CUDA kernels. The formulas: cuda/painn_update.cuh.
#pragma once

#include <string_view>

#include <ATen/core/Tensor.h>

namespace mirage::ops {

inline constexpr std::string_view kPainnUpdateInput = "mirage::painn_update_input";
inline constexpr std::string_view kPainnUpdateInputBackward = "mirage::painn_update_input_backward";
inline constexpr std::string_view kPainnUpdate = "mirage::painn_update";
inline constexpr std::string_view kPainnUpdateBackward = "mirage::painn_update_backward";

struct PainnUpdateShape {
  int64_t nodes;     // N
  int64_t features;  // F
};

// s [N, F], vv [N, 3, F] in s's dtype and device, eps >= 0 and finite.
PainnUpdateShape check_painn_update_input(const at::Tensor& s, const at::Tensor& vv, double eps);

// grad [N, 2F], vv [N, 3, F] in grad's dtype and device, eps >= 0 and finite.
PainnUpdateShape check_painn_update_input_backward(const at::Tensor& grad, const at::Tensor& vv,
                                                   double eps);

// s [N, F]; v, uv, vv [N, 3, F]; a [N, 3F]; all in s's dtype and on its device. `op` and
// `s_name` name the op and its first argument in messages (the backward passes grad_s).
PainnUpdateShape check_painn_update(std::string_view op, std::string_view s_name, const at::Tensor& s,
                                    std::string_view v_name, const at::Tensor& v, const at::Tensor& uv,
                                    const at::Tensor& vv, const at::Tensor& a);

}  // namespace mirage::ops
