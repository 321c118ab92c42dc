// mirage::pair_vectors and its backward: checks, CPU references and Meta kernels.
#include "pair_vectors.h"

#include <cmath>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "message.h"
#include "pair_order.h"

namespace mirage::ops {
PairVectorsShape check_pair_vectors(std::string_view op, const at::Tensor& positions, const at::Tensor& pairs,
                                    const std::optional<at::Tensor>& shifts,
                                    const std::optional<at::Tensor>& sender_order) {
  const auto dtype = positions.scalar_type();
  MIRAGE_CHECK(dtype == at::kFloat || (dtype == at::kDouble && !positions.is_cuda()), op,
               ": positions must be float32 (float64 off the GPU), got ", dtype, " on ", positions.device());
  MIRAGE_CHECK(positions.dim() == 2 && positions.size(1) == 3, op, ": positions must be [N, 3], got ",
               positions.sizes());
  MIRAGE_CHECK(pairs.device() == positions.device(), op, ": pairs must be on positions' device (",
               positions.device(), "), got ", pairs.device());
  MIRAGE_CHECK(pairs.scalar_type() == at::kLong, op, ": pairs must be int64, got ", pairs.scalar_type());
  MIRAGE_CHECK(pairs.dim() == 2 && pairs.size(0) == 2, op, ": pairs must be [2, P], got ", pairs.sizes());
  const PairVectorsShape shape{positions.size(0), pairs.size(1)};
  if (present(shifts)) check_like(op, "shifts", *shifts, "positions'", positions, "[P, 3]", {shape.pairs, 3});
  check_sender_order(op, sender_order, pairs);
  return shape;
}

PairVectorsShape check_pair_vectors_backward(const std::optional<at::Tensor>& grad_vectors,
                                             const std::optional<at::Tensor>& grad_distances,
                                             const at::Tensor& positions, const at::Tensor& pairs,
                                             const std::optional<at::Tensor>& shifts,
                                             const std::optional<at::Tensor>& sender_order) {
  constexpr std::string_view op = kPairVectorsBackward;
  const PairVectorsShape shape = check_pair_vectors(op, positions, pairs, shifts, sender_order);
  if (present(grad_vectors))
    check_like(op, "grad_vectors", *grad_vectors, "positions'", positions, "[P, 3]", {shape.pairs, 3});
  if (present(grad_distances))
    check_like(op, "grad_distances", *grad_distances, "positions'", positions, "[P]", {shape.pairs});
  return shape;
}

namespace {

at::Tensor as_double(const at::Tensor& t) { return t.to(at::kDouble).contiguous(); }

// Pair p's vector in float64 from the (checked) indices.
struct Geometry {
  const double* positions;
  const int64_t* pairs;
  const double* shifts;  // or null
  int64_t P;

