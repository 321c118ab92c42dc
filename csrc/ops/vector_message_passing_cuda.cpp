// mirage::vector_message_passing and its backward on CUDA: checks, device guard, current stream,
// workspace from the caching allocator, then the torch-free launchers.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../cuda/sender_order.h"
#include "../../cuda/vector_message_passing.cuh"
#include "../op_handles.h"
#include "checks.h"
#include "cuda_utils.h"
#include "pair_order.h"
#include "vector_message_passing.h"

namespace mirage::ops {
namespace {

// Where the filter comes from: formed in the kernel from the basis (filter_weight given, sizes
// and dtype the kernels take: fused_filter_supported, and 16-byte aligned rows, which tensors
// from the caching allocator have), or read, formed first by a GEMM when filter_weight is given
// but the kernels cannot form it (docs/ops.md). Holds the tensors the kernel reads.
struct FilterSource {
  at::Tensor filter;  // [P, 3F] to read, or the basis [P, K]
  at::Tensor weight;  // [3F, K] when formed in the kernel
  cuda::FusedFilter fused;

  FilterSource(const at::Tensor& filter_arg, const std::optional<at::Tensor>& filter_weight,
               std::initializer_list<const at::Tensor*> rows) {
    bool fusable = present(filter_weight) &&
                   cuda::fused_filter_supported(filter_weight->size(0) / 3, filter_weight->size(1),
                                                to_kernel_dtype(filter_arg.scalar_type()));
    for (const at::Tensor* t : rows) fusable = fusable && is_16_byte_aligned(*t);
    if (fusable) {
      filter = filter_arg.contiguous();
      weight = filter_weight->contiguous();
      fused = {filter.const_data_ptr<float>(), weight.const_data_ptr<float>(), static_cast<int>(weight.size(1))};
    } else {
      filter = formed_filter(filter_arg, filter_weight).contiguous();
    }
  }

  // The params' filter pointer: null when formed in the kernel.
  const void* read() const { return fused.basis != nullptr ? nullptr : filter.const_data_ptr(); }
};

std::tuple<at::Tensor, at::Tensor> vector_message_passing_cuda(const at::Tensor& x,
                                                               const at::Tensor& filter,
                                                               const at::Tensor& vectors,
                                                               const at::Tensor& directions,
                                                               const at::Tensor& pairs,
                                                               const std::optional<at::Tensor>& filter_weight,
                                                              const std::optional<at::Tensor>& sender_order,
                                                              const std::optional<at::Tensor>& num_pairs) {
  const auto s = check_vector_message_passing(kVectorMessagePassing, x, filter, vectors, directions, pairs,
                                              filter_weight, sender_order, num_pairs);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), vc = vectors.contiguous(), dc = directions.contiguous(),
                   pc = pairs.contiguous(), count = contiguous_or_undefined(num_pairs);
  const FilterSource source(filter, filter_weight, {&xc, &vc});
  auto [scalar, vector] = empty_vector_message_passing_outputs(s, x.options());
  cuda::VectorMessagePassingParams params{};
  params.x = xc.const_data_ptr();
  params.filter = source.read();
  params.fused = source.fused;
  params.vectors = vc.const_data_ptr();
  params.directions = dc.const_data_ptr();
  params.pairs = pc.const_data_ptr<int64_t>();
  params.scalar = scalar.mutable_data_ptr();
  params.vector = vector.mutable_data_ptr();
  params.live_pairs = static_cast<const int64_t*>(data_or_null(count));
  params.nodes = s.nodes;
  params.num_pairs = s.pairs;
  params.features = s.features;
  params.dtype = to_kernel_dtype(x.scalar_type());
  const at::Tensor workspace = workspace_for(cuda::vector_message_passing_workspace_bytes(params), x);
  check_launch(kVectorMessagePassing,
               cuda::launch_vector_message_passing(params, workspace.mutable_data_ptr(),
                                                   c10::cuda::getCurrentCUDAStream()));
  return {scalar, vector};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> vector_message_passing_backward_cuda(
    const at::Tensor& grad_scalar, const at::Tensor& grad_vector, const at::Tensor& x,
    const at::Tensor& filter, const at::Tensor& vectors, const at::Tensor& directions,
    const at::Tensor& pairs, const std::optional<at::Tensor>& filter_weight,
    const std::optional<at::Tensor>& sender_order, const std::optional<at::Tensor>& num_pairs) {
  const auto s = check_vector_message_passing_backward(grad_scalar, grad_vector, x, filter, vectors,
                                                       directions, pairs, filter_weight, sender_order, num_pairs);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor gsc = grad_scalar.contiguous(), gvc = grad_vector.contiguous(),
                   xc = x.contiguous(), vc = vectors.contiguous(),
                   dc = directions.contiguous(), pc = pairs.contiguous(), order = given_sender_order(sender_order),
                   count = contiguous_or_undefined(num_pairs);
  const FilterSource source(filter, filter_weight, {&gsc, &gvc, &xc, &vc});
  auto [grad_x, grad_filter, grad_vectors, grad_directions] =
      empty_vector_message_passing_gradients(s, x.options());
  // With filter_weight the second output is the basis' gradient: formed by the kernel on tensor
  // cores where it can, else the formed filter's gradient [P, 3F] times the weight (mirage::linear:
  // its narrow kernel takes these products of many pairs).
  const bool basis_in_kernel = source.fused.basis != nullptr && cuda::use_sender_order(s.nodes, s.pairs) &&
                               cuda::basis_gradient_supported(s.features, s.width, to_kernel_dtype(x.scalar_type()));
  const at::Tensor formed_gradient = present(filter_weight) && !basis_in_kernel
                                         ? at::empty({s.pairs, 3 * s.features}, x.options())
                                         : grad_filter;
  cuda::VectorMessagePassingBackwardParams params{};
  params.grad_scalar = gsc.const_data_ptr();
  params.grad_vector = gvc.const_data_ptr();
  params.x = xc.const_data_ptr();
  params.filter = source.read();
  params.fused = source.fused;
  params.vectors = vc.const_data_ptr();
  params.directions = dc.const_data_ptr();
  params.pairs = pc.const_data_ptr<int64_t>();
  params.grad_x = grad_x.mutable_data_ptr();
  params.grad_filter = basis_in_kernel ? nullptr : formed_gradient.mutable_data_ptr();
  params.grad_basis = basis_in_kernel ? grad_filter.mutable_data_ptr() : nullptr;
  params.grad_vectors = grad_vectors.mutable_data_ptr();
  params.grad_directions = grad_directions.mutable_data_ptr();
  params.sender_order = static_cast<const int*>(data_or_null(order));
  params.live_pairs = static_cast<const int64_t*>(data_or_null(count));
  params.nodes = s.nodes;
  params.num_pairs = s.pairs;
  params.features = s.features;
  params.dtype = to_kernel_dtype(x.scalar_type());
  const at::Tensor workspace =
      workspace_for(cuda::vector_message_passing_backward_workspace_bytes(params), x);
  check_launch(kVectorMessagePassingBackward,
               cuda::launch_vector_message_passing_backward(params, workspace.mutable_data_ptr(),
                                                            c10::cuda::getCurrentCUDAStream()));
  if (present(filter_weight) && !basis_in_kernel) {
    grad_filter = handles::linear().call(formed_gradient, filter_weight->t(), std::nullopt, std::nullopt, "none");
  }
  return {grad_x, grad_filter, grad_vectors, grad_directions};
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) {
  m.impl("vector_message_passing", &vector_message_passing_cuda);
  m.impl("vector_message_passing_backward", &vector_message_passing_backward_cuda);
}

}  // namespace mirage::ops
