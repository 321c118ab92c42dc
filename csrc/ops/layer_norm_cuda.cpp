// mirage::layer_norm / add_layer_norm on CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../../cuda/layer_norm.cuh"
#include "checks.h"
#include "cuda_utils.h"
#include "layer_norm.h"
#include "message.h"

namespace mirage::ops {
namespace {

// Runs the kernel on contiguous x (and residual); `sum` is written only with a residual.
void run_layer_norm(std::string_view op, const at::Tensor& x, const at::Tensor& residual,
                    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                    double eps, int64_t dim, at::Tensor& y, at::Tensor& sum) {
  if (x.numel() == 0) return;  // an empty output, as on the CPU, whatever the last dimension's size
  const auto kernel_dtype = to_kernel_dtype(x.scalar_type());
  MIRAGE_CHECK(dim <= cuda::layer_norm_max_dim(kernel_dtype), op,
              ": x's last dimension must be at most ", cuda::layer_norm_max_dim(kernel_dtype),
              " on CUDA (a row is held in registers), got ", dim);
  const at::Tensor w = contiguous_or_undefined(weight);
  const at::Tensor b = contiguous_or_undefined(bias);
  cuda::LayerNormParams params{};
  params.x = x.const_data_ptr();
  params.residual = data_or_null(residual);
  params.weight = data_or_null(w);
  params.bias = data_or_null(b);
  params.y = y.mutable_data_ptr();
  params.sum = sum.defined() ? sum.mutable_data_ptr() : nullptr;
  params.rows = dim == 0 ? 0 : x.numel() / dim;
  params.dim = dim;
  params.eps = static_cast<float>(eps);
  params.dtype = kernel_dtype;
  params.param_dtype = to_kernel_dtype(param_dtype(op, weight, bias, x));
  check_launch(op, cuda::launch_layer_norm(params, c10::cuda::getCurrentCUDAStream()));
}

at::Tensor layer_norm_cuda(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, double eps) {
  check_layer_norm(kLayerNorm, x, weight, bias, eps);
  const int64_t dim = x.size(-1);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor input = x.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor no_sum;
  run_layer_norm(kLayerNorm, input, at::Tensor(), weight, bias, eps, dim, y, no_sum);
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm_cuda(const at::Tensor& x,
                                                       const at::Tensor& residual,
                                                       const std::optional<at::Tensor>& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       double eps) {
  check_add_layer_norm(x, residual, weight, bias, eps);
  const int64_t dim = x.size(-1);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor input = x.contiguous();
  const at::Tensor res = residual.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor sum = at::empty(x.sizes(), x.options());
  run_layer_norm(kAddLayerNorm, input, res, weight, bias, eps, dim, y, sum);
  return {y, sum};
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) {
  m.impl("layer_norm", &layer_norm_cuda);
  m.impl("add_layer_norm", &add_layer_norm_cuda);
}

}  // namespace mirage::ops