  void vector(int64_t p, double (&v)[3]) const {
    const int64_t i = pairs[p], j = pairs[P + p];
    for (int c = 0; c < 3; ++c) v[c] = positions[3 * j + c] - positions[3 * i + c] + (shifts ? shifts[3 * p + c] : 0.0);
  }
};

// The references: float64, pair by pair, straight from the formulas in cuda/pair_vectors.cuh.
std::tuple<at::Tensor, at::Tensor> pair_vectors_cpu(const at::Tensor& positions, const at::Tensor& pairs,
                                                    const std::optional<at::Tensor>& shifts,
                                                    const std::optional<at::Tensor>& sender_order) {
  const auto [N, P] = check_pair_vectors(kPairVectors, positions, pairs, shifts, sender_order);
  const at::Tensor idx = pairs.contiguous();
  check_pair_indices(kPairVectors, idx, N);
  const at::Tensor pos64 = as_double(positions);
  const at::Tensor shifts64 = present(shifts) ? as_double(*shifts) : at::Tensor();
  const Geometry geometry{pos64.const_data_ptr<double>(), idx.const_data_ptr<int64_t>(),
                          shifts64.defined() ? shifts64.const_data_ptr<double>() : nullptr, P};
  at::Tensor vectors = at::empty({P, 3}, pos64.options()), distances = at::empty({P}, pos64.options());
  double *vs = vectors.mutable_data_ptr<double>(), *ds = distances.mutable_data_ptr<double>();
  for (int64_t p = 0; p < P; ++p) {
    double v[3];
    geometry.vector(p, v);
    for (int c = 0; c < 3; ++c) vs[3 * p + c] = v[c];
    ds[p] = std::sqrt(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
  }
  return {vectors.to(positions.scalar_type()), distances.to(positions.scalar_type())};
}

at::Tensor pair_vectors_backward_cpu(const std::optional<at::Tensor>& grad_vectors,
                                     const std::optional<at::Tensor>& grad_distances,
                                     const at::Tensor& positions, const at::Tensor& pairs,
                                     const std::optional<at::Tensor>& shifts,
                                     const std::optional<at::Tensor>& sender_order) {
  const auto [N, P] = check_pair_vectors_backward(grad_vectors, grad_distances, positions, pairs, shifts,
                                                  sender_order);
  const at::Tensor idx = pairs.contiguous();
  check_pair_indices(kPairVectorsBackward, idx, N);
  const at::Tensor pos64 = as_double(positions);
  const at::Tensor gv64 = present(grad_vectors) ? as_double(*grad_vectors) : at::Tensor();
  const at::Tensor gd64 = present(grad_distances) ? as_double(*grad_distances) : at::Tensor();
  const at::Tensor shifts64 = present(shifts) ? as_double(*shifts) : at::Tensor();
  const Geometry geometry{pos64.const_data_ptr<double>(), idx.const_data_ptr<int64_t>(),
                          shifts64.defined() ? shifts64.const_data_ptr<double>() : nullptr, P};
  at::Tensor grad = at::zeros({N, 3}, pos64.options());
  double* out = grad.mutable_data_ptr<double>();
  const double* gv = gv64.defined() ? gv64.const_data_ptr<double>() : nullptr;
  const double* gd = gd64.defined() ? gd64.const_data_ptr<double>() : nullptr;
  const int64_t* ij = idx.const_data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) {
    double v[3];
    geometry.vector(p, v);
    const double d = std::sqrt(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
    const double radial = gd != nullptr && d != 0 ? gd[p] / d : 0.0;
    for (int c = 0; c < 3; ++c) {
      // A missing gradient adds nothing (NaN vectors pass NaN on only through the distances').
      const double g = (gv != nullptr ? gv[3 * p + c] : 0.0) + (gd != nullptr ? radial * v[c] : 0.0);
      out[3 * ij[P + p] + c] += g;
      out[3 * ij[p] + c] -= g;
    }
  }
  return grad.to(positions.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> pair_vectors_meta(const at::Tensor& positions, const at::Tensor& pairs,
                                                     const std::optional<at::Tensor>& shifts,
                                                    const std::optional<at::Tensor>& sender_order) {
  const auto [N, P] = check_pair_vectors(kPairVectors, positions, pairs, shifts, sender_order);
  return {at::empty({P, 3}, positions.options()), at::empty({P}, positions.options())};
}

at::Tensor pair_vectors_backward_meta(const std::optional<at::Tensor>& grad_vectors,
                                      const std::optional<at::Tensor>& grad_distances,
                                      const at::Tensor& positions, const at::Tensor& pairs,
                                      const std::optional<at::Tensor>& shifts,
                                      const std::optional<at::Tensor>& sender_order) {
  check_pair_vectors_backward(grad_vectors, grad_distances, positions, pairs, shifts, sender_order);
  return at::empty_like(positions, at::MemoryFormat::Contiguous);
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) {
  m.impl("pair_vectors", &pair_vectors_cpu);
  m.impl("pair_vectors_backward", &pair_vectors_backward_cpu);
}
TORCH_LIBRARY_IMPL(mirage, Meta, m) {
  m.impl("pair_vectors", &pair_vectors_meta);
  m.impl("pair_vectors_backward", &pair_vectors_backward_meta);
}

}  // namespace mirage::ops
