// mirage::geglu: checks, CPU reference and Meta kernel.
#include "geglu.h"

#include <cmath>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "message.h"

namespace mirage::ops {

c10::SymDimVector check_geglu(const at::Tensor& x, std::string_view approximate) {
  check_activation_dtype(kGeglu, "x", x);
  MIRAGE_CHECK(x.dim() >= 1, kGeglu, ": x must have at least one dimension, got a scalar");
  MIRAGE_CHECK(x.sym_size(-1) % 2 == 0, kGeglu, ": x's last dimension must be even, got ", x.sym_size(-1));
  MIRAGE_CHECK(approximate == "none" || approximate == "tanh", kGeglu,
              ": approximate must be \"none\" or \"tanh\", got \"", approximate, "\"");
  c10::SymDimVector shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = shape.back() / 2;
  return shape;
}

namespace {

// The reference: float64, element by element. Plain on purpose.
at::Tensor geglu_cpu(const at::Tensor& x, c10::string_view approximate) {
  const c10::SymDimVector shape = check_geglu(x, approximate);
  const at::Tensor x64 = x.to(at::kDouble).contiguous();
  at::Tensor y64 = at::empty_symint(shape, x64.options());
  const int64_t half = y64.size(-1);
  const int64_t rows = half == 0 ? 0 : y64.numel() / half;
  const double* xs = x64.const_data_ptr<double>();
  double* ys = y64.mutable_data_ptr<double>();
  const bool tanh_form = approximate == "tanh";
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < half; ++i) {
      const double a = xs[r * 2 * half + i], b = xs[r * 2 * half + half + i];
      const double gelu =
          tanh_form ? 0.5 * b * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (b + 0.044715 * b * b * b)))
                    : 0.5 * b * (1.0 + std::erf(b / std::sqrt(2.0)));
      ys[r * half + i] = a * gelu;
    }
  }
  return y64.to(x.scalar_type());
}

at::Tensor geglu_meta(const at::Tensor& x, c10::string_view approximate) {
  return at::empty_symint(check_geglu(x, approximate), x.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) { m.impl("geglu", &geglu_cpu); }
TORCH_LIBRARY_IMPL(mirage, Meta, m) { m.impl("geglu", &geglu_meta); }

}  // namespace mirage::ops
