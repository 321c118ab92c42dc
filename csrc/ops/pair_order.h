// mirage::sender_order, and the `sender_order` argument of the ops whose backward scatters onto
// the senders (pair_vectors, vector_message_passing, cfconv, radial_cfconv): formed once per
// pair list and handed to each of them instead of each backward sorting the same list again.
#pragma once

#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>

namespace mirage::ops {

inline constexpr std::string_view kSenderOrder = "mirage::sender_order";

// The length of sender_order(pairs, num_nodes, num_pairs): P where walking in sender order pays
// (cuda/sender_order.h: P >= 8192), else 0. pairs: [2, P] int64; num_nodes >= 0; num_pairs as
// check_pair_count takes it.
int64_t check_sender_order_op(const at::Tensor& pairs, int64_t num_nodes, const std::optional<at::Tensor>& num_pairs);

// An op's `num_pairs` argument (neighbor_list's count: the pairs past it are padding, skipped):
// absent, or one int64 on pairs' device.
void check_pair_count(std::string_view op, const std::optional<at::Tensor>& num_pairs, const at::Tensor& pairs);

// arange(P) < the walked count, as a bool [P] tensor on num_pairs' device, without reading the count
// on the host (differentiable composites use it as a mask).
at::Tensor walked_mask(const at::Tensor& num_pairs, int64_t P);

// How many of pairs' P pairs a CPU reference walks (cuda/sender_order.h's walked_pairs): P
// without a count. Reads the count (on the CPU).
int64_t walked_pairs_on_cpu(const std::optional<at::Tensor>& num_pairs, int64_t P);

// An op's `sender_order` argument: absent, or int32 of shape [P] or [0] on pairs' device; on
// the CPU a non-empty one must be a permutation of [0, P) and, with the op's num_pairs (checked
// first), keep the counted pairs before the count (the CPU references sum in their own order and
// do not read it; the CUDA kernels check the same on the device, see pair_order.cuh).
void check_sender_order(std::string_view op, const std::optional<at::Tensor>& order, const at::Tensor& pairs,
                        const std::optional<at::Tensor>& num_pairs = std::nullopt);

// The given order as the CUDA launchers take it: contiguous, or undefined where absent or empty
// (the backward then sorts the list itself where that pays).
at::Tensor given_sender_order(const std::optional<at::Tensor>& order);

}  // namespace mirage::ops
