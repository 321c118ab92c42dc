// mirage::layer_norm / add_layer_norm: checks, CPU reference and Meta kernels.
#include "layer_norm.h"

#include <cmath>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "message.h"

namespace mirage::ops {

void check_layer_norm(std::string_view op, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps) {
  check_activation_dtype(op, "x", x);
  MIRAGE_CHECK(x.dim() >= 1, op, ": x must have at least one dimension, got a scalar");
  const c10::SymInt dim = x.sym_size(-1);
  check_param(op, "weight", weight, x, dim);
  check_param(op, "bias", bias, x, dim);
  param_dtype(op, weight, bias, x);
  MIRAGE_CHECK(eps >= 0 && finite_as_float32(eps), op, ": eps must be finite and >= 0 as a float32, got ", eps);
}

void check_add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                          const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                          double eps) {
  check_layer_norm(kAddLayerNorm, x, weight, bias, eps);
  check_same_device(kAddLayerNorm, "residual", residual, x);
  MIRAGE_CHECK(residual.sym_sizes() == x.sym_sizes(), kAddLayerNorm,
              ": residual must have x's shape ", x.sym_sizes(), ", got ", residual.sym_sizes());
  MIRAGE_CHECK(residual.scalar_type() == x.scalar_type(), kAddLayerNorm,
              ": residual must have x's dtype (", x.scalar_type(), "), got ",
              residual.scalar_type());
}

namespace {

// The reference: float64, two passes per row. Plain on purpose.
at::Tensor layer_norm_reference(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                const std::optional<at::Tensor>& bias, double eps, int64_t dim) {
  const at::Tensor x64 = x.to(at::kDouble).contiguous();
  const at::Tensor w64 = present(weight) ? weight->to(at::kDouble).contiguous()
                                                                 : at::ones({dim}, x64.options());
  const at::Tensor b64 = present(bias) ? bias->to(at::kDouble).contiguous()
                                                             : at::zeros({dim}, x64.options());
  at::Tensor y64 = at::empty_like(x64);
  const double* xs = x64.const_data_ptr<double>();
  const double* ws = w64.const_data_ptr<double>();
  const double* bs = b64.const_data_ptr<double>();
  double* ys = y64.mutable_data_ptr<double>();
  const int64_t rows = dim == 0 ? 0 : x64.numel() / dim;
  for (int64_t r = 0; r < rows; ++r) {
    const double* row = xs + r * dim;
    double mean = 0.0;
    for (int64_t i = 0; i < dim; ++i) mean += row[i];
    mean /= dim;
    double var = 0.0;
    for (int64_t i = 0; i < dim; ++i) var += (row[i] - mean) * (row[i] - mean);
    var /= dim;
    const double rstd = 1.0 / std::sqrt(var + eps);
    for (int64_t i = 0; i < dim; ++i) ys[r * dim + i] = (row[i] - mean) * rstd * ws[i] + bs[i];
  }
  return y64.to(x.scalar_type());
}

at::Tensor layer_norm_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                          const std::optional<at::Tensor>& bias, double eps) {
  check_layer_norm(kLayerNorm, x, weight, bias, eps);
  return layer_norm_reference(x, weight, bias, eps, x.size(-1));
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm_cpu(const at::Tensor& x,
                                                      const at::Tensor& residual,
                                                      const std::optional<at::Tensor>& weight,
                                                      const std::optional<at::Tensor>& bias,
                                                      double eps) {
  check_add_layer_norm(x, residual, weight, bias, eps);
  // The sum is rounded to x's dtype before it is normalized, as the unfused code does.
  at::Tensor sum = (x.to(at::kDouble) + residual.to(at::kDouble)).to(x.scalar_type()).contiguous();
  return {layer_norm_reference(sum, weight, bias, eps, x.size(-1)), sum};
}

at::Tensor layer_norm_meta(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, double eps) {
  check_layer_norm(kLayerNorm, x, weight, bias, eps);
  return at::empty_symint(x.sym_sizes(), x.options());
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm_meta(const at::Tensor& x,
                                                       const at::Tensor& residual,
                                                       const std::optional<at::Tensor>& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       double eps) {
  check_add_layer_norm(x, residual, weight, bias, eps);
  return {at::empty_symint(x.sym_sizes(), x.options()), at::empty_symint(x.sym_sizes(), x.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) {
  m.impl("layer_norm", &layer_norm_cpu);
  m.impl("add_layer_norm", &add_layer_norm_cpu);
}
TORCH_LIBRARY_IMPL(mirage, Meta, m) {
  m.impl("layer_norm", &layer_norm_meta);
  m.impl("add_layer_norm", &add_layer_norm_meta);
}

}  // namespace mirage::ops
