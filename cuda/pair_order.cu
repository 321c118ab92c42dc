// Sender order: a counting sort for up to kCountingMaxNodes nodes, cub's radix sort beyond.
//
// The counting sort: each block counts its chunk of pairs by sender in a shared-memory
// histogram, an exclusive scan over the [sender][block] counts gives each block its start in
// each sender's run, and the block scatters its chunk there. Equal senders keep the blocks'
// order; within one block's chunk their order is the atomics' (the consumers need runs, not a
// particular order in a run). On the 3,000-atom box's 173,888 pairs (H200, 2026-11-27) it takes
// ~18 us (count 8, scan 4, scatter 6) where cub's radix sort (a key kernel and two onesweep
// passes over 12 bits) took ~28, as did a counting sort with global atomics (neighbouring pairs
// share senders, so they contended); 4,096-pair chunks of 1,024 threads were slower (scatter 11
// us), and ranks within a warp by __match_any_sync slightly (count 9, scatter 7).
#include <algorithm>
#include <climits>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "kernel_utils.cuh"
#include "pair_order.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 256;

// The counting sort's sizes: pairs a block and its threads; the histogram of nodes + 2 keys in
// the default 48 KB of shared memory.
constexpr int kChunk = 2048;
constexpr int kCountThreads = 512;
constexpr int64_t kCountingMaxNodes = 48 * 1024 / sizeof(int) - 2;
// The grid-stride kernels' blocks (sender_keys_kernel, check_order_kernel): few enough that
// their int indices never pass INT_MAX on the lists use_sender_order admits.
constexpr int64_t kMaxStrideBlocks = 2048;
static_assert(kSenderOrderMaxPairs <= INT_MAX - kChunk, "the last chunk's indices must fit an int");
static_assert(kSenderOrderMaxPairs <= INT_MAX - kMaxStrideBlocks * kThreads, "grid strides must fit an int");

// The sort's keys: pair p's sender; `nodes` for one out of range; `nodes + 1` for padding, the
// pairs from the caller's count on (neighbor_list's num_pairs; none without one), which so come
// last, after every pair that is walked (sender_order.h's walked_pairs).
struct SortKeys {
  const int64_t* senders;
  int nodes, walked;
  __device__ SortKeys(const int64_t* pairs, int64_t nodes, int num_pairs, const int64_t* live)
      : senders(pairs + num_pairs),
        nodes(static_cast<int>(nodes)),
        walked(static_cast<int>(pairs_to_walk(live, num_pairs))) {}
  __device__ int padding() const { return nodes + 1; }
  __device__ int operator()(int p) const {
    if (p >= walked) return padding();
    const int64_t j = senders[p];
    return j >= 0 && j < nodes ? static_cast<int>(j) : nodes;
  }
};

__global__ void sender_keys_kernel(const int64_t* pairs, int64_t nodes, int num_pairs, const int64_t* live, int* keys,
                                   int* indices) {
  const SortKeys key(pairs, nodes, num_pairs, live);
  for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < num_pairs; p += gridDim.x * blockDim.x) {
    keys[p] = key(p);
    indices[p] = p;
  }
}

// Takes one slot of slots[key] for each lane with key >= 0 and returns it: one shared atomic a
// lane (neighbouring pairs of a receiver-sorted list have distinct senders), one a warp for the
// padding (padding_key), its lanes in order: padding fills whole warps at the list's end. Without
// a count, neighbor_list's padding pairs (0, 0) are sender 0 for every lane of their warps, and
// those atomics serialize (~18 us a sort on the 3,000-atom box with them, against ~20 with every
// warp's equal keys combined by __match_any_sync). Every lane of the warp calls it.
__device__ __forceinline__ int take_slot(int* slots, int key, int padding_key) {
  const int lane = threadIdx.x % 32;
  const unsigned padding = __ballot_sync(0xffffffffu, key == padding_key);
  int slot = 0;
  if (key >= 0 && key != padding_key) slot = atomicAdd(&slots[key], 1);
  const int leader = padding != 0 ? __ffs(padding) - 1 : 0;
  int base = 0;
  if (padding != 0 && lane == leader) base = atomicAdd(&slots[padding_key], __popc(padding));
  base = __shfl_sync(0xffffffffu, base, leader);
  return key == padding_key ? base + __popc(padding & ((1u << lane) - 1u)) : slot;
}

// Walks block b's chunk: visit(key, p) for each of its pairs (key -1 past the list's end, p
// then meaningless); the same trip count in every warp.
template <class Visit>
__device__ __forceinline__ void walk_chunk(const SortKeys& key, int num_pairs, Visit visit) {
  const int begin = blockIdx.x * kChunk;
  for (int p = begin + threadIdx.x; p < begin + kChunk; p += blockDim.x) visit(p < num_pairs ? key(p) : -1, p);
}

