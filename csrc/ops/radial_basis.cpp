// mirage::radial_basis and its backward: checks, CPU references and Meta kernels.
#include "radial_basis.h"

#include <cmath>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "message.h"

namespace mirage::ops {

std::vector<int64_t> check_radial_basis(const at::Tensor& distances, std::string_view kind,
                                        int64_t num, double cutoff, std::string_view cutoff_fn,
                                        std::string_view op) {
  check_activation_dtype(op, "distances", distances);
  MIRAGE_CHECK(kind == "gaussian" || kind == "bessel" || kind == "none", op,
               ": kind must be \"gaussian\", \"bessel\" or \"none\", got \"", kind, "\"");
  MIRAGE_CHECK(num > 0, op, ": num must be positive, got ", num);
  MIRAGE_CHECK(std::isfinite(cutoff) && cutoff > 0, op, ": cutoff must be finite and > 0, got ",
               cutoff);
  MIRAGE_CHECK(cutoff_fn == "cosine" || cutoff_fn == "polynomial" || cutoff_fn == "none", op,
               ": cutoff_fn must be \"cosine\", \"polynomial\" or \"none\", got \"", cutoff_fn,
               "\"");
  std::vector<int64_t> shape = distances.sizes().vec();
  shape.push_back(num);
  return shape;
}

void check_radial_basis_backward(const at::Tensor& grad, const at::Tensor& distances,
                                 std::string_view kind, int64_t num, double cutoff,
                                 std::string_view cutoff_fn) {
  constexpr std::string_view op = kRadialBasisBackward;
  const std::vector<int64_t> shape = check_radial_basis(distances, kind, num, cutoff, cutoff_fn, op);
  MIRAGE_CHECK(grad.device() == distances.device(), op,
               ": grad must be on the same device as distances (distances on ", distances.device(),
               ", grad on ", grad.device(), ")");
  MIRAGE_CHECK(grad.scalar_type() == distances.scalar_type(), op,
               ": grad must have distances' dtype (", distances.scalar_type(), "), got ",
               grad.scalar_type());
  MIRAGE_CHECK(grad.sizes() == at::IntArrayRef(shape), op,
               ": grad must have shape distances' + [num] = ", at::IntArrayRef(shape), ", got ",
               grad.sizes());
}

namespace {

double sinc(double x) {
  return x == 0.0 ? 1.0 : std::sin(x) / x;
}

// d sinc / dx. (x cos x - sin x) / x^2 loses about log10(3 / x^2) digits to cancellation, so
// below |x| = 0.1 it is the Taylor series -x/3 + x^3/30 - x^5/840 + x^7/45360 instead.
double sinc_derivative(double x) {
  if (std::abs(x) < 0.1) {
    const double x2 = x * x;
    return -x / 3.0 * (1.0 - x2 / 10.0 * (1.0 - x2 / 28.0 * (1.0 - x2 / 54.0)));
  }
  return (x * std::cos(x) - std::sin(x)) / (x * x);
}

double envelope(std::string_view cutoff_fn, double d, double cutoff) {
  if (cutoff_fn == "none") return 1.0;
  if (!(d < cutoff)) return 0.0;
  const double x = d / cutoff;
  if (cutoff_fn == "cosine") return 0.5 * (std::cos(M_PI * x) + 1.0);
  return 1.0 - 28.0 * std::pow(x, 6) + 48.0 * std::pow(x, 7) - 21.0 * std::pow(x, 8);
}

// d envelope / dd; 0 from the cutoff on, like the envelope.
double envelope_derivative(std::string_view cutoff_fn, double d, double cutoff) {
  if (cutoff_fn == "none" || !(d < cutoff)) return 0.0;
  const double x = d / cutoff;
  if (cutoff_fn == "cosine") return -0.5 * M_PI / cutoff * std::sin(M_PI * x);
  return (-168.0 * std::pow(x, 5) + 336.0 * std::pow(x, 6) - 168.0 * std::pow(x, 7)) / cutoff;
}

// basis_k(d) and its derivative in d: the Gaussian of center k * spacing, the Bessel function
// of frequency (k + 1) pi / cutoff (formulas in docs/ops.md), or for kind "none" cos(0 d): 1, NaN
// (value and slope) at a NaN or infinite d, as the other kinds' gradients there.
struct BasisValue {
  double value, derivative;
};

BasisValue basis(std::string_view kind, int64_t k, double d, double spacing, double cutoff) {
  if (kind == "none") return std::isfinite(d) ? BasisValue{1.0, 0.0} : BasisValue{NAN, NAN};
  if (kind == "gaussian") {
    const double z = (d - k * spacing) / spacing;
    const double value = std::exp(-0.5 * z * z);
    return {value, -z / spacing * value};
  }
  const double frequency = (k + 1) * M_PI / cutoff, scale = std::sqrt(2.0 / cutoff) * frequency;
  return {scale * sinc(frequency * d), scale * frequency * sinc_derivative(frequency * d)};
}

}  // namespace

std::pair<at::Tensor, at::Tensor> reference_basis(const at::Tensor& distances, std::string_view kind, int64_t num,
                                                  double cutoff) {
  const at::Tensor d64 = distances.to(at::kDouble).contiguous();
  const int64_t count = d64.numel();
  at::Tensor values = at::empty({count, num}, d64.options()), derivatives = at::empty({count, num}, d64.options());
  const double* ds = d64.const_data_ptr<double>();
  double* vs = values.mutable_data_ptr<double>();
  double* dvs = derivatives.mutable_data_ptr<double>();
  const double spacing = num > 1 ? cutoff / (num - 1) : cutoff;
  for (int64_t p = 0; p < count; ++p)
    for (int64_t k = 0; k < num; ++k) {
      const BasisValue b = basis(kind, k, ds[p], spacing, cutoff);
      vs[p * num + k] = b.value;
      dvs[p * num + k] = b.derivative;
    }
  return {values, derivatives};
}

std::pair<at::Tensor, at::Tensor> reference_envelope(const at::Tensor& distances, std::string_view cutoff_fn,
                                                     double cutoff) {
  const at::Tensor d64 = distances.to(at::kDouble).contiguous().reshape(-1);
  at::Tensor values = at::empty_like(d64), derivatives = at::empty_like(d64);
  const double* ds = d64.const_data_ptr<double>();
  double* vs = values.mutable_data_ptr<double>();
  double* dvs = derivatives.mutable_data_ptr<double>();
  for (int64_t p = 0; p < d64.numel(); ++p) {
    vs[p] = envelope(cutoff_fn, ds[p], cutoff);
    dvs[p] = envelope_derivative(cutoff_fn, ds[p], cutoff);
  }
  return {values, derivatives};
}

namespace {

// The reference: float64 from the formulas in docs/ops.md, basis times envelope.
at::Tensor radial_basis_cpu(const at::Tensor& distances, c10::string_view kind, int64_t num,
                            double cutoff, c10::string_view cutoff_fn) {
  const std::vector<int64_t> shape = check_radial_basis(distances, kind, num, cutoff, cutoff_fn);
  const at::Tensor basis = reference_basis(distances, kind, num, cutoff).first;
  const at::Tensor envelope = reference_envelope(distances, cutoff_fn, cutoff).first;
  return (basis * envelope.unsqueeze(1)).reshape(shape).to(distances.scalar_type());
}

at::Tensor radial_basis_meta(const at::Tensor& distances, c10::string_view kind, int64_t num,
                             double cutoff, c10::string_view cutoff_fn) {
  return at::empty(check_radial_basis(distances, kind, num, cutoff, cutoff_fn), distances.options());
}

// The reference backward: float64, per distance the sum over k of grad * (basis_k f)', with the
// analytic derivatives (basis_k f)' = basis_k' f + basis_k f'.
at::Tensor radial_basis_backward_cpu(const at::Tensor& grad, const at::Tensor& distances,
                                     c10::string_view kind, int64_t num, double cutoff,
                                     c10::string_view cutoff_fn) {
  check_radial_basis_backward(grad, distances, kind, num, cutoff, cutoff_fn);
  const auto [b, b_slope] = reference_basis(distances, kind, num, cutoff);
  const auto [e, e_slope] = reference_envelope(distances, cutoff_fn, cutoff);
  const at::Tensor g = grad.to(at::kDouble).reshape({-1, num});
  const at::Tensor out = (g * (b_slope * e.unsqueeze(1) + b * e_slope.unsqueeze(1))).sum(1);
  return out.reshape(distances.sizes()).to(distances.scalar_type());
}

at::Tensor radial_basis_backward_meta(const at::Tensor& grad, const at::Tensor& distances,
                                      c10::string_view kind, int64_t num, double cutoff,
                                      c10::string_view cutoff_fn) {
  check_radial_basis_backward(grad, distances, kind, num, cutoff, cutoff_fn);
  return at::empty(distances.sizes(), distances.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) {
  m.impl("radial_basis", &radial_basis_cpu);
  m.impl("radial_basis_backward", &radial_basis_backward_cpu);
}
TORCH_LIBRARY_IMPL(mirage, Meta, m) {
  m.impl("radial_basis", &radial_basis_meta);
  m.impl("radial_basis_backward", &radial_basis_backward_meta);
}

}  // namespace mirage::ops
