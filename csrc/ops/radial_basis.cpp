// mirage::radial_basis: checks, CPU reference and Meta kernel.
#include "radial_basis.h"

#include <cmath>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "message.h"

namespace mirage::ops {

std::vector<int64_t> check_radial_basis(const at::Tensor& distances, std::string_view kind,
                                        int64_t num, double cutoff, std::string_view cutoff_fn) {
  check_activation_dtype(kRadialBasis, "distances", distances);
  MIRAGE_CHECK(kind == "gaussian" || kind == "bessel", kRadialBasis,
               ": kind must be \"gaussian\" or \"bessel\", got \"", kind, "\"");
  MIRAGE_CHECK(num > 0, kRadialBasis, ": num must be positive, got ", num);
  MIRAGE_CHECK(std::isfinite(cutoff) && cutoff > 0, kRadialBasis,
               ": cutoff must be finite and > 0, got ", cutoff);
  MIRAGE_CHECK(cutoff_fn == "cosine" || cutoff_fn == "polynomial" || cutoff_fn == "none",
               kRadialBasis, ": cutoff_fn must be \"cosine\", \"polynomial\" or \"none\", got \"",
               cutoff_fn, "\"");
  std::vector<int64_t> shape = distances.sizes().vec();
  shape.push_back(num);
  return shape;
}

namespace {

double sinc(double x) {
  return x == 0.0 ? 1.0 : std::sin(x) / x;
}

double envelope(std::string_view cutoff_fn, double d, double cutoff) {
  if (cutoff_fn == "none") return 1.0;
  if (!(d < cutoff)) return 0.0;
  const double x = d / cutoff;
  if (cutoff_fn == "cosine") return 0.5 * (std::cos(M_PI * x) + 1.0);
  return 1.0 - 28.0 * std::pow(x, 6) + 48.0 * std::pow(x, 7) - 21.0 * std::pow(x, 8);
}

// The reference: float64, element by element, straight from the formulas in docs/ops.md.
at::Tensor radial_basis_cpu(const at::Tensor& distances, c10::string_view kind, int64_t num,
                            double cutoff, c10::string_view cutoff_fn) {
  const std::vector<int64_t> shape = check_radial_basis(distances, kind, num, cutoff, cutoff_fn);
  const at::Tensor d64 = distances.to(at::kDouble).contiguous();
  at::Tensor out64 = at::empty(shape, d64.options());
  const double* ds = d64.const_data_ptr<double>();
  double* os = out64.mutable_data_ptr<double>();
  const bool gaussian = kind == "gaussian";
  const double spacing = num > 1 ? cutoff / (num - 1) : cutoff;
  for (int64_t p = 0; p < d64.numel(); ++p) {
    const double d = ds[p];
    const double env = envelope(cutoff_fn, d, cutoff);
    for (int64_t k = 0; k < num; ++k) {
      double basis;
      if (gaussian) {
        const double z = (d - k * spacing) / spacing;
        basis = std::exp(-0.5 * z * z);
      } else {
        const double frequency = (k + 1) * M_PI / cutoff;
        basis = std::sqrt(2.0 / cutoff) * frequency * sinc(frequency * d);
      }
      os[p * num + k] = basis * env;
    }
  }
  return out64.to(distances.scalar_type());
}

at::Tensor radial_basis_meta(const at::Tensor& distances, c10::string_view kind, int64_t num,
                             double cutoff, c10::string_view cutoff_fn) {
  return at::empty(check_radial_basis(distances, kind, num, cutoff, cutoff_fn), distances.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) { m.impl("radial_basis", &radial_basis_cpu); }
TORCH_LIBRARY_IMPL(mirage, Meta, m) { m.impl("radial_basis", &radial_basis_meta); }

}  // namespace mirage::ops
