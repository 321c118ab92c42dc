// Autocast policy. mirage's norms and GEGLU keep their statistics and arithmetic in float32
// whatever their I/O dtype, so under autocast they run in the autocast dtype: activations (x,
// residual) are cast to it, weight and bias in it or in float32 are read as they are (others are
// read in float32). This differs from
// PyTorch's policy for its own norms (run in float32), which would double their memory traffic
// for no accuracy gain here.
// The force-field ops (neighbor_list, pair_vectors, radial_basis) run in float32 under autocast, as PyTorch's
// own float32-list ops do: coordinates and distances need float32's precision (a bfloat16
// distance of 5 A is off by up to 0.02 A), and what follows them casts for itself. float64 input
// (on the CPU) is left alone.
// cfconv and radial_cfconv run in float32 too: their filter networks are float32-accurate already
// (tensor-core products, a table built in float64; the CUDA kernels take float32 alone), and a
// bfloat16 filter would cost the forces accuracy for no speed; the atom-wise Linears around them
// still run in the autocast dtype.
// message_passing and pair_product run in the autocast dtype, like a matmul: x and filter (a and
// b) are cast to it, and the kernels accumulate in float32 whatever the dtype.
#include <initializer_list>
#include <optional>
#include <utility>

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "op_handles.h"
#include "ops/checks.h"

