// mirage::radial_basis and its backward on CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../cuda/radial_basis.cuh"
#include "checks.h"
#include "cuda_utils.h"
#include "radial_basis.h"

namespace mirage::ops {
namespace {

at::Tensor radial_basis_cuda(const at::Tensor& distances, c10::string_view kind, int64_t num,
                             double cutoff, c10::string_view cutoff_fn) {
  const std::vector<int64_t> shape = check_radial_basis(distances, kind, num, cutoff, cutoff_fn);
  const c10::cuda::CUDAGuard guard(distances.device());
  const at::Tensor input = distances.contiguous();
  at::Tensor out = allocate_named(kRadialBasis, "num", num, [&] { return at::empty(shape, distances.options()); });
  cuda::RadialBasisParams params{};
  params.distances = input.const_data_ptr();
  params.out = out.mutable_data_ptr();
  params.count = input.numel();
  params.num = num;
  params.cutoff = static_cast<float>(cutoff);
  params.kind = kernel_basis(kind);
  params.cutoff_fn = kernel_cutoff_fn(cutoff_fn);
  params.dtype = to_kernel_dtype(distances.scalar_type());
  check_launch(kRadialBasis, cuda::launch_radial_basis(params, c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor radial_basis_backward_cuda(const at::Tensor& grad, const at::Tensor& distances,
                                      c10::string_view kind, int64_t num, double cutoff,
                                      c10::string_view cutoff_fn) {
  check_radial_basis_backward(grad, distances, kind, num, cutoff, cutoff_fn);
  const c10::cuda::CUDAGuard guard(distances.device());
  const at::Tensor grad_in = grad.contiguous();
  const at::Tensor distances_in = distances.contiguous();
  at::Tensor out = at::empty(distances.sizes(), distances.options());
  cuda::RadialBasisBackwardParams params{};
  params.grad = grad_in.const_data_ptr();
  params.distances = distances_in.const_data_ptr();
  params.grad_distances = out.mutable_data_ptr();
  params.count = distances_in.numel();
  params.num = num;
  params.cutoff = static_cast<float>(cutoff);
  params.kind = kernel_basis(kind);
  params.cutoff_fn = kernel_cutoff_fn(cutoff_fn);
  params.dtype = to_kernel_dtype(distances.scalar_type());
  check_launch(kRadialBasisBackward,
               cuda::launch_radial_basis_backward(params, c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) {
  m.impl("radial_basis", &radial_basis_cuda);
  m.impl("radial_basis_backward", &radial_basis_backward_cuda);
}

}  // namespace mirage::ops
