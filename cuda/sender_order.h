// When a pass over a pair list should walk it in sender order (pair_order.cuh): the rule the
// CUDA backwards follow and the shape of mirage::sender_order's result on every backend, so it
// lives here, free of CUDA and torch headers (CPU-only builds include it too).
#pragma once

#include <cstdint>

#include "host_device.h"

namespace mirage::cuda {

// Fewer pairs than this scatter directly: the kernels the ordering takes cost more than the
// atomics they save (a small molecule's pass is a few µs).
constexpr int64_t kSenderOrderMinPairs = 8192;

// The order is int32, and the sort's and the check's kernels step through the list by int grid
// strides (at most 2^19 in pair_order.cu): the list leaves them that much headroom.
constexpr int64_t kSenderOrderMaxPairs = INT32_MAX - (int64_t{1} << 20);

// Whether a pass over num_pairs pairs of `nodes` nodes should walk them in sender order: enough
// pairs for it to pay, and counts that fit the int32 the ordering uses.
inline bool use_sender_order(int64_t nodes, int64_t num_pairs) {
  return num_pairs >= kSenderOrderMinPairs && num_pairs <= kSenderOrderMaxPairs && nodes < INT32_MAX;
}

// How many pairs of a list of num_pairs a pass walks when the caller gives neighbor_list's true
// count (its padding, positions count to num_pairs, skipped): the count, or every pair where the
// count is negative (neighbor_list's NaN case, whose NaN must still reach the outputs) or past
// num_pairs (an overflow, whose list is full).
MIRAGE_HOST_DEVICE inline int64_t walked_pairs(int64_t count, int64_t num_pairs) {
  return count >= 0 && count < num_pairs ? count : num_pairs;
}

}  // namespace mirage::cuda