namespace mirage::autocast {
namespace {

using at::autocast::cached_cast;
using ops::present;

// The norms and bias_act take a weight or bias in x's dtype (after autocast's cast: float64 stays
// float64) or float32; another one (say float16 under bfloat16 autocast) is read in float32,
// where PyTorch's composite would promote it.
std::optional<at::Tensor> weight_for(at::ScalarType dtype, const std::optional<at::Tensor>& weight) {
  if (present(weight) && weight->is_floating_point() && weight->scalar_type() != dtype &&
      weight->scalar_type() != at::kFloat)
    return weight->to(at::kFloat);
  return weight;
}

// Autocast casts floating operands to its dtype but leaves float64 as it is, so float64 beside
// another floating dtype reaches the op in two dtypes, and the op's dtype check would name one the
// caller never passed (a float32 residual "got BFloat16" beside a float64 x). This says what
// autocast did instead. Absent (undefined) and non-floating operands are skipped.
void check_cast_together(const char* op, at::ScalarType dtype,
                         std::initializer_list<std::pair<const char*, at::Tensor>> operands) {
  const std::pair<const char*, at::Tensor>*wide = nullptr, *narrow = nullptr;
  for (const auto& operand : operands) {
    if (!operand.second.defined() || !operand.second.is_floating_point()) continue;
    auto& first = operand.second.scalar_type() == at::kDouble ? wide : narrow;  // the first of each kind
    if (first == nullptr) first = &operand;
  }
  TORCH_CHECK(wide == nullptr || narrow == nullptr, "mirage::", op, ": under autocast, ", wide->first,
              " is float64, which autocast leaves as it is, but ", narrow->first, " is ",
              narrow->second.scalar_type(), ", which it casts to ", dtype,
              "; pass them in one dtype, or call the op outside autocast");
}

template <c10::DeviceType Device, c10::DispatchKey Key>
at::Tensor group_norm_autocast(const at::Tensor& x, int64_t num_groups,
                               const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps,
                               c10::string_view activation) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = at::autocast::get_autocast_dtype(Device);
  const at::Tensor cast_x = cached_cast(dtype, x, Device);  // float64 stays float64
  return handles::group_norm().call(cast_x, num_groups, weight_for(cast_x.scalar_type(), weight),
                                    weight_for(cast_x.scalar_type(), bias), eps, activation);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
at::Tensor layer_norm_autocast(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = at::autocast::get_autocast_dtype(Device);
  const at::Tensor cast_x = cached_cast(dtype, x, Device);
  return handles::layer_norm().call(cast_x, weight_for(cast_x.scalar_type(), weight),
                                    weight_for(cast_x.scalar_type(), bias), eps);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
std::tuple<at::Tensor, at::Tensor> add_layer_norm_autocast(
    const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = at::autocast::get_autocast_dtype(Device);
  check_cast_together("add_layer_norm", dtype, {{"x", x}, {"residual", residual}});
  const at::Tensor cast_x = cached_cast(dtype, x, Device);
  return handles::add_layer_norm().call(cast_x, cached_cast(dtype, residual, Device),
                                        weight_for(cast_x.scalar_type(), weight),
                                        weight_for(cast_x.scalar_type(), bias), eps);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
at::Tensor geglu_autocast(const at::Tensor& x, c10::string_view approximate) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = at::autocast::get_autocast_dtype(Device);
  return handles::geglu().call(cached_cast(dtype, x, Device), approximate);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
at::Tensor bias_act_autocast(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& residual, c10::string_view activation,
                             double scale) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = at::autocast::get_autocast_dtype(Device);
  check_cast_together("bias_act", dtype, {{"x", x}, {"residual", residual.value_or(at::Tensor())}});
  const std::optional<at::Tensor> cast_residual =
      present(residual) ? std::optional<at::Tensor>(cached_cast(dtype, *residual, Device))
                           : std::nullopt;
  const at::Tensor cast_x = cached_cast(dtype, x, Device);
  return handles::bias_act().call(cast_x, weight_for(cast_x.scalar_type(), bias), cast_residual, activation, scale);
}

// As torch.nn.functional.linear: every operand in the autocast dtype (the sums stay float32).
template <c10::DeviceType Device, c10::DispatchKey Key>
at::Tensor linear_autocast(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& residual, c10::string_view input_activation) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = at::autocast::get_autocast_dtype(Device);
  check_cast_together("linear", dtype, {{"x", x}, {"weight", weight}, {"bias", bias.value_or(at::Tensor())},
                                        {"residual", residual.value_or(at::Tensor())}});
  return handles::linear().call(cached_cast(dtype, x, Device), cached_cast(dtype, weight, Device),
                                cached_cast(dtype, bias, Device), cached_cast(dtype, residual, Device),
                                input_activation);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> neighbor_list_autocast(
    const at::Tensor& positions, double cutoff, const std::optional<at::Tensor>& cell,
    const std::optional<at::Tensor>& pbc, const std::optional<at::Tensor>& batch,
    int64_t max_pairs, bool half, c10::string_view method) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  return handles::neighbor_list().call(cached_cast(at::kFloat, positions, Device), cutoff,
                                       cached_cast(at::kFloat, cell, Device), pbc, batch,
                                       max_pairs, half, method);
}

// pair_vectors: coordinates, float32 like neighbor_list's.
template <c10::DeviceType Device, c10::DispatchKey Key>
std::tuple<at::Tensor, at::Tensor> pair_vectors_autocast(const at::Tensor& positions, const at::Tensor& pairs,
                                                         const std::optional<at::Tensor>& shifts,
                                                         const std::optional<at::Tensor>& sender_order) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  return handles::pair_vectors().call(cached_cast(at::kFloat, positions, Device), pairs,
                                      cached_cast(at::kFloat, shifts, Device), sender_order);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
at::Tensor radial_basis_autocast(const at::Tensor& distances, c10::string_view kind, int64_t num,
                                 double cutoff, c10::string_view cutoff_fn) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  return handles::radial_basis().call(cached_cast(at::kFloat, distances, Device), kind, num,
                                      cutoff, cutoff_fn);
}

// Backward in float32 too (it meets radial_basis' float32 output gradient and saved distances).
template <c10::DeviceType Device, c10::DispatchKey Key>
at::Tensor radial_basis_backward_autocast(const at::Tensor& grad, const at::Tensor& distances,
                                          c10::string_view kind, int64_t num, double cutoff,
                                          c10::string_view cutoff_fn) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  return handles::radial_basis_backward().call(cached_cast(at::kFloat, grad, Device),
                                               cached_cast(at::kFloat, distances, Device), kind,
                                               num, cutoff, cutoff_fn);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
std::tuple<at::Tensor, at::Tensor> cfconv_autocast(const at::Tensor& x, const at::Tensor& basis,
                                                   const at::Tensor& envelope, const at::Tensor& pairs,
                                                   const at::Tensor& weight1, const std::optional<at::Tensor>& bias1,
                                                   const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
                                                   c10::string_view activation, bool tf32,
                                                   const std::optional<at::Tensor>& sender_order,
                                                   const std::optional<at::Tensor>& num_pairs) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto f32 = [](const auto& t) { return cached_cast(at::kFloat, t, Device); };  // tensors and optionals
  return handles::cfconv().call(f32(x), f32(basis), f32(envelope), pairs, f32(weight1), f32(bias1), f32(weight2),
                                f32(bias2), activation, tf32, sender_order, num_pairs);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
std::tuple<at::Tensor, at::Tensor> radial_cfconv_autocast(
    const at::Tensor& x, const at::Tensor& distances, const at::Tensor& pairs, const at::Tensor& weight1,
    const std::optional<at::Tensor>& bias1, const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
    c10::string_view activation, c10::string_view basis, double cutoff, c10::string_view envelope,
    const std::optional<at::Tensor>& sender_order) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto f32 = [](const auto& t) { return cached_cast(at::kFloat, t, Device); };  // tensors and optionals
  return handles::radial_cfconv().call(f32(x), f32(distances), pairs, f32(weight1), f32(bias1), f32(weight2),
                                       f32(bias2), activation, basis, cutoff, envelope, sender_order);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
at::Tensor message_passing_autocast(const at::Tensor& x, const at::Tensor& filter,
                                    const at::Tensor& pairs) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = at::autocast::get_autocast_dtype(Device);
  check_cast_together("message_passing", dtype, {{"x", x}, {"filter", filter}});
  return handles::message_passing().call(cached_cast(dtype, x, Device),
                                         cached_cast(dtype, filter, Device), pairs);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
at::Tensor pair_product_autocast(const at::Tensor& a, const at::Tensor& b, const at::Tensor& pairs) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = at::autocast::get_autocast_dtype(Device);
  check_cast_together("pair_product", dtype, {{"a", a}, {"b", b}});
  return handles::pair_product().call(cached_cast(dtype, a, Device), cached_cast(dtype, b, Device),
                                      pairs);
}

