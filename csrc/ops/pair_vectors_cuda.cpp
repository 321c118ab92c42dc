// mirage::pair_vectors and its backward on CUDA: checks, device guard, current stream, workspace
// from the caching allocator, then the torch-free launchers.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../cuda/pair_vectors.cuh"
#include "checks.h"
#include "cuda_utils.h"
#include "pair_order.h"
#include "pair_vectors.h"

namespace mirage::ops {
namespace {

at::Tensor contiguous_shifts(const std::optional<at::Tensor>& shifts) {
  return present(shifts) ? shifts->contiguous() : at::Tensor();
}

std::tuple<at::Tensor, at::Tensor> pair_vectors_cuda(const at::Tensor& positions, const at::Tensor& pairs,
                                                     const std::optional<at::Tensor>& shifts,
                                                     const std::optional<at::Tensor>& sender_order) {
  const auto [N, P] = check_pair_vectors(kPairVectors, positions, pairs, shifts, sender_order);
  const c10::cuda::CUDAGuard guard(positions.device());
  const at::Tensor pos = positions.contiguous(), idx = pairs.contiguous(), sh = contiguous_shifts(shifts);
  at::Tensor vectors = at::empty({P, 3}, positions.options()), distances = at::empty({P}, positions.options());
  const cuda::PairVectorsParams params{pos.const_data_ptr<float>(), idx.const_data_ptr<int64_t>(),
                                       sh.defined() ? sh.const_data_ptr<float>() : nullptr,
                                       vectors.mutable_data_ptr<float>(), distances.mutable_data_ptr<float>(), N, P};
  check_launch(kPairVectors, cuda::launch_pair_vectors(params, c10::cuda::getCurrentCUDAStream()));
  return {vectors, distances};
}

at::Tensor pair_vectors_backward_cuda(const std::optional<at::Tensor>& grad_vectors,
                                      const std::optional<at::Tensor>& grad_distances,
                                      const at::Tensor& positions, const at::Tensor& pairs,
                                      const std::optional<at::Tensor>& shifts,
                                      const std::optional<at::Tensor>& sender_order) {
  const auto [N, P] =
      check_pair_vectors_backward(grad_vectors, grad_distances, positions, pairs, shifts, sender_order);
  const c10::cuda::CUDAGuard guard(positions.device());
  const at::Tensor gv = present(grad_vectors) ? grad_vectors->contiguous() : at::Tensor();
  const at::Tensor gd = present(grad_distances) ? grad_distances->contiguous() : at::Tensor();
  const at::Tensor pos = positions.contiguous(), idx = pairs.contiguous(), sh = contiguous_shifts(shifts),
                   order = given_sender_order(sender_order);
  at::Tensor grad = at::empty({N, 3}, positions.options());
  const at::Tensor workspace =
      workspace_for(cuda::pair_vectors_backward_workspace_bytes(N, P, order.defined()), positions);
  const cuda::PairVectorsBackwardParams params{static_cast<const float*>(data_or_null(gv)),
                                               static_cast<const float*>(data_or_null(gd)),
                                               pos.const_data_ptr<float>(), idx.const_data_ptr<int64_t>(),
                                               sh.defined() ? sh.const_data_ptr<float>() : nullptr,
                                               grad.mutable_data_ptr<float>(),
                                               static_cast<const int*>(data_or_null(order)), N, P};
  check_launch(kPairVectorsBackward, cuda::launch_pair_vectors_backward(params, workspace.mutable_data_ptr(),
                                                                        c10::cuda::getCurrentCUDAStream()));
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) {
  m.impl("pair_vectors", &pair_vectors_cuda);
  m.impl("pair_vectors_backward", &pair_vectors_backward_cuda);
}

}  // namespace mirage::ops
