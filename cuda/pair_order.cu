// Sender order by counting sort: a histogram of senders, its exclusive scan, then each pair takes
// the next slot of its sender's range. Four launches (a memset, two kernels, cub's scan) whatever
// the size.
#include <climits>

#include <cub/device/device_scan.cuh>

#include "kernel_utils.cuh"
#include "pair_order.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 256;

// The bucket of a sender: itself, or `nodes` for one out of range.
__device__ __forceinline__ int bucket(int64_t sender, int64_t nodes) {
  return sender >= 0 && sender < nodes ? static_cast<int>(sender) : static_cast<int>(nodes);
}

__global__ void count_senders_kernel(const int64_t* senders, int64_t nodes, int num_pairs, int* counts) {
  for (int64_t p = blockIdx.x * blockDim.x + threadIdx.x; p < num_pairs; p += gridDim.x * blockDim.x)
    atomicAdd(counts + bucket(senders[p], nodes), 1);
}

__global__ void place_pairs_kernel(const int64_t* senders, int64_t nodes, int num_pairs, int* next_slot,
                                   int* order) {
  for (int64_t p = blockIdx.x * blockDim.x + threadIdx.x; p < num_pairs; p += gridDim.x * blockDim.x)
    order[atomicAdd(next_slot + bucket(senders[p], nodes), 1)] = static_cast<int>(p);
}

// The workspace's parts: counts and slots have a bucket per node plus one for bad senders.
struct Plan {
  int* counts;
  int* next_slot;
  int* order;
  void* scan_temp;
  size_t scan_bytes;
  size_t total_bytes;
};

Plan plan(int64_t nodes, int64_t num_pairs, char* base) {
  Plan w{};
  size_t offset = 0;
  const auto take = [&](size_t bytes) -> void* {
    offset = (offset + 255) / 256 * 256;
    void* at = base == nullptr ? nullptr : base + offset;
    offset += bytes;
    return at;
  };
  const int buckets = static_cast<int>(nodes) + 1;
  w.counts = static_cast<int*>(take(buckets * sizeof(int)));
  w.next_slot = static_cast<int*>(take(buckets * sizeof(int)));
  w.order = static_cast<int*>(take(static_cast<size_t>(num_pairs) * sizeof(int)));
  cub::DeviceScan::ExclusiveSum(nullptr, w.scan_bytes, w.counts, w.next_slot, buckets);
  w.scan_temp = take(w.scan_bytes);
  w.total_bytes = offset;
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
  Plan w = plan(nodes, num_pairs, static_cast<char*>(workspace));  // cub takes scan_bytes by reference
  const int buckets = static_cast<int>(nodes) + 1, count = static_cast<int>(num_pairs);
  const int64_t* senders = pairs + num_pairs;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(count, kThreads), 8LL * sm_count()));
  cudaError_t status = cudaMemsetAsync(w.counts, 0, buckets * sizeof(int), stream);
  if (status != cudaSuccess) return status;
  count_senders_kernel<<<blocks, kThreads, 0, stream>>>(senders, nodes, count, w.counts);
  status = cub::DeviceScan::ExclusiveSum(w.scan_temp, w.scan_bytes, w.counts, w.next_slot, buckets, stream);
  if (status != cudaSuccess) return status;
  place_pairs_kernel<<<blocks, kThreads, 0, stream>>>(senders, nodes, count, w.next_slot, w.order);
  *order = w.order;
  return cudaGetLastError();
}

}  // namespace mirage::cuda
