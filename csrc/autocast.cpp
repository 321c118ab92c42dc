// Autocast policy. mirage's norms and GEGLU keep their statistics and arithmetic in float32
// whatever their I/O dtype, so under autocast they run in the autocast dtype: activations (x,
// residual) are cast to it, float32 weight and bias are read as they are. This differs from
// PyTorch's policy for its own norms (run in float32), which would double their memory traffic
// for no accuracy gain here.
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "op_handles.h"

namespace mirage::autocast {
namespace {

using at::autocast::cached_cast;

template <c10::DeviceType Device, c10::DispatchKey Key>
at::Tensor group_norm_autocast(const at::Tensor& x, int64_t num_groups,
                               const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps,
                               c10::string_view activation) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = at::autocast::get_autocast_dtype(Device);
  return handles::group_norm().call(cached_cast(dtype, x, Device), num_groups, weight, bias, eps,
                                    activation);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
at::Tensor layer_norm_autocast(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = at::autocast::get_autocast_dtype(Device);
  return handles::layer_norm().call(cached_cast(dtype, x, Device), weight, bias, eps);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
std::tuple<at::Tensor, at::Tensor> add_layer_norm_autocast(
    const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = at::autocast::get_autocast_dtype(Device);
  return handles::add_layer_norm().call(cached_cast(dtype, x, Device),
                                        cached_cast(dtype, residual, Device), weight, bias, eps);
}

template <c10::DeviceType Device, c10::DispatchKey Key>
at::Tensor geglu_autocast(const at::Tensor& x, c10::string_view approximate) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const auto dtype = at::autocast::get_autocast_dtype(Device);
  return handles::geglu().call(cached_cast(dtype, x, Device), approximate);
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, Autocast, m) {
  constexpr auto kDevice = c10::DeviceType::CUDA;
  constexpr auto kKey = c10::DispatchKey::Autocast;
  m.impl("group_norm", &group_norm_autocast<kDevice, kKey>);
  m.impl("layer_norm", &layer_norm_autocast<kDevice, kKey>);
  m.impl("add_layer_norm", &add_layer_norm_autocast<kDevice, kKey>);
  m.impl("geglu", &geglu_autocast<kDevice, kKey>);
}

TORCH_LIBRARY_IMPL(mirage, AutocastCPU, m) {
  constexpr auto kDevice = c10::DeviceType::CPU;
  constexpr auto kKey = c10::DispatchKey::AutocastCPU;
  m.impl("group_norm", &group_norm_autocast<kDevice, kKey>);
  m.impl("layer_norm", &layer_norm_autocast<kDevice, kKey>);
  m.impl("add_layer_norm", &add_layer_norm_autocast<kDevice, kKey>);
  m.impl("geglu", &geglu_autocast<kDevice, kKey>);
}

}  // namespace mirage::autocast
