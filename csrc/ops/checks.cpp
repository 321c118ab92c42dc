#include "checks.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include "message.h"

namespace mirage::ops {

void check_cutoff(std::string_view op, double cutoff) {
  MIRAGE_CHECK(cutoff >= std::numeric_limits<float>::min() && finite_as_float32(cutoff), op,
               ": cutoff must be finite and > 0, in float32's normal range (1.2e-38 to 3.4e38), got ", cutoff);
}

void check_activation_dtype(std::string_view op, std::string_view arg, const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  const bool supported = dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 ||
                         (dtype == at::kDouble && !t.is_cuda());
  MIRAGE_CHECK(supported, op, ": ", arg,
              " must be float32, float16 or bfloat16 (float64 off the GPU), got ", dtype, " on ",
              t.device());
}

void check_like(std::string_view op, std::string_view arg, const at::Tensor& t, std::string_view owner,
                const at::Tensor& ref, std::string_view expected, at::IntArrayRef want) {
  MIRAGE_CHECK(t.device() == ref.device(), op, ": ", arg, " must be on ", owner, " device (", ref.device(),
               "), got ", t.device());
  MIRAGE_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", arg, " must have ", owner, " dtype (",
               ref.scalar_type(), "), got ", t.scalar_type());
  MIRAGE_CHECK(t.sizes() == want, op, ": ", arg, " must have shape ", expected, " = ", want, ", got ",
               t.sizes());
}

void check_same_device(std::string_view op, std::string_view arg, const at::Tensor& other,
                       const at::Tensor& x) {
  MIRAGE_CHECK(other.device() == x.device(), op, ": ", arg, " must be on the same device as x (x on ",
              x.device(), ", ", arg, " on ", other.device(), ")");
}

void check_param(std::string_view op, std::string_view arg, const std::optional<at::Tensor>& p,
                 const at::Tensor& x, const c10::SymInt& size) {
  if (!present(p)) return;
  check_same_device(op, arg, *p, x);
  MIRAGE_CHECK(p->dim() == 1 && p->sym_size(0) == size, op, ": ", arg, " must have shape [", size,
              "], got ", p->sym_sizes());
  MIRAGE_CHECK(p->scalar_type() == x.scalar_type() || p->scalar_type() == at::kFloat, op, ": ", arg,
              " must have x's dtype (", x.scalar_type(), ") or float32, got ", p->scalar_type());
}

at::ScalarType param_dtype(std::string_view op, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, const at::Tensor& x) {
  const bool has_weight = present(weight);
  const bool has_bias = present(bias);
  if (has_weight && has_bias) {
    MIRAGE_CHECK(weight->scalar_type() == bias->scalar_type(), op,
                ": weight and bias must have the same dtype, got ", weight->scalar_type(), " and ",
                bias->scalar_type());
  }
  if (has_weight) return weight->scalar_type();
  if (has_bias) return bias->scalar_type();
  return x.scalar_type();
}

at::MemoryFormat channels_layout(const at::Tensor& x) {
  if (x.dim() != 4 && x.dim() != 5) return at::MemoryFormat::Contiguous;
  const c10::SymIntArrayRef sizes = x.sym_sizes();
  if (std::all_of(sizes.begin(), sizes.end(), [](const c10::SymInt& n) { return n.has_hint(); }))
    return x.suggest_memory_format();
  // An unbacked size (a data-dependent batch under torch.compile) allows no guard, which
  // suggest_memory_format would add: channels-last where the strides are certainly a dense
  // channels-last tensor's, else contiguous.
  const at::MemoryFormat last = x.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d;
  return x.is_contiguous_or_false(last) ? last : at::MemoryFormat::Contiguous;
}

at::Tensor empty_in_channels_layout(const at::Tensor& x, at::MemoryFormat layout) {
  return at::empty_symint(x.sym_sizes(), x.options().memory_format(layout));
}

ChannelsShape channels_shape(const at::Tensor& x) {
  return {x.size(0), x.size(1), x.dim() == 2 ? 1 : c10::multiply_integers(x.sizes().slice(2)),
          channels_layout(x)};
}

at::Tensor contiguous_or_undefined(const std::optional<at::Tensor>& p) {
  return present(p) ? p->contiguous() : at::Tensor();
}

void check_pair_indices(std::string_view op, const at::Tensor& pairs, int64_t num_nodes) {
  const int64_t num_pairs = pairs.size(1);
  const int64_t* idx = pairs.const_data_ptr<int64_t>();
  for (int64_t row = 0; row < 2; ++row)
    for (int64_t p = 0; p < num_pairs; ++p) {
      const int64_t v = idx[row * num_pairs + p];
      MIRAGE_CHECK(v >= 0 && v < num_nodes, op, ": pairs[", row, ", ", p, "] = ", v,
                   " is out of range for N=", num_nodes, " rows");
    }
}

namespace {

// The bytes a tensor's elements span, first to one past the last (strides are never negative).
std::pair<const char*, const char*> byte_span(const at::Tensor& t) {
  const char* first = static_cast<const char*>(t.const_data_ptr());
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {first, first + (last + 1) * static_cast<int64_t>(t.element_size())};
}

}  // namespace

void check_apart(std::string_view op, std::initializer_list<Named> written, std::initializer_list<Named> read) {
  const auto has_memory = [](const at::Tensor& t) {
    return !t.is_meta() && !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
  };
  for (auto w = written.begin(); w != written.end(); ++w) {
    auto check = [&](const Named& other) {
      const at::Tensor &a = *w->second, &b = *other.second;
      if (!has_memory(a) || !has_memory(b)) return;
      at::MemOverlapStatus status = at::get_overlap_status(a, b);
      if (status == at::MemOverlapStatus::TooHard) {
        const auto [a0, a1] = byte_span(a);
        const auto [b0, b1] = byte_span(b);
        status = a0 < b1 && b0 < a1 ? at::MemOverlapStatus::Partial : at::MemOverlapStatus::No;
      }
      MIRAGE_CHECK(status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial, op, ": ",
                   w->first, " (updated in place) must not share memory with ", other.first);
    };
    std::for_each(w + 1, written.end(), check);
    std::for_each(read.begin(), read.end(), check);
  }
}

}  // namespace mirage::ops
