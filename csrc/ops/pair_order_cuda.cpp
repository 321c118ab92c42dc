// mirage::sender_order on CUDA: checks, device guard, current stream, scratch from the caching
// allocator, then the torch-free sort of cuda/pair_order.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../cuda/pair_order.cuh"
#include "checks.h"
#include "cuda_utils.h"
#include "pair_order.h"

namespace mirage::ops {
namespace {

at::Tensor sender_order_cuda(const at::Tensor& pairs, int64_t num_nodes, const std::optional<at::Tensor>& num_pairs) {
  const int64_t length = check_sender_order_op(pairs, num_nodes, num_pairs);
  const c10::cuda::CUDAGuard guard(pairs.device());
  at::Tensor order = at::empty({length}, pairs.options().dtype(at::kInt));
  if (length == 0) return order;
  const at::Tensor idx = pairs.contiguous(), count = contiguous_or_undefined(num_pairs);
  const at::Tensor scratch = workspace_for(cuda::sort_by_sender_scratch_bytes(num_nodes, length), pairs);
  check_launch(kSenderOrder,
               cuda::sort_by_sender(idx.const_data_ptr<int64_t>(), num_nodes, length,
                                    static_cast<const int64_t*>(data_or_null(count)), order.mutable_data_ptr<int>(),
                                    scratch.mutable_data_ptr(), c10::cuda::getCurrentCUDAStream()));
  return order;
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) { m.impl("sender_order", &sender_order_cuda); }

}  // namespace mirage::ops
