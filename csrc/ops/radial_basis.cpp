// mirage::radial_basis and its backward: checks, CPU references and Meta kernels.
#include "radial_basis.h"

#include <cmath>
#include <utility>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "../../cuda/jets.h"
#include "checks.h"
#include "kinds.h"
#include "message.h"

namespace mirage::ops {

std::vector<int64_t> check_radial_basis(const at::Tensor& distances, std::string_view kind,
                                        int64_t num, double cutoff, std::string_view cutoff_fn,
                                        std::string_view op) {
  check_activation_dtype(op, "distances", distances);
  MIRAGE_CHECK(kind == "gaussian" || kind == "bessel" || kind == "none", op,
               ": kind must be \"gaussian\", \"bessel\" or \"none\", got \"", kind, "\"");
  MIRAGE_CHECK(num > 0, op, ": num must be positive, got ", num);
  check_cutoff(op, cutoff);
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

// float64 references of radial_basis' functions from the jets of cuda/jets.h: the basis without
// envelope and its derivative in d, each [P, num], of the P distances (any shape, flattened); the
// envelope `cutoff_fn` and its derivative, each [P], 0 from the cutoff on (and at NaN d).
std::pair<at::Tensor, at::Tensor> reference_basis(const at::Tensor& distances, std::string_view kind, int64_t num,
                                                  double cutoff) {
  const at::Tensor d64 = distances.to(at::kDouble).contiguous();
  const int64_t count = d64.numel();
  auto [values, derivatives] = allocate_named(kRadialBasis, "num", num, [&] {
    return std::make_pair(at::empty({count, num}, d64.options()), at::empty({count, num}, d64.options()));
  });
  const double* ds = d64.const_data_ptr<double>();
  double* vs = values.mutable_data_ptr<double>();
  double* dvs = derivatives.mutable_data_ptr<double>();
  for (int64_t p = 0; p < count; ++p)
    for (int64_t k = 0; k < num; ++k) {
      const cuda::jets::Jet b =
          cuda::jets::basis_jet(kernel_basis(kind), static_cast<int>(k), static_cast<int>(num), ds[p], cutoff);
      vs[p * num + k] = b.v;
      dvs[p * num + k] = b.d1;
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
  const cuda::CutoffFn fn = kernel_cutoff_fn(cutoff_fn);
  for (int64_t p = 0; p < d64.numel(); ++p) {
    const cuda::jets::Jet e = fn == cuda::CutoffFn::kNone || ds[p] < cutoff
                                  ? cuda::jets::envelope_jet(fn, ds[p], cutoff)
                                  : cuda::jets::Jet{0.0, 0.0, 0.0};
    vs[p] = e.v;
    dvs[p] = e.d1;
  }
  return {values, derivatives};
}

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
  const std::vector<int64_t> shape = check_radial_basis(distances, kind, num, cutoff, cutoff_fn);
  return allocate_named(kRadialBasis, "num", num, [&] { return at::empty(shape, distances.options()); });
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
