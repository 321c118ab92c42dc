// The public C++ API (include/mirage/mirage.h): thin calls through the dispatcher.
#include "mirage/mirage.h"

#include <initializer_list>
#include <sstream>
#include <utility>

#include "op_handles.h"
#include "ops/schnet_energy.h"

#if MIRAGE_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include "../cuda/cfconv.cuh"
#include "../cuda/vector_message_passing.cuh"
#endif

#ifndef MIRAGE_VERSION
#error "MIRAGE_VERSION must be defined by the build"
#endif

namespace mirage {
namespace {

// An undefined at::Tensor where an op needs one: the dispatcher's own error ("tensor does not have a
// device") names neither the op nor the argument.
void require_defined(const char* op, std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  for (const auto& [name, tensor] : tensors)
    TORCH_CHECK(tensor->defined(), "mirage::", op, ": ", name, " must be a defined tensor, got an undefined one");
}

#if MIRAGE_WITH_CUDA
// Whether `device` is a CUDA device this process can use: the capability queries answer no, rather
// than throw, on a machine without a GPU or its driver (device_count() is then 0).
bool usable(const c10::Device& device) {
  const int count = c10::cuda::device_count();  // noexcept: 0 without a driver
  return device.is_cuda() && count > 0 && device.index() < count;
}
#endif

}  // namespace

BuildInfo build_info() {
  BuildInfo info{MIRAGE_VERSION, MIRAGE_TORCH_VERSION, MIRAGE_CUDA_VERSION, {}};
  std::istringstream archs(MIRAGE_CUDA_ARCHS);  // ","-separated, "" when CPU-only
  for (std::string arch; std::getline(archs, arch, ',');)
    if (!arch.empty()) info.cuda_archs.push_back(arch);
  return info;
}

bool cfconv_supported(int64_t num_rbf, int64_t hidden, int64_t width, const c10::Device& device) {
  if (num_rbf < 1 || hidden < 1 || width < 1) return false;  // no filter network of these sizes
#if MIRAGE_WITH_CUDA
  if (!device.is_cuda()) return device.is_cpu();
  if (!usable(device)) return false;
  const c10::cuda::CUDAGuard guard(device);
  return cuda::cfconv_supported(num_rbf, hidden, width);
#else
  return device.is_cpu();
#endif
}

bool radial_cfconv_supported(int64_t num_rbf, int64_t hidden, int64_t width, const c10::Device& device) {
  // No filter network of these sizes, or past the filter table's bound, on every device.
  if (num_rbf < 1 || hidden < 1 || width < 1 || num_rbf > ops::kMaxTableRbf) return false;
#if MIRAGE_WITH_CUDA
  if (!device.is_cuda()) return device.is_cpu();
  if (!usable(device)) return false;
  const c10::cuda::CUDAGuard guard(device);
  return cuda::radial_cfconv_supported(num_rbf, hidden, width);
#else
  return device.is_cpu();
#endif
}

bool fused_filter_supported(int64_t features, int64_t basis, const c10::Device& device) {
#if MIRAGE_WITH_CUDA
  if (!usable(device)) return false;
  const c10::cuda::CUDAGuard guard(device);
  return cuda::fused_filter_supported(features, basis, cuda::DType::kFloat32);
#else
  (void)features, (void)basis, (void)device;
  return false;
#endif
}

bool overlapped_launches(const c10::Device& device) {
#if MIRAGE_WITH_CUDA
  if (!usable(device)) return false;
  const c10::cuda::CUDAGuard guard(device);
  return cuda::overlapped_launches();
#else
  (void)device;
  return false;
#endif
}

bool whole_model_clusters(const c10::Device& device) {
#if MIRAGE_WITH_CUDA
  if (!usable(device)) return false;
  const c10::cuda::CUDAGuard guard(device);
  return cuda::whole_model_clusters();
#else
  (void)device;
  return false;
#endif
}

at::Tensor group_norm(const at::Tensor& x, int64_t num_groups,
                      const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps,
                      std::string_view activation) {
  require_defined("group_norm", {{"x", &x}});
  return handles::group_norm().call(x, num_groups, weight, bias, eps, activation);
}

at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps) {
  require_defined("layer_norm", {{"x", &x}});
  return handles::layer_norm().call(x, weight, bias, eps);
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                  const std::optional<at::Tensor>& weight,
                                                  const std::optional<at::Tensor>& bias,
                                                  double eps) {
  require_defined("add_layer_norm", {{"x", &x}, {"residual", &residual}});
  return handles::add_layer_norm().call(x, residual, weight, bias, eps);
}

at::Tensor geglu(const at::Tensor& x, std::string_view approximate) {
  require_defined("geglu", {{"x", &x}});
  return handles::geglu().call(x, approximate);
}

at::Tensor bias_act(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& residual, std::string_view activation,
                    double scale) {
  require_defined("bias_act", {{"x", &x}});
  return handles::bias_act().call(x, bias, residual, activation, scale);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual, std::string_view input_activation) {
  require_defined("linear", {{"x", &x}, {"weight", &weight}});
  return handles::linear().call(x, weight, bias, residual, input_activation);
}

