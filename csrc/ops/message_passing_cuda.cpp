// mirage::message_passing and mirage::pair_product on CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../cuda/message_passing.cuh"
#include "cuda_utils.h"
#include "message_passing.h"

namespace mirage::ops {
namespace {

at::Tensor message_passing_cuda(const at::Tensor& x, const at::Tensor& filter,
                                const at::Tensor& pairs) {
  const std::vector<int64_t> shape = check_message_passing(x, filter, pairs);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), wc = filter.contiguous(), idx = pairs.contiguous();
  at::Tensor out = at::empty(shape, x.options());
  const cuda::DType dtype = to_kernel_dtype(x.scalar_type());
  // From the caching allocator (graph-safe); the launcher zeroes it on the stream.
  const at::Tensor workspace = workspace_for(cuda::message_passing_workspace_bytes(shape[0], shape[1], dtype), x);
  cuda::MessagePassingParams params{};
  params.x = xc.const_data_ptr();
  params.filter = wc.const_data_ptr();
  params.pairs = idx.const_data_ptr<int64_t>();
  params.out = out.mutable_data_ptr();
  params.workspace = workspace.mutable_data_ptr();
  params.num_nodes = shape[0];
  params.num_pairs = idx.size(1);
  params.features = shape[1];
  params.dtype = dtype;
  check_launch(kMessagePassing,
               cuda::launch_message_passing(params, c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor pair_product_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& pairs) {
  const std::vector<int64_t> shape = check_pair_product(a, b, pairs);
  const c10::cuda::CUDAGuard guard(a.device());
  const at::Tensor ac = a.contiguous(), bc = b.contiguous(), idx = pairs.contiguous();
  at::Tensor out = at::empty(shape, a.options());
  cuda::PairProductParams params{};
  params.a = ac.const_data_ptr();
  params.b = bc.const_data_ptr();
  params.pairs = idx.const_data_ptr<int64_t>();
  params.out = out.mutable_data_ptr();
  params.num_nodes = a.size(0);
  params.num_pairs = shape[0];
  params.features = shape[1];
  params.dtype = to_kernel_dtype(a.scalar_type());
  check_launch(kPairProduct, cuda::launch_pair_product(params, c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) {
  m.impl("message_passing", &message_passing_cuda);
  m.impl("pair_product", &pair_product_cuda);
}

}  // namespace mirage::ops