// mirage::vector_message_passing runs in the autocast dtype: every floating input (x, filter,
// vectors, directions, filter_weight) is cast to it, the sums stay float32 inside the kernel. directions are
// unit vectors, which float16/bfloat16 hold to their usual relative rounding; keeping them in
// float32 would save no accuracy worth a second dtype in the kernels. float64 is left alone.
template <c10::DeviceType Device, c10::DispatchKey Key>
std::tuple<at::Tensor, at::Tensor> vector_message_passing_autocast(const at::Tensor& x,
                                                                   const at::Tensor& filter,
                                                                   const at::Tensor& vectors,
                                                                   const at::Tensor& directions,
                                                                   const at::Tensor& pairs,
                                                                   const std::optional<at::Tensor>& filter_weight,
                                                                   const std::optional<at::Tensor>& sender_order,
                                                                   const std::optional<at::Tensor>& num_pairs) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = at::autocast::get_autocast_dtype(Device);
  check_cast_together("vector_message_passing", dtype,
                      {{"x", x}, {"filter", filter}, {"vectors", vectors}, {"directions", directions},
                       {"filter_weight", filter_weight.value_or(at::Tensor())}});
  std::optional<at::Tensor> weight;
  if (present(filter_weight)) weight = cached_cast(dtype, *filter_weight, Device);
  return handles::vector_message_passing().call(
      cached_cast(dtype, x, Device), cached_cast(dtype, filter, Device),
      cached_cast(dtype, vectors, Device), cached_cast(dtype, directions, Device), pairs, weight, sender_order,
      num_pairs);
}

// mirage::painn_update(_input) are elementwise: like PyTorch's own elementwise ops under autocast
// they run in the widest dtype of their inputs (s and v usually float32, what the Linears give
// in the autocast dtype), every input cast to it. An absent (undefined) input, a None passed for
// a tensor, is skipped: the op's own check names it after this kernel.
at::ScalarType widest_dtype(std::initializer_list<const at::Tensor*> tensors) {
  std::optional<at::ScalarType> dtype;
  for (const at::Tensor* t : tensors)
    if (t->defined()) dtype = dtype ? at::promote_types(*dtype, t->scalar_type()) : t->scalar_type();
  return dtype.value_or(at::kFloat);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
at::Tensor painn_update_input_autocast(const at::Tensor& s, const at::Tensor& vv, double eps) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = widest_dtype({&s, &vv});
  return handles::painn_update_input().call(cached_cast(dtype, s, Device), cached_cast(dtype, vv, Device),
                                            eps);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
std::tuple<at::Tensor, at::Tensor> painn_update_autocast(const at::Tensor& s, const at::Tensor& v,
                                                         const at::Tensor& uv, const at::Tensor& vv,
                                                         const at::Tensor& a) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = widest_dtype({&s, &v, &uv, &vv, &a});
  return handles::painn_update().call(cached_cast(dtype, s, Device), cached_cast(dtype, v, Device),
                                      cached_cast(dtype, uv, Device), cached_cast(dtype, vv, Device),
                                      cached_cast(dtype, a, Device));
}

// Each op's autocast kernel for one device (CUDA: the Autocast key, CPU: AutocastCPU).
template <c10::DeviceType Device, c10::DispatchKey Key>
void register_autocast(torch::Library& m) {
  m.impl("group_norm", &group_norm_autocast<Device, Key>);
  m.impl("layer_norm", &layer_norm_autocast<Device, Key>);
  m.impl("add_layer_norm", &add_layer_norm_autocast<Device, Key>);
  m.impl("geglu", &geglu_autocast<Device, Key>);
  m.impl("bias_act", &bias_act_autocast<Device, Key>);
  m.impl("linear", &linear_autocast<Device, Key>);
  m.impl("neighbor_list", &neighbor_list_autocast<Device, Key>);
  m.impl("pair_vectors", &pair_vectors_autocast<Device, Key>);
  m.impl("radial_basis", &radial_basis_autocast<Device, Key>);
  m.impl("radial_basis_backward", &radial_basis_backward_autocast<Device, Key>);
  m.impl("cfconv", &cfconv_autocast<Device, Key>);
  m.impl("radial_cfconv", &radial_cfconv_autocast<Device, Key>);
  m.impl("message_passing", &message_passing_autocast<Device, Key>);
  m.impl("pair_product", &pair_product_autocast<Device, Key>);
  m.impl("vector_message_passing", &vector_message_passing_autocast<Device, Key>);
  m.impl("painn_update_input", &painn_update_input_autocast<Device, Key>);
  m.impl("painn_update", &painn_update_autocast<Device, Key>);
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, Autocast, m) {
  register_autocast<c10::DeviceType::CUDA, c10::DispatchKey::Autocast>(m);
}

TORCH_LIBRARY_IMPL(mirage, AutocastCPU, m) {
  register_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>(m);
}

}  // namespace mirage::autocast