// counts[key * gridDim.x + b]: how many pairs of block b's chunk have that key.
__global__ void __launch_bounds__(kCountThreads) count_senders_kernel(const int64_t* pairs, int nodes, int num_pairs,
                                                                      const int64_t* live, int* counts) {
  extern __shared__ int histogram[];
  const SortKeys key(pairs, nodes, num_pairs, live);
  for (int k = threadIdx.x; k <= key.padding(); k += blockDim.x) histogram[k] = 0;
  __syncthreads();
  walk_chunk(key, num_pairs, [&](int k, int) { take_slot(histogram, k, key.padding()); });
  __syncthreads();
  for (int k = threadIdx.x; k <= key.padding(); k += blockDim.x) counts[k * gridDim.x + blockIdx.x] = histogram[k];
}

// order[starts[key * gridDim.x + b] + rank] = p for block b's pairs, starts the counts' exclusive scan.
__global__ void __launch_bounds__(kCountThreads) scatter_pairs_kernel(const int64_t* pairs, int nodes, int num_pairs,
                                                                      const int64_t* live, const int* starts,
                                                                      int* order) {
  extern __shared__ int next[];
  const SortKeys key(pairs, nodes, num_pairs, live);
  for (int k = threadIdx.x; k <= key.padding(); k += blockDim.x) next[k] = starts[k * gridDim.x + blockIdx.x];
  __syncthreads();
  walk_chunk(key, num_pairs, [&](int k, int p) {
    const int slot = take_slot(next, k, key.padding());
    if (k >= 0) order[slot] = p;
  });
}

// The counting sort's [key][block] counts are (nodes + 2) ints a chunk (at most 6 a pair).
bool counting(int64_t nodes, int64_t num_pairs) {
  return nodes <= kCountingMaxNodes && (nodes + 2) * ceil_div(num_pairs, kChunk) <= INT_MAX;
}

// The scratch of either sort; sizes only on base == nullptr (cub's temporary bytes included).
struct Plan {
  int *keys, *sorted_keys, *indices;  // the radix sort's
  int *counts, *starts;               // the counting sort's
  int blocks, entries;                // the counting sort's chunks and counts ((nodes + 2) blocks)
  void* temp;                         // cub's
  size_t temp_bytes;
  int key_bits;  // the radix sort's: enough for the keys 0..nodes + 1
  size_t total_bytes;
};

Plan plan(int64_t nodes, int64_t num_pairs, char* base) {
  Plan w{};
  WorkspaceLayout layout(base);
  const int count = static_cast<int>(num_pairs);
  if (counting(nodes, num_pairs)) {
    w.blocks = static_cast<int>(ceil_div(num_pairs, kChunk));
    w.entries = static_cast<int>((nodes + 2) * w.blocks);
    w.counts = static_cast<int*>(layout.take(w.entries * sizeof(int)));
    w.starts = static_cast<int*>(layout.take(w.entries * sizeof(int)));
    cub::DeviceScan::ExclusiveSum(nullptr, w.temp_bytes, w.counts, w.starts, w.entries);
  } else {
    for (int** array : {&w.keys, &w.sorted_keys, &w.indices}) *array = static_cast<int*>(layout.take(num_pairs * sizeof(int)));
    w.key_bits = 1;
    while ((int64_t{1} << w.key_bits) <= nodes + 1) ++w.key_bits;
    int* order = nullptr;  // sizing only
    cub::DeviceRadixSort::SortPairs(nullptr, w.temp_bytes, w.keys, w.sorted_keys, w.indices, order, count, 0,
                                    w.key_bits);
  }
  w.temp = layout.take(w.temp_bytes);
  w.total_bytes = layout.bytes();
  return w;
}

