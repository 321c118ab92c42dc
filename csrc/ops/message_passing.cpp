// mirage::message_passing and mirage::pair_product: checks, CPU references and Meta kernels.
#include "message_passing.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "message.h"

namespace mirage::ops {
namespace {

void check_2d(std::string_view op, std::string_view arg, const at::Tensor& t, const char* dims) {
  MIRAGE_CHECK(t.dim() == 2, op, ": ", arg, " must be 2-D ", dims, ", got shape ", t.sizes());
}

// `other` on the device of `ref` (x or a: the first tensor argument).
void check_device(std::string_view op, std::string_view arg, const at::Tensor& other,
                  std::string_view ref_name, const at::Tensor& ref) {
  MIRAGE_CHECK(other.device() == ref.device(), op, ": ", arg, " must be on ", ref_name, "'s device (",
               ref.device(), "), got ", other.device());
}

// pairs: [2, P] int64 on x's device; x has rows for them to index (N == 0 only without pairs).
void check_pairs(std::string_view op, std::string_view x_name, const at::Tensor& pairs,
                 const at::Tensor& x) {
  check_device(op, "pairs", pairs, x_name, x);
  MIRAGE_CHECK(pairs.scalar_type() == at::kLong, op, ": pairs must be int64, got ",
               pairs.scalar_type());
  MIRAGE_CHECK(pairs.dim() == 2 && pairs.size(0) == 2, op, ": pairs must have shape [2, P], got ",
               pairs.sizes());
  MIRAGE_CHECK(x.size(0) > 0 || pairs.size(1) == 0, op, ": ", x_name,
               " has no rows (N=0) for pairs to index (P=", pairs.size(1), ")");
}

}  // namespace

std::vector<int64_t> check_message_passing(const at::Tensor& x, const at::Tensor& filter,
                                           const at::Tensor& pairs) {
  check_activation_dtype(kMessagePassing, "x", x);
  check_device(kMessagePassing, "filter", filter, "x", x);
  MIRAGE_CHECK(filter.scalar_type() == x.scalar_type(), kMessagePassing,
               ": filter must have x's dtype (", x.scalar_type(), "), got ", filter.scalar_type());
  check_2d(kMessagePassing, "x", x, "[N, F]");
  check_2d(kMessagePassing, "filter", filter, "[P, F]");
  check_pairs(kMessagePassing, "x", pairs, x);
  MIRAGE_CHECK(filter.size(0) == pairs.size(1) && filter.size(1) == x.size(1), kMessagePassing,
               ": filter must have shape [P, F] = [", pairs.size(1), ", ", x.size(1),
               "] (P from pairs, F from x), got ", filter.sizes());
  return {x.size(0), x.size(1)};
}

std::vector<int64_t> check_pair_product(const at::Tensor& a, const at::Tensor& b,
                                        const at::Tensor& pairs) {
  check_activation_dtype(kPairProduct, "a", a);
  check_device(kPairProduct, "b", b, "a", a);
  MIRAGE_CHECK(b.scalar_type() == a.scalar_type(), kPairProduct, ": b must have a's dtype (",
               a.scalar_type(), "), got ", b.scalar_type());
  check_2d(kPairProduct, "a", a, "[N, F]");
  MIRAGE_CHECK(b.sizes() == a.sizes(), kPairProduct, ": b must have a's shape ", a.sizes(),
               ", got ", b.sizes());
  check_pairs(kPairProduct, "a", pairs, a);
  return {pairs.size(1), a.size(1)};
}

namespace {

// The references: float64, pair by pair, straight from the definitions.
at::Tensor message_passing_cpu(const at::Tensor& x, const at::Tensor& filter,
                               const at::Tensor& pairs) {
  const std::vector<int64_t> shape = check_message_passing(x, filter, pairs);
  const at::Tensor idx = pairs.contiguous();
  const int64_t num_nodes = shape[0], features = shape[1], num_pairs = idx.size(1);
  check_pair_indices(kMessagePassing, idx, num_nodes);
  const at::Tensor x64 = x.to(at::kDouble).contiguous();
  const at::Tensor w64 = filter.to(at::kDouble).contiguous();
  at::Tensor out64 = at::zeros(shape, x64.options());
  const double* xs = x64.const_data_ptr<double>();
  const double* ws = w64.const_data_ptr<double>();
  const int64_t* is = idx.const_data_ptr<int64_t>();
  double* os = out64.mutable_data_ptr<double>();
  for (int64_t p = 0; p < num_pairs; ++p) {
    const int64_t i = is[p], j = is[num_pairs + p];
    for (int64_t f = 0; f < features; ++f) os[i * features + f] += xs[j * features + f] * ws[p * features + f];
  }
  return out64.to(x.scalar_type());
}

at::Tensor pair_product_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& pairs) {
  const std::vector<int64_t> shape = check_pair_product(a, b, pairs);
  const at::Tensor idx = pairs.contiguous();
  const int64_t num_pairs = shape[0], features = shape[1];
  check_pair_indices(kPairProduct, idx, a.size(0));
  const at::Tensor a64 = a.to(at::kDouble).contiguous();
  const at::Tensor b64 = b.to(at::kDouble).contiguous();
  at::Tensor out64 = at::empty(shape, a64.options());
  const double* as = a64.const_data_ptr<double>();
  const double* bs = b64.const_data_ptr<double>();
  const int64_t* is = idx.const_data_ptr<int64_t>();
  double* os = out64.mutable_data_ptr<double>();
  for (int64_t p = 0; p < num_pairs; ++p) {
    const int64_t i = is[p], j = is[num_pairs + p];
    for (int64_t f = 0; f < features; ++f) os[p * features + f] = as[i * features + f] * bs[j * features + f];
  }
  return out64.to(a.scalar_type());
}

at::Tensor message_passing_meta(const at::Tensor& x, const at::Tensor& filter,
                                const at::Tensor& pairs) {
  return at::empty(check_message_passing(x, filter, pairs), x.options());
}

at::Tensor pair_product_meta(const at::Tensor& a, const at::Tensor& b, const at::Tensor& pairs) {
  return at::empty(check_pair_product(a, b, pairs), a.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) {
  m.impl("message_passing", &message_passing_cpu);
  m.impl("pair_product", &pair_product_cpu);
}
TORCH_LIBRARY_IMPL(mirage, Meta, m) {
  m.impl("message_passing", &message_passing_meta);
  m.impl("pair_product", &pair_product_meta);
}

}  // namespace mirage::ops
