// When a pass over a pair list should walk it in sender order (pair_order.cuh): the rule the
// CUDA backwards follow and the shape of mirage::sender_order's result on every backend, so it
// lives here, free of CUDA and torch headers (CPU-only builds include it too).
#pragma once

#include <cstdint>

namespace mirage::cuda {

// Fewer pairs than this scatter directly: the kernels the ordering takes cost more than the
// atomics they save (a small molecule's pass is a few µs).
constexpr int64_t kSenderOrderMinPairs = 8192;

// The order is int32; the counting sort rounds the list up to whole chunks of pairs.
constexpr int64_t kSenderOrderMaxPairs = INT32_MAX - 4096;

// Whether a pass over num_pairs pairs of `nodes` nodes should walk them in sender order: enough
// pairs for it to pay, and counts that fit the int32 the ordering uses.
inline bool use_sender_order(int64_t nodes, int64_t num_pairs) {
  return num_pairs >= kSenderOrderMinPairs && num_pairs <= kSenderOrderMaxPairs && nodes < INT32_MAX;
}

}  // namespace mirage::cuda
