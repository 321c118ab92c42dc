// mirage::group_norm on CUDA: checks, device guard, current stream, workspace from the caching
// allocator, then the torch-free launcher.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../../cuda/group_norm.cuh"
#include "checks.h"
#include "cuda_utils.h"
#include "group_norm.h"

namespace mirage::ops {
namespace {

at::Tensor group_norm_cuda(const at::Tensor& x, int64_t num_groups,
                           const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, double eps,
                           c10::string_view activation) {
  check_group_norm(x, num_groups, weight, bias, eps, activation);
  const ChannelsShape shape = channels_shape(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor input = x.contiguous(shape.layout);
  const at::Tensor w = contiguous_or_undefined(weight);
  const at::Tensor b = contiguous_or_undefined(bias);
  at::Tensor y = empty_in_channels_layout(x, shape.layout);

  cuda::GroupNormParams params{};
  params.x = input.const_data_ptr();
  params.weight = data_or_null(w);
  params.bias = data_or_null(b);
  params.y = y.mutable_data_ptr();
  params.batch = shape.batch;
  params.channels = shape.channels;
  params.spatial = shape.spatial;
  params.groups = num_groups;
  params.eps = static_cast<float>(eps);
  params.channels_last = shape.layout != at::MemoryFormat::Contiguous;
  params.activation = activation == "silu" ? cuda::Activation::kSilu : cuda::Activation::kNone;
  params.dtype = to_kernel_dtype(x.scalar_type());
  params.param_dtype = to_kernel_dtype(param_dtype(kGroupNorm, weight, bias, x));

  const at::Tensor workspace = workspace_for(cuda::group_norm_workspace_bytes(params), x);
  check_launch(kGroupNorm, cuda::launch_group_norm(params, workspace.mutable_data_ptr(),
                                                   c10::cuda::getCurrentCUDAStream()));
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) { m.impl("group_norm", &group_norm_cuda); }

}  // namespace mirage::ops
