// The public C++ API (include/mirage/mirage.h): thin calls through the dispatcher.
#include "mirage/mirage.h"

#include <sstream>

#include "op_handles.h"

#if MIRAGE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "../cuda/cfconv.cuh"
#include "../cuda/vector_message_passing.cuh"
#endif

#ifndef MIRAGE_VERSION
#error "MIRAGE_VERSION must be defined by the build"
#endif

namespace mirage {

BuildInfo build_info() {
  BuildInfo info{MIRAGE_VERSION, MIRAGE_TORCH_VERSION, MIRAGE_CUDA_VERSION, {}};
  std::istringstream archs(MIRAGE_CUDA_ARCHS);  // ","-separated, "" when CPU-only
  for (std::string arch; std::getline(archs, arch, ',');)
    if (!arch.empty()) info.cuda_archs.push_back(arch);
  return info;
}

bool cfconv_supported(int64_t num_rbf, int64_t hidden, int64_t width, const c10::Device& device) {
#if MIRAGE_WITH_CUDA
  if (!device.is_cuda()) return device.is_cpu();
  const c10::cuda::CUDAGuard guard(device);
  return cuda::cfconv_supported(num_rbf, hidden, width);
#else
  return device.is_cpu();
#endif
}

bool radial_cfconv_supported(int64_t num_rbf, int64_t hidden, int64_t width, const c10::Device& device) {
#if MIRAGE_WITH_CUDA
  if (!device.is_cuda()) return device.is_cpu();
  const c10::cuda::CUDAGuard guard(device);
  return cuda::radial_cfconv_supported(num_rbf, hidden, width);
#else
  return device.is_cpu();
#endif
}

bool fused_filter_supported(int64_t features, int64_t basis, const c10::Device& device) {
#if MIRAGE_WITH_CUDA
  if (!device.is_cuda()) return false;
  const c10::cuda::CUDAGuard guard(device);
  return cuda::fused_filter_supported(features, basis, cuda::DType::kFloat32);
#else
  (void)features, (void)basis, (void)device;
  return false;
#endif
}

bool overlapped_launches(const c10::Device& device) {
#if MIRAGE_WITH_CUDA
  if (!device.is_cuda()) return false;
  const c10::cuda::CUDAGuard guard(device);
  return cuda::overlapped_launches();
#else
  (void)device;
  return false;
#endif
}

at::Tensor group_norm(const at::Tensor& x, int64_t num_groups,
                      const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps,
                      std::string_view activation) {
  return handles::group_norm().call(x, num_groups, weight, bias, eps, activation);
}

at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps) {
  return handles::layer_norm().call(x, weight, bias, eps);
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                  const std::optional<at::Tensor>& weight,
                                                  const std::optional<at::Tensor>& bias,
                                                  double eps) {
  return handles::add_layer_norm().call(x, residual, weight, bias, eps);
}

at::Tensor geglu(const at::Tensor& x, std::string_view approximate) {
  return handles::geglu().call(x, approximate);
}

at::Tensor bias_act(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& residual, std::string_view activation,
                    double scale) {
  return handles::bias_act().call(x, bias, residual, activation, scale);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual, std::string_view input_activation) {
  return handles::linear().call(x, weight, bias, residual, input_activation);
}

at::Tensor subpixel_shuffle(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  return handles::subpixel_shuffle().call(x, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> neighbor_list(
    const at::Tensor& positions, double cutoff, const std::optional<at::Tensor>& cell,
    const std::optional<at::Tensor>& pbc, const std::optional<at::Tensor>& batch,
    int64_t max_pairs, bool half, std::string_view method) {
  return handles::neighbor_list().call(positions, cutoff, cell, pbc, batch, max_pairs, half, method);
}

at::Tensor radial_basis(const at::Tensor& distances, std::string_view kind, int64_t num,
                        double cutoff, std::string_view cutoff_fn) {
  return handles::radial_basis().call(distances, kind, num, cutoff, cutoff_fn);
}

at::Tensor message_passing(const at::Tensor& x, const at::Tensor& filter, const at::Tensor& pairs) {
  return handles::message_passing().call(x, filter, pairs);
}

at::Tensor pair_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& pairs) {
  return handles::pair_product().call(a, b, pairs);
}

at::Tensor sender_order(const at::Tensor& pairs, int64_t num_nodes, const std::optional<at::Tensor>& num_pairs) {
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
  return handles::vector_message_passing().call(x, filter, vectors, directions, pairs, filter_weight, sender_order,
                                                num_pairs);
}

std::tuple<at::Tensor, at::Tensor> pair_vectors(const at::Tensor& positions, const at::Tensor& pairs,
                                                const std::optional<at::Tensor>& shifts,
                                                const std::optional<at::Tensor>& sender_order) {
  return handles::pair_vectors().call(positions, pairs, shifts, sender_order);
}

at::Tensor painn_update_input(const at::Tensor& s, const at::Tensor& vv, double eps) {
  return handles::painn_update_input().call(s, vv, eps);
}

std::tuple<at::Tensor, at::Tensor> painn_update(const at::Tensor& s, const at::Tensor& v,
                                                const at::Tensor& uv, const at::Tensor& vv,
                                                const at::Tensor& a) {
  return handles::painn_update().call(s, v, uv, vv, a);
}

at::Tensor verlet_kick_drift(at::Tensor& positions, at::Tensor& velocities, const at::Tensor& forces,
                             const at::Tensor& inverse_masses, double kick, double drift, at::ScalarType dtype) {
  return handles::verlet_kick_drift().call(positions, velocities, forces, inverse_masses, kick, drift, dtype);
}

void verlet_forces_kick(at::Tensor& velocities, at::Tensor& forces, at::Tensor& energy, const at::Tensor& grad,
                        const at::Tensor& model_energy, const at::Tensor& inverse_masses, double kick,
                        const std::optional<at::Tensor>& pair_count,
                        const std::optional<at::Tensor>& pair_count_range) {
  handles::verlet_forces_kick().call(velocities, forces, energy, grad, model_energy, inverse_masses, kick, pair_count,
                                     pair_count_range);
}

}  // namespace mirage
