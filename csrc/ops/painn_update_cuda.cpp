// mirage::painn_update(_input) and their backward ops on CUDA: checks, device guard, current
// stream, then the torch-free launchers.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../cuda/painn_update.cuh"
#include "cuda_utils.h"
#include "painn_update.h"

namespace mirage::ops {
namespace {

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

at::Tensor painn_update_input_cuda(const at::Tensor& s, const at::Tensor& vv, double eps) {
  const auto [N, F] = check_painn_update_input(s, vv, eps);
  const c10::cuda::CUDAGuard guard(s.device());
  const at::Tensor sc = s.contiguous(), vvc = vv.contiguous();
  at::Tensor input = at::empty({N, 2 * F}, s.options());
  const cuda::PainnUpdateInputParams params{sc.const_data_ptr(), vvc.const_data_ptr(),
                                            input.mutable_data_ptr(), N, F, static_cast<float>(eps),
                                            to_kernel_dtype(s.scalar_type())};
  check_launch(kPainnUpdateInput, cuda::launch_painn_update_input(params, stream()));
  return input;
}

at::Tensor painn_update_input_backward_cuda(const at::Tensor& grad, const at::Tensor& vv, double eps) {
  const auto [N, F] = check_painn_update_input_backward(grad, vv, eps);
  const c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor gc = grad.contiguous(), vvc = vv.contiguous();
  at::Tensor grad_vv = at::empty({N, 3, F}, grad.options());
  const cuda::PainnUpdateInputBackwardParams params{
      gc.const_data_ptr(), vvc.const_data_ptr(), grad_vv.mutable_data_ptr(), N, F,
      static_cast<float>(eps), to_kernel_dtype(grad.scalar_type())};
  check_launch(kPainnUpdateInputBackward, cuda::launch_painn_update_input_backward(params, stream()));
  return grad_vv;
}

std::tuple<at::Tensor, at::Tensor> painn_update_cuda(const at::Tensor& s, const at::Tensor& v,
                                                     const at::Tensor& uv, const at::Tensor& vv,
                                                     const at::Tensor& a) {
  const auto [N, F] = check_painn_update(kPainnUpdate, "s", s, "v", v, uv, vv, a);
  const c10::cuda::CUDAGuard guard(s.device());
  const at::Tensor sc = s.contiguous(), vc = v.contiguous(), uvc = uv.contiguous(),
                   vvc = vv.contiguous(), ac = a.contiguous();
  at::Tensor s_out = at::empty({N, F}, s.options()), v_out = at::empty({N, 3, F}, s.options());
  const cuda::PainnUpdateParams params{sc.const_data_ptr(), vc.const_data_ptr(), uvc.const_data_ptr(),
                                       vvc.const_data_ptr(), ac.const_data_ptr(),
                                       s_out.mutable_data_ptr(), v_out.mutable_data_ptr(), N, F,
                                       to_kernel_dtype(s.scalar_type())};
  check_launch(kPainnUpdate, cuda::launch_painn_update(params, stream()));
  return {s_out, v_out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> painn_update_backward_cuda(
    const at::Tensor& grad_s, const at::Tensor& grad_v, const at::Tensor& uv, const at::Tensor& vv,
    const at::Tensor& a) {
  const auto [N, F] =
      check_painn_update(kPainnUpdateBackward, "grad_s", grad_s, "grad_v", grad_v, uv, vv, a);
  const c10::cuda::CUDAGuard guard(grad_s.device());
  const at::Tensor gsc = grad_s.contiguous(), gvc = grad_v.contiguous(), uvc = uv.contiguous(),
                   vvc = vv.contiguous(), ac = a.contiguous();
  const auto options = grad_s.options();
  at::Tensor grad_uv = at::empty({N, 3, F}, options), grad_vv = at::empty({N, 3, F}, options),
             grad_a = at::empty({N, 3 * F}, options);
  const cuda::PainnUpdateBackwardParams params{
      gsc.const_data_ptr(), gvc.const_data_ptr(), uvc.const_data_ptr(), vvc.const_data_ptr(),
      ac.const_data_ptr(), grad_uv.mutable_data_ptr(), grad_vv.mutable_data_ptr(),
      grad_a.mutable_data_ptr(), N, F, to_kernel_dtype(grad_s.scalar_type())};
  check_launch(kPainnUpdateBackward, cuda::launch_painn_update_backward(params, stream()));
  return {grad_uv, grad_vv, grad_a};
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) {
  m.impl("painn_update_input", &painn_update_input_cuda);
  m.impl("painn_update_input_backward", &painn_update_input_backward_cuda);
  m.impl("painn_update", &painn_update_cuda);
  m.impl("painn_update_backward", &painn_update_backward_cuda);
}

}  // namespace mirage::ops
