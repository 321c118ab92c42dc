// mirage::sender_order: checks, the CPU reference and the Meta kernel; the checks of the ops'
// `sender_order` argument.
#include "pair_order.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "../../cuda/sender_order.h"
#include "message.h"

namespace mirage::ops {

int64_t check_sender_order_op(const at::Tensor& pairs, int64_t num_nodes) {
  MIRAGE_CHECK(pairs.scalar_type() == at::kLong, kSenderOrder, ": pairs must be int64, got ", pairs.scalar_type());
  MIRAGE_CHECK(pairs.dim() == 2 && pairs.size(0) == 2, kSenderOrder, ": pairs must be [2, P], got ", pairs.sizes());
  MIRAGE_CHECK(num_nodes >= 0, kSenderOrder, ": num_nodes must be >= 0, got ", num_nodes);
  return cuda::use_sender_order(num_nodes, pairs.size(1)) ? pairs.size(1) : 0;
}

void check_sender_order(std::string_view op, const std::optional<at::Tensor>& order, const at::Tensor& pairs) {
  if (!order.has_value()) return;
  const int64_t P = pairs.size(1);
  MIRAGE_CHECK(order->device() == pairs.device(), op, ": sender_order must be on pairs' device (", pairs.device(),
               "), got ", order->device());
  MIRAGE_CHECK(order->scalar_type() == at::kInt, op, ": sender_order must be int32 (mirage::sender_order's), got ",
               order->scalar_type());
  MIRAGE_CHECK(order->dim() == 1 && (order->size(0) == P || order->size(0) == 0), op,
               ": sender_order must have shape [P] = [", P,
               "] or [0] (mirage::sender_order(pairs, N) of these pairs), got ", order->sizes());
  if (order->is_cpu() && order->size(0) != 0) {
    const at::Tensor c = order->contiguous();
    const int* o = c.const_data_ptr<int>();
    std::vector<bool> seen(P, false);
    for (int64_t k = 0; k < P; ++k) {
      MIRAGE_CHECK(o[k] >= 0 && o[k] < P && !seen[o[k]], op,
                   ": sender_order must be a permutation of [0, P), but sender_order[", k, "] = ", o[k],
                   o[k] >= 0 && o[k] < P ? " appears twice" : " is out of range");
      seen[o[k]] = true;
    }
  }
}

at::Tensor given_sender_order(const std::optional<at::Tensor>& order) {
  return order.has_value() && order->numel() != 0 ? order->contiguous() : at::Tensor();
}

namespace {

// The pairs' indices ordered by sender (out-of-range senders last), stably.
at::Tensor sender_order_cpu(const at::Tensor& pairs, int64_t num_nodes) {
  const int64_t length = check_sender_order_op(pairs, num_nodes);
  at::Tensor order = at::empty({length}, pairs.options().dtype(at::kInt));
  if (length == 0) return order;
  const at::Tensor idx = pairs.contiguous();
  const int64_t* senders = idx.const_data_ptr<int64_t>() + length;
  const auto key = [&](int p) { return senders[p] >= 0 && senders[p] < num_nodes ? senders[p] : num_nodes; };
  int* o = order.mutable_data_ptr<int>();
  std::iota(o, o + length, 0);
  std::stable_sort(o, o + length, [&](int a, int b) { return key(a) < key(b); });
  return order;
}

at::Tensor sender_order_meta(const at::Tensor& pairs, int64_t num_nodes) {
  return at::empty({check_sender_order_op(pairs, num_nodes)}, pairs.options().dtype(at::kInt));
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) { m.impl("sender_order", &sender_order_cpu); }
TORCH_LIBRARY_IMPL(mirage, Meta, m) { m.impl("sender_order", &sender_order_meta); }

}  // namespace mirage::ops
