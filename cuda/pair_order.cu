// Sender order by cub's radix sort of (sender, pair index) on the sender's bits only: stable, so
// the order itself is the same from run to run (pairs of one sender keep their list order). The
// backward's sums are not: a sender's pairs span several warps, whose atomics land in any order.
// One kernel writes the keys and indices, cub sorts (a few kernels, on about 12 bits for a few
// thousand atoms).
#include <climits>

#include <cub/device/device_radix_sort.cuh>

#include "kernel_utils.cuh"
#include "pair_order.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 256;

// keys[p]: the sender of pair p, or `nodes` for one out of range; indices[p] = p.
__global__ void sender_keys_kernel(const int64_t* senders, int64_t nodes, int num_pairs, int* keys, int* indices) {
  for (int64_t p = blockIdx.x * blockDim.x + threadIdx.x; p < num_pairs; p += gridDim.x * blockDim.x) {
    const int64_t j = senders[p];
    keys[p] = j >= 0 && j < nodes ? static_cast<int>(j) : static_cast<int>(nodes);
    indices[p] = static_cast<int>(p);
  }
}

struct Plan {
  int *keys, *sorted_keys, *indices, *order;
  void* sort_temp;
  size_t sort_bytes;
  int key_bits;  // enough for the keys 0..nodes
  size_t total_bytes;
};

Plan plan(int64_t nodes, int64_t num_pairs, char* base) {
  Plan w{};
  WorkspaceLayout layout(base);
  const size_t bytes = static_cast<size_t>(num_pairs) * sizeof(int);
  w.keys = static_cast<int*>(layout.take(bytes));
  w.sorted_keys = static_cast<int*>(layout.take(bytes));
  w.indices = static_cast<int*>(layout.take(bytes));
  w.order = static_cast<int*>(layout.take(bytes));
  w.key_bits = 1;
  while ((int64_t{1} << w.key_bits) <= nodes) ++w.key_bits;
  cub::DeviceRadixSort::SortPairs(nullptr, w.sort_bytes, w.keys, w.sorted_keys, w.indices, w.order,
                                  static_cast<int>(num_pairs), 0, w.key_bits);
  w.sort_temp = layout.take(w.sort_bytes);
  w.total_bytes = layout.bytes();
  return w;
}

}  // namespace

bool use_sender_order(int64_t nodes, int64_t num_pairs) {
  return num_pairs >= kSenderOrderMinPairs && num_pairs <= INT_MAX && nodes < INT_MAX;
}

size_t sender_order_workspace_bytes(int64_t nodes, int64_t num_pairs) {
  return plan(nodes, num_pairs, nullptr).total_bytes;
}

cudaError_t launch_sender_order(const int64_t* pairs, int64_t nodes, int64_t num_pairs, void* workspace,
                                const int** order, cudaStream_t stream) {
  if (!use_sender_order(nodes, num_pairs)) return cudaErrorInvalidValue;
  Plan w = plan(nodes, num_pairs, static_cast<char*>(workspace));  // cub takes sort_bytes by reference
  const int count = static_cast<int>(num_pairs);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(count, kThreads), 8LL * sm_count()));
  sender_keys_kernel<<<blocks, kThreads, 0, stream>>>(pairs + num_pairs, nodes, count, w.keys, w.indices);
  const cudaError_t status = cub::DeviceRadixSort::SortPairs(w.sort_temp, w.sort_bytes, w.keys, w.sorted_keys,
                                                             w.indices, w.order, count, 0, w.key_bits, stream);
  if (status != cudaSuccess) return status;
  *order = w.order;
  return cudaGetLastError();
}

}  // namespace mirage::cuda
