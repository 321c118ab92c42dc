// mirage::vector_message_passing and its backward: checks, CPU references and Meta kernels.
#include "vector_message_passing.h"

#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "message.h"
#include "pair_order.h"

namespace mirage::ops {

std::tuple<at::Tensor, at::Tensor> empty_vector_message_passing_outputs(
    const VectorMessagePassingShape& s, const at::TensorOptions& options) {
  return {at::empty({s.nodes, s.features}, options), at::empty({s.nodes, 3, s.features}, options)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> empty_vector_message_passing_gradients(
    const VectorMessagePassingShape& s, const at::TensorOptions& options) {
  return {at::empty({s.nodes, 3 * s.features}, options),
          at::empty({s.pairs, s.width}, options),
          at::empty({s.nodes, 3, s.features}, options),
          at::empty({s.pairs, 3}, options)};
}

namespace {

void check_floating(std::string_view op, std::string_view arg, const at::Tensor& t,
                    const at::Tensor& x) {
  check_same_device(op, arg, t, x);
  MIRAGE_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", arg, " must have x's dtype (",
               x.scalar_type(), "), got ", t.scalar_type());
}

void check_shape(std::string_view op, std::string_view arg, const at::Tensor& t,
                 std::string_view expected, at::IntArrayRef want) {
  MIRAGE_CHECK(t.sizes() == want, op, ": ", arg, " must have shape ", expected, " = ", want,
               ", got ", t.sizes());
}

}  // namespace

VectorMessagePassingShape check_vector_message_passing(std::string_view op, const at::Tensor& x,
                                                       const at::Tensor& filter,
                                                       const at::Tensor& vectors,
                                                       const at::Tensor& directions,
                                                       const at::Tensor& pairs,
                                                       const std::optional<at::Tensor>& filter_weight,
                                                       const std::optional<at::Tensor>& sender_order,
                                                       const std::optional<at::Tensor>& num_pairs) {
  check_activation_dtype(op, "x", x);
  MIRAGE_CHECK(x.dim() == 2 && x.size(1) % 3 == 0, op,
               ": x must be [N, 3F] (a last dimension divisible by 3), got ", x.sizes());
  check_same_device(op, "pairs", pairs, x);
  MIRAGE_CHECK(pairs.scalar_type() == at::kLong, op, ": pairs must be int64, got ",
               pairs.scalar_type());
  MIRAGE_CHECK(pairs.dim() == 2 && pairs.size(0) == 2, op, ": pairs must be [2, P], got ",
               pairs.sizes());
  const int64_t features = x.size(1) / 3;
  const VectorMessagePassingShape s{x.size(0), pairs.size(1), features,
                                    present(filter_weight) && filter_weight->dim() == 2 ? filter_weight->size(1)
                                                                                        : 3 * features};
  check_floating(op, "vectors", vectors, x);
  check_shape(op, "vectors", vectors, "[N, 3, F]", {s.nodes, 3, s.features});
  check_floating(op, "filter", filter, x);
  if (present(filter_weight)) {
    check_floating(op, "filter_weight", *filter_weight, x);
    MIRAGE_CHECK(filter_weight->dim() == 2 && filter_weight->size(0) == 3 * s.features && filter_weight->size(1) >= 1,
                 op, ": filter_weight must be [3F, K] = [", 3 * s.features, ", K] with K >= 1, got ",
                 filter_weight->sizes());
    check_shape(op, "filter (the basis, with filter_weight)", filter, "[P, K]", {s.pairs, filter_weight->size(1)});
  } else {
    check_shape(op, "filter", filter, "[P, 3F]", {s.pairs, 3 * s.features});
  }
  check_floating(op, "directions", directions, x);
  check_shape(op, "directions", directions, "[P, 3]", {s.pairs, 3});
  check_pair_count(op, num_pairs, pairs);
  check_sender_order(op, sender_order, pairs, num_pairs);
  return s;
}

VectorMessagePassingShape check_vector_message_passing_backward(
    const at::Tensor& grad_scalar, const at::Tensor& grad_vector, const at::Tensor& x,
    const at::Tensor& filter, const at::Tensor& vectors, const at::Tensor& directions,
    const at::Tensor& pairs, const std::optional<at::Tensor>& filter_weight,
    const std::optional<at::Tensor>& sender_order, const std::optional<at::Tensor>& num_pairs) {
  constexpr std::string_view op = kVectorMessagePassingBackward;
  const VectorMessagePassingShape s = check_vector_message_passing(op, x, filter, vectors, directions, pairs,
                                                                   filter_weight, sender_order, num_pairs);
  check_floating(op, "grad_scalar", grad_scalar, x);
  check_shape(op, "grad_scalar", grad_scalar, "[N, F]", {s.nodes, s.features});
  check_floating(op, "grad_vector", grad_vector, x);
  check_shape(op, "grad_vector", grad_vector, "[N, 3, F]", {s.nodes, 3, s.features});
  return s;
}

at::Tensor formed_filter(const at::Tensor& filter, const std::optional<at::Tensor>& filter_weight) {
  return present(filter_weight) ? at::matmul(filter, filter_weight->t()) : filter;
}

namespace {

at::Tensor as_double(const at::Tensor& t) { return t.to(at::kDouble).contiguous(); }

// The filter in float64 for the references (formed in float64 from a basis).
at::Tensor filter_as_double(const at::Tensor& filter, const std::optional<at::Tensor>& filter_weight) {
  return formed_filter(as_double(filter), present(filter_weight)
                                              ? std::optional<at::Tensor>(as_double(*filter_weight))
                                              : std::nullopt).contiguous();
}

// The pair indices, each checked against [0, N): the CPU reads them anyway.
std::vector<std::pair<int64_t, int64_t>> read_pairs(std::string_view op, const at::Tensor& pairs,
                                                    int64_t nodes) {
  const at::Tensor contiguous = pairs.contiguous();
  const int64_t* idx = contiguous.const_data_ptr<int64_t>();
  const int64_t count = pairs.size(1);
  std::vector<std::pair<int64_t, int64_t>> out(count);
  for (int64_t p = 0; p < count; ++p) {
    for (int64_t row = 0; row < 2; ++row) {
      const int64_t v = idx[row * count + p];
      MIRAGE_CHECK(v >= 0 && v < nodes, op, ": pairs must index nodes in [0, N) (N=", nodes,
                   "), got pairs[", row, ", ", p, "] = ", v);
    }
    out[p] = {idx[p], idx[count + p]};
  }
  return out;
}

// The reference: float64, pair by pair, straight from the formulas in docs/ops.md.
std::tuple<at::Tensor, at::Tensor> vector_message_passing_cpu(const at::Tensor& x,
                                                              const at::Tensor& filter,
                                                              const at::Tensor& vectors,
                                                              const at::Tensor& directions,
                                                              const at::Tensor& pairs,
                                                              const std::optional<at::Tensor>& filter_weight,
                                                              const std::optional<at::Tensor>& sender_order,
                                                              const std::optional<at::Tensor>& num_pairs) {
  const auto s = check_vector_message_passing(kVectorMessagePassing, x, filter, vectors, directions, pairs,
                                              filter_weight, sender_order, num_pairs);
  const int64_t walked = walked_pairs_on_cpu(num_pairs, s.pairs);  // the rest is padding: skipped
  const auto ij = read_pairs(kVectorMessagePassing, pairs.narrow(1, 0, walked), s.nodes);
  const at::Tensor x64 = as_double(x), f64 = filter_as_double(filter, filter_weight), v64 = as_double(vectors),
                   d64 = as_double(directions);
  auto [scalar, vector] = empty_vector_message_passing_outputs(s, x64.options());
  scalar.zero_();
  vector.zero_();
  const double *xs = x64.const_data_ptr<double>(), *fs = f64.const_data_ptr<double>(),
               *vs = v64.const_data_ptr<double>(), *ds = d64.const_data_ptr<double>();
  double* out_s = scalar.mutable_data_ptr<double>();
  double* out_v = vector.mutable_data_ptr<double>();
  const int64_t F = s.features;
  for (int64_t p = 0; p < walked; ++p) {
    const auto [i, j] = ij[p];
    const double* xj = xs + j * 3 * F;
    const double* fp = fs + p * 3 * F;
    for (int64_t f = 0; f < F; ++f) {
      out_s[i * F + f] += xj[f] * fp[f];
      const double m_vv = xj[F + f] * fp[F + f], m_vs = xj[2 * F + f] * fp[2 * F + f];
      for (int64_t c = 0; c < 3; ++c)
        out_v[(i * 3 + c) * F + f] += vs[(j * 3 + c) * F + f] * m_vv + m_vs * ds[p * 3 + c];
    }
  }
  return {scalar.to(x.scalar_type()), vector.to(x.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> vector_message_passing_backward_cpu(
    const at::Tensor& grad_scalar, const at::Tensor& grad_vector, const at::Tensor& x,
    const at::Tensor& filter, const at::Tensor& vectors, const at::Tensor& directions,
    const at::Tensor& pairs, const std::optional<at::Tensor>& filter_weight,
    const std::optional<at::Tensor>& sender_order, const std::optional<at::Tensor>& num_pairs) {
  const auto s = check_vector_message_passing_backward(grad_scalar, grad_vector, x, filter, vectors,
                                                       directions, pairs, filter_weight, sender_order, num_pairs);
  const int64_t walked = walked_pairs_on_cpu(num_pairs, s.pairs);  // the rest is padding: zero gradients
  const auto ij = read_pairs(kVectorMessagePassingBackward, pairs.narrow(1, 0, walked), s.nodes);
  const at::Tensor gs64 = as_double(grad_scalar), gv64 = as_double(grad_vector), x64 = as_double(x),
                   f64 = filter_as_double(filter, filter_weight), v64 = as_double(vectors),
                   d64 = as_double(directions);
  // The formed filter's gradient [P, 3F]; with filter_weight the basis' is its product with the weight.
  const auto options = x64.options();
  at::Tensor grad_x = at::zeros({s.nodes, 3 * s.features}, options);
  at::Tensor grad_filter = at::zeros({s.pairs, 3 * s.features}, options);
  at::Tensor grad_vectors = at::zeros({s.nodes, 3, s.features}, options);
  at::Tensor grad_directions = at::zeros({s.pairs, 3}, options);
  const double *gs = gs64.const_data_ptr<double>(), *gv = gv64.const_data_ptr<double>(),
               *xs = x64.const_data_ptr<double>(), *fs = f64.const_data_ptr<double>(),
               *vs = v64.const_data_ptr<double>(), *ds = d64.const_data_ptr<double>();
  double *gx = grad_x.mutable_data_ptr<double>(), *gf = grad_filter.mutable_data_ptr<double>(),
         *gvec = grad_vectors.mutable_data_ptr<double>(),
         *gd = grad_directions.mutable_data_ptr<double>();
  const int64_t F = s.features;
  for (int64_t p = 0; p < walked; ++p) {
    const auto [i, j] = ij[p];
    const double* xj = xs + j * 3 * F;
    const double* fp = fs + p * 3 * F;
    const double* d = ds + p * 3;
    for (int64_t f = 0; f < F; ++f) {
      // Gradients of the message parts m_s, m_vv, m_vs of pair p.
      const double g_s = gs[i * F + f];
      double g_vv = 0, g_vs = 0;
      for (int64_t c = 0; c < 3; ++c) {
        g_vv += gv[(i * 3 + c) * F + f] * vs[(j * 3 + c) * F + f];
        g_vs += gv[(i * 3 + c) * F + f] * d[c];
      }
      const double g_m[3] = {g_s, g_vv, g_vs};
      for (int64_t k = 0; k < 3; ++k) {
        gf[p * 3 * F + k * F + f] = g_m[k] * xj[k * F + f];
        gx[j * 3 * F + k * F + f] += g_m[k] * fp[k * F + f];
      }
      const double m_vv = xj[F + f] * fp[F + f], m_vs = xj[2 * F + f] * fp[2 * F + f];
      for (int64_t c = 0; c < 3; ++c) {
        gvec[(j * 3 + c) * F + f] += gv[(i * 3 + c) * F + f] * m_vv;
        gd[p * 3 + c] += gv[(i * 3 + c) * F + f] * m_vs;
      }
    }
  }
  const auto dtype = x.scalar_type();
  if (present(filter_weight)) grad_filter = grad_filter.matmul(as_double(*filter_weight));
  return {grad_x.to(dtype), grad_filter.to(dtype), grad_vectors.to(dtype), grad_directions.to(dtype)};
}

std::tuple<at::Tensor, at::Tensor> vector_message_passing_meta(const at::Tensor& x,
                                                               const at::Tensor& filter,
                                                               const at::Tensor& vectors,
                                                               const at::Tensor& directions,
                                                               const at::Tensor& pairs,
                                                               const std::optional<at::Tensor>& filter_weight,
                                                              const std::optional<at::Tensor>& sender_order,
                                                              const std::optional<at::Tensor>& num_pairs) {
  const auto s = check_vector_message_passing(kVectorMessagePassing, x, filter, vectors, directions, pairs,
                                              filter_weight, sender_order, num_pairs);
  return empty_vector_message_passing_outputs(s, x.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> vector_message_passing_backward_meta(
    const at::Tensor& grad_scalar, const at::Tensor& grad_vector, const at::Tensor& x,
    const at::Tensor& filter, const at::Tensor& vectors, const at::Tensor& directions,
    const at::Tensor& pairs, const std::optional<at::Tensor>& filter_weight,
    const std::optional<at::Tensor>& sender_order, const std::optional<at::Tensor>& num_pairs) {
  const auto s = check_vector_message_passing_backward(grad_scalar, grad_vector, x, filter, vectors,
                                                       directions, pairs, filter_weight, sender_order, num_pairs);
  return empty_vector_message_passing_gradients(s, x.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) {
  m.impl("vector_message_passing", &vector_message_passing_cpu);
  m.impl("vector_message_passing_backward", &vector_message_passing_backward_cpu);
}
TORCH_LIBRARY_IMPL(mirage, Meta, m) {
  m.impl("vector_message_passing", &vector_message_passing_meta);
  m.impl("vector_message_passing_backward", &vector_message_passing_backward_meta);
}

}  // namespace mirage::ops
