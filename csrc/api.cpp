// The public C++ API (include/mirage/mirage.h): thin calls through the dispatcher.
#include "mirage/mirage.h"

#include <sstream>

#include "op_handles.h"

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

}  // namespace mirage
