// The pairs of a pair list grouped by sender, for backward passes that scatter onto senders.
// Host-includable.
//
// Pair lists from mirage::neighbor_list come sorted by receiver, so a forward pass sums a run of
// equal receivers in registers and meets memory with one atomic per run. Its backward scatters
// onto the senders, which such a list visits in no useful order: one atomic per pair and feature,
// and at 3,000 atoms those atomics were most of PaiNN's message backward on the H200
// (docs/perf/forcefield.md). Walking the pairs in sender order gives the backward the same runs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

// Fewer pairs than this scatter directly: the kernels the ordering takes cost more than the
// atomics they save (a small molecule's pass is a few µs).
constexpr int64_t kSenderOrderMinPairs = 8192;

// Whether a pass over num_pairs pairs of nodes nodes should walk them in sender order: enough
// pairs for it to pay, and counts that fit the int32 the ordering uses.
bool use_sender_order(int64_t nodes, int64_t num_pairs);

// Bytes of device scratch launch_sender_order needs, order included (0 where use_sender_order is
// false).
size_t sender_order_workspace_bytes(int64_t nodes, int64_t num_pairs);

// Writes into `workspace` (sender_order_workspace_bytes of it, 256-byte aligned) a permutation
// `*order` of [0, num_pairs): the pair indices grouped by sender (pairs[1], that is pairs[num_pairs
// + p]) in increasing order, in no particular order within a sender's run (pair_order.cu); pairs
// whose sender lies outside [0, nodes) come last (their kernels skip them). Where
// use_sender_order(nodes, num_pairs) is false, *order = nullptr: walk the list in its own order.
cudaError_t launch_sender_order(const int64_t* pairs, int64_t nodes, int64_t num_pairs, void* workspace,
                                const int** order, cudaStream_t stream);

}  // namespace mirage::cuda