// splitmix64's finalizer: a bijection of 64-bit words whose outputs look independent, so that
// two different multisets of indices have the same sum of h with probability about 2^-64.
__device__ __forceinline__ unsigned long long mix(unsigned long long z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A grid of at most this many blocks checks a given order, so that the backward's last kernel
// sums few balances.
constexpr int kMaxCheckBlocks = 512;
static_assert(kMaxCheckBlocks <= kMaxStrideBlocks, "the check's grid strides must fit an int");

// order[k] = given[k] (0 where out of range), balances[block] = its positions' sum of
// h(k) - h(given[k]) (an out-of-range entry unbalances it like any other stray index). With the
// caller's count the walk stops at walked_pairs, so the positions before it must hold exactly
// the pairs before it: there h(x) = mix(x), from it on mix(~x), and a pair on the wrong side
// unbalances the sum too. No atomics and nothing to zero first: the balances are summed where
// they are read (OrderCheck).
__global__ void __launch_bounds__(kThreads) check_order_kernel(const int* given, int num_pairs, const int64_t* live,
                                                               int* order, unsigned long long* balances) {
  const int walked = static_cast<int>(pairs_to_walk(live, num_pairs));
  const auto h = [walked](int position, unsigned long long x) { return mix(position < walked ? x : ~x); };
  unsigned long long balance = 0;
  for (int k = blockIdx.x * kThreads + threadIdx.x; k < num_pairs; k += gridDim.x * kThreads) {
    const int p = given[k];
    order[k] = p >= 0 && p < num_pairs ? p : 0;
    balance += h(k, k) - h(k, p);
  }
  __shared__ unsigned long long scratch[32];
  balance = block_sum(balance, scratch);
  if (threadIdx.x == 0) balances[blockIdx.x] = balance;
}

// A backward's workspace: the order its walk reads, and the check's balances of a given order or
// else the sort's scratch.
struct BackwardLayout {
  int* order;
  unsigned long long* balances = nullptr;
  void* scratch = nullptr;
  size_t bytes;
  BackwardLayout(int64_t nodes, int64_t num_pairs, bool given, char* base) {
    WorkspaceLayout layout(base);
    order = static_cast<int*>(layout.take(num_pairs * sizeof(int)));
    if (given) {
      balances = static_cast<unsigned long long*>(layout.take(kMaxCheckBlocks * sizeof(unsigned long long)));
    } else {
      scratch = layout.take(sort_by_sender_scratch_bytes(nodes, num_pairs));
    }
    bytes = layout.bytes();
  }
};

}  // namespace

size_t sort_by_sender_scratch_bytes(int64_t nodes, int64_t num_pairs) {
  return plan(nodes, num_pairs, nullptr).total_bytes;
}

cudaError_t sort_by_sender(const int64_t* pairs, int64_t nodes, int64_t num_pairs, const int64_t* live, int* order,
                           void* scratch, cudaStream_t stream) {
  if (!use_sender_order(nodes, num_pairs)) return cudaErrorInvalidValue;
  Plan w = plan(nodes, num_pairs, static_cast<char*>(scratch));  // cub takes temp_bytes by reference
  const int count = static_cast<int>(num_pairs);
  cudaError_t status;
  if (counting(nodes, num_pairs)) {
    const int n = static_cast<int>(nodes);
    const size_t histogram_bytes = (nodes + 2) * sizeof(int);
    count_senders_kernel<<<w.blocks, kCountThreads, histogram_bytes, stream>>>(pairs, n, count, live, w.counts);
    status = cub::DeviceScan::ExclusiveSum(w.temp, w.temp_bytes, w.counts, w.starts, w.entries, stream);
    if (status != cudaSuccess) return status;
    scatter_pairs_kernel<<<w.blocks, kCountThreads, histogram_bytes, stream>>>(pairs, n, count, live, w.starts,
                                                                               order);
  } else {
    const unsigned blocks =
        static_cast<unsigned>(std::min<int64_t>({ceil_div(count, kThreads), 8LL * sm_count(), kMaxStrideBlocks}));
    sender_keys_kernel<<<blocks, kThreads, 0, stream>>>(pairs, nodes, count, live, w.keys, w.indices);
    status = cub::DeviceRadixSort::SortPairs(w.temp, w.temp_bytes, w.keys, w.sorted_keys, w.indices, order, count,
                                             0, w.key_bits, stream);
    if (status != cudaSuccess) return status;
  }
  return cudaGetLastError();
}

size_t sender_order_workspace_bytes(int64_t nodes, int64_t num_pairs, bool given) {
  return use_sender_order(nodes, num_pairs) ? BackwardLayout(nodes, num_pairs, given, nullptr).bytes : 0;
}

cudaError_t launch_sender_order(const int64_t* pairs, int64_t nodes, int64_t num_pairs, const int64_t* live,
                                const int* given, void* workspace, SenderOrder* walk, cudaStream_t stream) {
  *walk = SenderOrder{};
  if (!use_sender_order(nodes, num_pairs)) return cudaSuccess;
  const BackwardLayout w(nodes, num_pairs, given != nullptr, static_cast<char*>(workspace));
  if (given == nullptr) {
    const cudaError_t status = sort_by_sender(pairs, nodes, num_pairs, live, w.order, w.scratch, stream);
    if (status == cudaSuccess) walk->order = w.order;
    return status;
  }
  const int blocks = static_cast<int>(std::min<int64_t>({ceil_div(num_pairs, kThreads), 2LL * sm_count(),
                                                         int64_t{kMaxCheckBlocks}}));
  check_order_kernel<<<blocks, kThreads, 0, stream>>>(given, static_cast<int>(num_pairs), live, w.order,
                                                      w.balances);
  *walk = SenderOrder{w.order, OrderCheck{w.balances, blocks}};
  return cudaGetLastError();
}

}  // namespace mirage::cuda
