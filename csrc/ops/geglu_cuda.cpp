// mirage::geglu on CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../../cuda/geglu.cuh"
#include "cuda_utils.h"
#include "geglu.h"

namespace mirage::ops {
namespace {

at::Tensor geglu_cuda(const at::Tensor& x, c10::string_view approximate) {
  const c10::SymDimVector shape = check_geglu(x, approximate);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor input = x.contiguous();
  at::Tensor y = at::empty_symint(shape, x.options());
  cuda::GegluParams params{};
  params.x = input.const_data_ptr();
  params.y = y.mutable_data_ptr();
  params.half_dim = y.size(-1);
  params.rows = params.half_dim == 0 ? 0 : y.numel() / params.half_dim;
  params.approximate = approximate == "tanh" ? cuda::GeluApprox::kTanh : cuda::GeluApprox::kNone;
  params.dtype = to_kernel_dtype(x.scalar_type());
  check_launch(kGeglu, cuda::launch_geglu(params, c10::cuda::getCurrentCUDAStream()));
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) { m.impl("geglu", &geglu_cuda); }

}  // namespace mirage::ops
