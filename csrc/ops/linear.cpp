// mirage::linear: argument checks, CPU reference and Meta kernel.
#include "linear.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "bias_act.h"
#include "checks.h"
#include "message.h"

namespace mirage::ops {

c10::SymDimVector check_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& residual, std::string_view input_activation) {
  check_activation_dtype(kLinear, "x", x);
  check_bias_activation(kLinear, "input_activation", input_activation);
  MIRAGE_CHECK(x.dim() >= 1, kLinear, ": x must have at least one dimension, got a scalar");
  check_same_device(kLinear, "weight", weight, x);
  const c10::SymInt in_features = x.sym_size(-1);
  MIRAGE_CHECK(weight.dim() == 2 && weight.sym_size(1) == in_features, kLinear,
              ": weight must have shape [out_features, ", in_features, "] for x of shape ",
              x.sym_sizes(), ", got ", weight.sym_sizes());
  MIRAGE_CHECK(weight.scalar_type() == x.scalar_type(), kLinear, ": weight must have x's dtype (",
              x.scalar_type(), "), got ", weight.scalar_type());
  const c10::SymInt out_features = weight.sym_size(0);
  if (present(bias)) {
    check_same_device(kLinear, "bias", *bias, x);
    MIRAGE_CHECK(bias->dim() == 1 && bias->sym_size(0) == out_features, kLinear,
                ": bias must have shape [", out_features, "], got ", bias->sym_sizes());
    MIRAGE_CHECK(bias->scalar_type() == x.scalar_type(), kLinear, ": bias must have x's dtype (",
                x.scalar_type(), "), got ", bias->scalar_type());
  }
  c10::SymDimVector shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = out_features;
  if (present(residual)) {
    check_same_device(kLinear, "residual", *residual, x);
    MIRAGE_CHECK(residual->sym_sizes() == c10::SymIntArrayRef(shape), kLinear,
                ": residual must have the output's shape ", c10::SymIntArrayRef(shape), ", got ",
                residual->sym_sizes());
    MIRAGE_CHECK(residual->scalar_type() == x.scalar_type(), kLinear,
                ": residual must have x's dtype (", x.scalar_type(), "), got ",
                residual->scalar_type());
  }
  return shape;
}

namespace {

// The reference: the activation in x's dtype, then PyTorch's linear in float32 (float64 for
// float64 input), the residual added to its result, one rounding to x's dtype at the end, as the
// CUDA epilogue rounds. For float32 and float64 input this is exactly
// F.linear(activation(x), weight, bias) + residual.
at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& residual, c10::string_view input_activation) {
  check_linear(x, weight, bias, residual, input_activation);
  const at::ScalarType acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const bool has_bias = present(bias);
  at::Tensor y = at::linear(apply_activation(x, input_activation).to(acc), weight.to(acc),
                            has_bias ? std::optional<at::Tensor>(bias->to(acc)) : std::nullopt);
  if (present(residual)) y = y + residual->to(acc);
  return y.to(x.scalar_type()).contiguous();
}

at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual, c10::string_view input_activation) {
  return at::empty_symint(check_linear(x, weight, bias, residual, input_activation), x.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) { m.impl("linear", &linear_cpu); }
TORCH_LIBRARY_IMPL(mirage, Meta, m) { m.impl("linear", &linear_meta); }

}  // namespace mirage::ops
