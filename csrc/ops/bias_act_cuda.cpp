// mirage::bias_act on CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../cuda/bias_act.cuh"
#include "bias_act.h"
#include "cuda_utils.h"

namespace mirage::ops {
namespace {

at::Tensor bias_act_cuda(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual, c10::string_view activation,
                         double scale) {
  check_bias_act(x, bias, residual, activation, scale);
  const ChannelsShape shape = channels_shape(x);
  const c10::cuda::CUDAGuard guard(x.device());
  // The kernel reads x and residual in the output's memory order (a copy only when they differ).
  const at::Tensor input = x.contiguous(shape.layout);
  const at::Tensor res = present(residual)
                             ? residual->contiguous(shape.layout) : at::Tensor();
  const at::Tensor b = contiguous_or_undefined(bias);
  at::Tensor y = empty_in_channels_layout(x, shape.layout);
  cuda::BiasActParams params{};
  params.x = input.const_data_ptr();
  params.bias = data_or_null(b);
  params.residual = data_or_null(res);
  params.y = y.mutable_data_ptr();
  params.batch = shape.batch;
  params.channels = shape.channels;
  params.spatial = shape.spatial;
  params.channels_last = shape.layout != at::MemoryFormat::Contiguous;
  params.bias_per_sample = b.defined() && b.dim() == 2;
  params.activation = static_cast<cuda::Activation>(bias_activation_index(activation));
  params.scale = static_cast<float>(scale);
  params.dtype = to_kernel_dtype(x.scalar_type());
  params.bias_dtype = to_kernel_dtype(b.defined() ? b.scalar_type() : x.scalar_type());
  check_launch(kBiasAct, cuda::launch_bias_act(params, c10::cuda::getCurrentCUDAStream()));
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) { m.impl("bias_act", &bias_act_cuda); }

}  // namespace mirage::ops