at::Tensor subpixel_shuffle(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  require_defined("subpixel_shuffle", {{"x", &x}});
  return handles::subpixel_shuffle().call(x, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> neighbor_list(
    const at::Tensor& positions, double cutoff, const std::optional<at::Tensor>& cell,
    const std::optional<at::Tensor>& pbc, const std::optional<at::Tensor>& batch,
    int64_t max_pairs, bool half, std::string_view method) {
  require_defined("neighbor_list", {{"positions", &positions}});
  return handles::neighbor_list().call(positions, cutoff, cell, pbc, batch, max_pairs, half, method);
}

at::Tensor radial_basis(const at::Tensor& distances, std::string_view kind, int64_t num,
                        double cutoff, std::string_view cutoff_fn) {
  require_defined("radial_basis", {{"distances", &distances}});
  return handles::radial_basis().call(distances, kind, num, cutoff, cutoff_fn);
}

at::Tensor message_passing(const at::Tensor& x, const at::Tensor& filter, const at::Tensor& pairs) {
  require_defined("message_passing", {{"x", &x}, {"filter", &filter}, {"pairs", &pairs}});
  return handles::message_passing().call(x, filter, pairs);
}

at::Tensor pair_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& pairs) {
  require_defined("pair_product", {{"a", &a}, {"b", &b}, {"pairs", &pairs}});
  return handles::pair_product().call(a, b, pairs);
}

at::Tensor sender_order(const at::Tensor& pairs, int64_t num_nodes, const std::optional<at::Tensor>& num_pairs) {
  require_defined("sender_order", {{"pairs", &pairs}});
  return handles::sender_order().call(pairs, num_nodes, num_pairs);
}

std::tuple<at::Tensor, at::Tensor> vector_message_passing(const at::Tensor& x,
                                                          const at::Tensor& filter,
                                                          const at::Tensor& vectors,
                                                          const at::Tensor& directions,
                                                          const at::Tensor& pairs,
                                                          const std::optional<at::Tensor>& filter_weight,
                                                          const std::optional<at::Tensor>& sender_order,
                                                          const std::optional<at::Tensor>& num_pairs) {
  require_defined("vector_message_passing",
                  {{"x", &x}, {"filter", &filter}, {"vectors", &vectors}, {"directions", &directions}, {"pairs", &pairs}});
  return handles::vector_message_passing().call(x, filter, vectors, directions, pairs, filter_weight, sender_order,
                                                num_pairs);
}

std::tuple<at::Tensor, at::Tensor> pair_vectors(const at::Tensor& positions, const at::Tensor& pairs,
                                                const std::optional<at::Tensor>& shifts,
                                                const std::optional<at::Tensor>& sender_order) {
  require_defined("pair_vectors", {{"positions", &positions}, {"pairs", &pairs}});
  return handles::pair_vectors().call(positions, pairs, shifts, sender_order);
}

at::Tensor painn_update_input(const at::Tensor& s, const at::Tensor& vv, double eps) {
  require_defined("painn_update_input", {{"s", &s}, {"vv", &vv}});
  return handles::painn_update_input().call(s, vv, eps);
}

std::tuple<at::Tensor, at::Tensor> painn_update(const at::Tensor& s, const at::Tensor& v,
                                                const at::Tensor& uv, const at::Tensor& vv,
                                                const at::Tensor& a) {
  require_defined("painn_update", {{"s", &s}, {"v", &v}, {"uv", &uv}, {"vv", &vv}, {"a", &a}});
  return handles::painn_update().call(s, v, uv, vv, a);
}

at::Tensor verlet_kick_drift(at::Tensor& positions, at::Tensor& velocities, const at::Tensor& forces,
                             const at::Tensor& inverse_masses, double kick, double drift, at::ScalarType dtype) {
  require_defined("verlet_kick_drift", {{"positions", &positions}, {"velocities", &velocities}, {"forces", &forces},
                                        {"inverse_masses", &inverse_masses}});
  return handles::verlet_kick_drift().call(positions, velocities, forces, inverse_masses, kick, drift, dtype);
}

void verlet_forces_kick(at::Tensor& velocities, at::Tensor& forces, at::Tensor& energy, const at::Tensor& grad,
                        const at::Tensor& model_energy, const at::Tensor& inverse_masses, double kick,
                        const std::optional<at::Tensor>& pair_count,
                        const std::optional<at::Tensor>& pair_count_range) {
  require_defined("verlet_forces_kick", {{"velocities", &velocities}, {"forces", &forces}, {"energy", &energy},
                                         {"grad", &grad}, {"model_energy", &model_energy},
                                         {"inverse_masses", &inverse_masses}});
  handles::verlet_forces_kick().call(velocities, forces, energy, grad, model_energy, inverse_masses, kick, pair_count,
                                     pair_count_range);
}

at::Tensor verlet_forces_kick_drift(at::Tensor& positions, at::Tensor& velocities, at::Tensor& forces,
                                    at::Tensor& energy, const at::Tensor& grad, const at::Tensor& model_energy,
                                    const at::Tensor& inverse_masses, double kick, double drift, at::ScalarType dtype,
                                    const std::optional<at::Tensor>& pair_count,
                                    const std::optional<at::Tensor>& pair_count_range) {
  require_defined("verlet_forces_kick_drift",
                  {{"positions", &positions}, {"velocities", &velocities}, {"forces", &forces}, {"energy", &energy},
                   {"grad", &grad}, {"model_energy", &model_energy}, {"inverse_masses", &inverse_masses}});
  return handles::verlet_forces_kick_drift().call(positions, velocities, forces, energy, grad, model_energy,
                                                  inverse_masses, kick, drift, dtype, pair_count, pair_count_range);
}

}  // namespace mirage
