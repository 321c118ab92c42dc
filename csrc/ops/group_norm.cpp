// mirage::group_norm: argument checks, shape function, CPU reference and Meta kernel.
#include "group_norm.h"

#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "message.h"

namespace mirage::ops {

void check_group_norm(const at::Tensor& x, int64_t num_groups, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps, std::string_view activation) {
  check_activation_dtype(kGroupNorm, "x", x);
  MIRAGE_CHECK(x.dim() >= 2, kGroupNorm, ": x must have shape (N, C, *), got ", x.dim(),
              " dimension(s) ", x.sym_sizes());
  const c10::SymInt channels = x.sym_size(1);
  MIRAGE_CHECK(num_groups > 0, kGroupNorm, ": num_groups must be positive, got ", num_groups);
  MIRAGE_CHECK(channels % num_groups == 0, kGroupNorm,
              ": x must have C divisible by num_groups (C=", channels,
              ", num_groups=", num_groups, ")");
  check_param(kGroupNorm, "weight", weight, x, channels);
  check_param(kGroupNorm, "bias", bias, x, channels);
  param_dtype(kGroupNorm, weight, bias, x);
  MIRAGE_CHECK(eps >= 0 && finite_as_float32(eps), kGroupNorm, ": eps must be finite and >= 0 as a float32, got ",
               eps);
  MIRAGE_CHECK(activation == "none" || activation == "silu", kGroupNorm,
              ": activation must be \"none\" or \"silu\", got \"", activation, "\"");
}

namespace {

// The reference: float64, two passes per group, over an NCHW copy. Plain on purpose.
at::Tensor group_norm_cpu(const at::Tensor& x, int64_t num_groups,
                          const std::optional<at::Tensor>& weight,
                          const std::optional<at::Tensor>& bias, double eps,
                          c10::string_view activation) {
  check_group_norm(x, num_groups, weight, bias, eps, activation);
  const ChannelsShape shape = channels_shape(x);
  // Nothing to normalize; C = 0 passes any num_groups, whose empty groups the loops would walk.
  if (x.numel() == 0) return empty_in_channels_layout(x, shape.layout);
  const at::Tensor x64 = x.to(at::kDouble).contiguous();
  const at::Tensor w64 = present(weight)
                             ? weight->to(at::kDouble).contiguous()
                             : at::ones({shape.channels}, x64.options());
  const at::Tensor b64 = present(bias)
                             ? bias->to(at::kDouble).contiguous()
                             : at::zeros({shape.channels}, x64.options());
  at::Tensor y64 = at::empty_like(x64);
  const double* xs = x64.const_data_ptr<double>();
  const double* ws = w64.const_data_ptr<double>();
  const double* bs = b64.const_data_ptr<double>();
  double* ys = y64.mutable_data_ptr<double>();
  const int64_t cpg = shape.channels / num_groups;
  const int64_t group_size = cpg * shape.spatial;
  const bool silu = activation == "silu";
  for (int64_t n = 0; n < shape.batch; ++n) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t begin = (n * shape.channels + g * cpg) * shape.spatial;
      double mean = 0.0;
      for (int64_t i = 0; i < group_size; ++i) mean += xs[begin + i];
      mean /= group_size;
      double var = 0.0;
      for (int64_t i = 0; i < group_size; ++i) var += (xs[begin + i] - mean) * (xs[begin + i] - mean);
      var /= group_size;
      const double rstd = 1.0 / std::sqrt(var + eps);
      for (int64_t i = 0; i < group_size; ++i) {
        const int64_t c = g * cpg + i / shape.spatial;
        const double v = (xs[begin + i] - mean) * rstd * ws[c] + bs[c];
        ys[begin + i] = silu ? v / (1.0 + std::exp(-v)) : v;
      }
    }
  }
  return empty_in_channels_layout(x, shape.layout).copy_(y64);
}

at::Tensor group_norm_meta(const at::Tensor& x, int64_t num_groups,
                           const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, double eps,
                           c10::string_view activation) {
  check_group_norm(x, num_groups, weight, bias, eps, activation);
  return empty_in_channels_layout(x, channels_layout(x));
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) { m.impl("group_norm", &group_norm_cpu); }
TORCH_LIBRARY_IMPL(mirage, Meta, m) { m.impl("group_norm", &group_norm_meta); }

}  // namespace mirage::ops
