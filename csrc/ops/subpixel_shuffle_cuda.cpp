// mirage::subpixel_shuffle on CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../cuda/subpixel_shuffle.cuh"
#include "checks.h"
#include "cuda_utils.h"
#include "subpixel_shuffle.h"

namespace mirage::ops {
namespace {

at::Tensor subpixel_shuffle_cuda(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  const c10::SymDimVector shape = check_subpixel_shuffle(x, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  // The kernel reads channels-last x (a copy only when x is not).
  const at::Tensor input = x.contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor b = contiguous_or_undefined(bias);
  at::Tensor out = at::empty_symint(shape, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  cuda::SubpixelShuffleParams params{};
  params.y = input.const_data_ptr();
  params.bias = data_or_null(b);
  params.out = out.mutable_data_ptr();
  params.batch = out.size(0);
  params.channels = out.size(1);
  params.height = out.size(2) / 2;
  params.width = out.size(3) / 2;
  params.dtype = to_kernel_dtype(x.scalar_type());
  params.bias_dtype = to_kernel_dtype(b.defined() ? b.scalar_type() : x.scalar_type());
  check_launch(kSubpixelShuffle, cuda::launch_subpixel_shuffle(params, c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) { m.impl("subpixel_shuffle", &subpixel_shuffle_cuda); }

}  // namespace mirage::ops
