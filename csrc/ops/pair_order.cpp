// mirage::sender_order: checks, the CPU reference and the Meta kernel; the checks of the ops'
// `sender_order` argument.
#include "pair_order.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "../../cuda/sender_order.h"
#include "checks.h"
#include "message.h"

namespace mirage::ops {

int64_t check_sender_order_op(const at::Tensor& pairs, int64_t num_nodes, const std::optional<at::Tensor>& num_pairs) {
  MIRAGE_CHECK(pairs.scalar_type() == at::kLong, kSenderOrder, ": pairs must be int64, got ", pairs.scalar_type());
  MIRAGE_CHECK(pairs.dim() == 2 && pairs.size(0) == 2, kSenderOrder, ": pairs must be [2, P], got ", pairs.sizes());
  MIRAGE_CHECK(num_nodes >= 0, kSenderOrder, ": num_nodes must be >= 0, got ", num_nodes);
  check_pair_count(kSenderOrder, num_pairs, pairs);
  return cuda::use_sender_order(num_nodes, pairs.size(1)) ? pairs.size(1) : 0;
}

void check_pair_count(std::string_view op, const std::optional<at::Tensor>& num_pairs, const at::Tensor& pairs) {
  if (!present(num_pairs)) return;
  MIRAGE_CHECK(num_pairs->device() == pairs.device(), op, ": num_pairs must be on pairs' device (", pairs.device(),
               "), got ", num_pairs->device());
  MIRAGE_CHECK(num_pairs->scalar_type() == at::kLong && num_pairs->numel() == 1, op,
               ": num_pairs must be one int64 (neighbor_list's count), got ", num_pairs->scalar_type(), " of shape ",
               num_pairs->sizes());
}

at::Tensor walked_mask(const at::Tensor& num_pairs, int64_t P) {
  const at::Tensor count = num_pairs.reshape({});
  const at::Tensor walked = at::where((count >= 0) & (count < P), count, P);  // cuda::walked_pairs
  return at::arange(P, num_pairs.options()) < walked;
}

int64_t walked_pairs_on_cpu(const std::optional<at::Tensor>& num_pairs, int64_t P) {
  return present(num_pairs) ? cuda::walked_pairs(num_pairs->item<int64_t>(), P) : P;
}

void check_sender_order(std::string_view op, const std::optional<at::Tensor>& order, const at::Tensor& pairs,
                        const std::optional<at::Tensor>& num_pairs) {
  if (!present(order)) return;
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
    const int64_t walked = walked_pairs_on_cpu(num_pairs, P);
    std::vector<bool> seen(P, false);
    for (int64_t k = 0; k < P; ++k) {
      MIRAGE_CHECK(o[k] >= 0 && o[k] < P && !seen[o[k]], op,
                   ": sender_order must be a permutation of [0, P), but sender_order[", k, "] = ", o[k],
                   o[k] >= 0 && o[k] < P ? " appears twice" : " is out of range");
      MIRAGE_CHECK((k < walked) == (o[k] < walked), op, ": sender_order must keep the ", walked,
                   " counted pairs (num_pairs) before the padding, but sender_order[", k, "] = ", o[k],
                   " (form it with mirage::sender_order(pairs, N, num_pairs))");
      seen[o[k]] = true;
    }
  }
}

at::Tensor given_sender_order(const std::optional<at::Tensor>& order) {
  return present(order) && order->numel() != 0 ? order->contiguous() : at::Tensor();
}

namespace {

// The pairs' indices ordered by sender, stably: out-of-range senders after the others, the
// padding past num_pairs last.
at::Tensor sender_order_cpu(const at::Tensor& pairs, int64_t num_nodes, const std::optional<at::Tensor>& num_pairs) {
  const int64_t length = check_sender_order_op(pairs, num_nodes, num_pairs);
  at::Tensor order = at::empty({length}, pairs.options().dtype(at::kInt));
  if (length == 0) return order;
  const at::Tensor idx = pairs.contiguous();
  const int64_t* senders = idx.const_data_ptr<int64_t>() + length;
  const int64_t walked = walked_pairs_on_cpu(num_pairs, length);
  const auto key = [&](int p) {
    if (p >= walked) return num_nodes + 1;
    return senders[p] >= 0 && senders[p] < num_nodes ? senders[p] : num_nodes;
  };
  int* o = order.mutable_data_ptr<int>();
  std::iota(o, o + length, 0);
  std::stable_sort(o, o + length, [&](int a, int b) { return key(a) < key(b); });
  return order;
}

at::Tensor sender_order_meta(const at::Tensor& pairs, int64_t num_nodes, const std::optional<at::Tensor>& num_pairs) {
  return at::empty({check_sender_order_op(pairs, num_nodes, num_pairs)}, pairs.options().dtype(at::kInt));
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) { m.impl("sender_order", &sender_order_cpu); }
TORCH_LIBRARY_IMPL(mirage, Meta, m) { m.impl("sender_order", &sender_order_meta); }

}  // namespace mirage::ops
