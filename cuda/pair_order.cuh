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
#include "sender_order.h"

namespace mirage::cuda {

// mirage::sender_order's kernels: writes into order[num_pairs] a permutation of [0, num_pairs),
// the pair indices grouped by sender (pairs[1], that is pairs[num_pairs + p]) in increasing order,
// in no particular order within a sender's run (pair_order.cu); pairs whose sender lies outside
// [0, nodes) come after them (their kernels skip them), and last, where `live` (device, [1], or
// null) gives neighbor_list's count, the padding past it (sender_order.h's walked_pairs). Needs
// use_sender_order(nodes, num_pairs) and sort_by_sender_scratch_bytes of `scratch` (256-byte
// aligned).
size_t sort_by_sender_scratch_bytes(int64_t nodes, int64_t num_pairs);
cudaError_t sort_by_sender(const int64_t* pairs, int64_t nodes, int64_t num_pairs, const int64_t* live, int* order,
                           void* scratch, cudaStream_t stream);

// A handed-in order's check (launch_sender_order): per-block partial sums of
// h(k) - h(order[k]) over the positions k, for a 64-bit mixing hash h. Their total is 0 for a
// permutation of [0, num_pairs) (with a count, one that keeps the walked pairs before the
// padding); anything else (an index repeated, missing, out of range or on the wrong side of the
// count) matches with probability about 2^-64. The backward's last kernel adds them up
// (kernel_utils.cuh's order_rejected) and, where the total is not 0, poisons the outputs as for
// a bad index. count == 0: nothing to check.
struct OrderCheck {
  const unsigned long long* balances = nullptr;
  int count = 0;
};

// What a backward walks: `order`, a permutation of [0, num_pairs) (null: the list's own order),
// and the check its results wait on.
struct SenderOrder {
  const int* order = nullptr;
  OrderCheck check;
};

// Bytes of device scratch launch_sender_order needs, order included (0 where use_sender_order is
// false); the sort's scratch only where no order is given (`given`: one will be).
size_t sender_order_workspace_bytes(int64_t nodes, int64_t num_pairs, bool given);

// A backward's walk, in `workspace` (sender_order_workspace_bytes(nodes, num_pairs, given !=
// nullptr) of it, 256-byte aligned):
// where use_sender_order is false, none (list order); else the pairs sorted by sender here (with
// `live` as sort_by_sender takes it), or, where `given` is not null, the caller's order
// (mirage::sender_order's, handed to the op) read instead of sorting again. The walk then reads a
// copy of it (an out-of-range entry copied as 0, so the walk never reads outside the list) and
// the copy's kernel writes the balances of `walk->check`. The sums need only a permutation (the
// grouping by sender is for speed) and, with `live`, one whose positions before walked_pairs hold
// the pairs before it, which the balances check too.
cudaError_t launch_sender_order(const int64_t* pairs, int64_t nodes, int64_t num_pairs, const int64_t* live,
                                const int* given, void* workspace, SenderOrder* walk, cudaStream_t stream);

}  // namespace mirage::cuda
