// The pair geometry and its gradient: one thread per pair. The backward scatters with float32
// atomics, one per run of equal atoms (receivers in list order, senders in sender order), where
// PyTorch's index_select backward (index_add of [2P, 3] rows) took 131 us for the 139k pairs of
// a 3,000-atom box on an H200.
#include <algorithm>
#include <cstdint>

#include "kernel_utils.cuh"
#include "pair_order.cuh"
#include "pair_vectors.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ bool in_range(int64_t k, int64_t n) { return k >= 0 && k < n; }

// Pair p's vector (false when an index is out of range).
__device__ __forceinline__ bool pair_vector(const float* positions, const int64_t* pairs, const float* shifts,
                                            int64_t N, int64_t P, int64_t p, int64_t& i, int64_t& j,
                                            float (&v)[3]) {
  i = pairs[p];
  j = pairs[P + p];
  if (!in_range(i, N) || !in_range(j, N)) return false;
#pragma unroll
  for (int c = 0; c < 3; ++c) v[c] = positions[3 * j + c] - positions[3 * i + c] + (shifts ? shifts[3 * p + c] : 0.0f);
  return true;
}

__global__ void __launch_bounds__(kThreads) pair_vectors_kernel(PairVectorsParams p) {
  start_after_prior_grid();
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (k >= p.num_pairs) return;
  int64_t i, j;
  float v[3];
  if (!pair_vector(p.positions, p.pairs, p.shifts, p.num_atoms, p.num_pairs, k, i, j, v)) {
    const float nan = __int_as_float(0x7fc00000);
    v[0] = v[1] = v[2] = nan;
  }
#pragma unroll
  for (int c = 0; c < 3; ++c) p.vectors[3 * k + c] = v[c];
  p.distances[k] = sqrtf(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
}

// Adds g to atom k's row of the [N, 4] float32 accumulator: one 16-byte atomic on sm_90 (a third
// of the atomic operations, which bound this kernel), three elsewhere.
__device__ __forceinline__ void add_row(float4* acc, int64_t k, const float (&g)[3], float sign) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(acc + k, make_float4(sign * g[0], sign * g[1], sign * g[2], 0.0f));
#else
  float* row = reinterpret_cast<float*>(acc + k);
  for (int c = 0; c < 3; ++c) atomicAdd(row + c, sign * g[c]);
#endif
}

// Pair k's term of the gradient, g (0 for k >= P), and its atoms i, j (-1 for k >= P or for an
// out-of-range index, which also sets *invalid).
__device__ __forceinline__ void pair_gradient(const PairVectorsBackwardParams& p, int64_t k, int* invalid,
                                              int64_t& i, int64_t& j, float (&g)[3]) {
  i = j = -1;
  g[0] = g[1] = g[2] = 0.0f;
  if (k >= p.num_pairs) return;
  float v[3];
  if (!pair_vector(p.positions, p.pairs, p.shifts, p.num_atoms, p.num_pairs, k, i, j, v)) {
    *invalid = 1;
    i = j = -1;
    return;
  }
  const float d = sqrtf(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
  // The distance's gradient is taken as 0 at d = 0, as PyTorch's vector_norm does (only there: a
  // NaN distance passes NaN on).
  const float radial = p.grad_distances != nullptr && d != 0.0f ? p.grad_distances[k] / d : 0.0f;
#pragma unroll
  for (int c = 0; c < 3; ++c)  // a missing gradient adds nothing (no 0 * NaN), as the CPU reference
    g[c] = (p.grad_vectors != nullptr ? p.grad_vectors[3 * k + c] : 0.0f) +
           (p.grad_distances != nullptr ? radial * v[c] : 0.0f);
}

// add(atom, sum, sign) once for each run of equal atoms among the warp's lanes (atom -1: nothing),
// the run's g summed by shuffles: atomics on one address serialize, and a pair list's neighbours
// share atoms (every lane of the warp calls it). Any order stays correct: a lane whose neighbours
// differ adds its own value.
template <class Add>
__device__ __forceinline__ void add_runs(int64_t atom, float (&g)[3], float sign, Add add) {
  const int lane = threadIdx.x % 32;
  // A run starts where the atom differs from the lane before.
  const int64_t before = __shfl_up_sync(0xffffffffu, atom, 1);
  const unsigned starts = __ballot_sync(0xffffffffu, lane == 0 || before != atom);
  const unsigned later = starts & ~((2u << lane) - 1u);  // starts after this lane (lane 31: none)
  const int run_end = (lane == 31 || later == 0) ? 31 : __ffs(later) - 2;
  // Suffix sums within the run (Hillis-Steele): after the loop a run's first lane holds its sum.
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
#pragma unroll
    for (int c = 0; c < 3; ++c) {
      const float other = __shfl_down_sync(0xffffffffu, g[c], offset);
      if (lane + offset <= run_end) g[c] += other;
    }
  }
  if (atom >= 0 && (starts >> lane & 1u)) add(atom, g, sign);
}

// Position k of the walks over the pairs: the receivers i from list order (neighbor_list sorts by
// i, ~46 pairs an atom at 3,000 atoms), the senders j from `order` (pair_order.cuh), so that both
// sides meet memory once a run. Without an order (short lists) each sender gets one atomic a
// pair: in list order neighbouring pairs' senders are neighbouring atoms, and in a 3,000-atom
// water box (atoms numbered along the lattice) their atomics contended: the backward took 66 us
// that way, 9 us in sender order (plus the order's ~18; H200, 2026-11-27).
template <class Add>
__device__ __forceinline__ void backward_position(const PairVectorsBackwardParams& p, int64_t k, const int* order,
                                                  int* invalid, Add add) {
  int64_t i, j;
  float g[3];
  pair_gradient(p, k, invalid, i, j, g);
  if (order == nullptr && j >= 0) add(j, g, 1.0f);
  add_runs(i, g, -1.0f, add);
  if (order == nullptr) return;
  pair_gradient(p, k < p.num_pairs ? order[k] : p.num_pairs, invalid, i, j, g);
  add_runs(j, g, 1.0f, add);
}

__global__ void __launch_bounds__(kThreads) pair_vectors_backward_kernel(PairVectorsBackwardParams p,
                                                                         const int* order,  // [P] or null
                                                                         float4* acc,   // [N] rows, zeroed
                                                                         int* invalid) {  // [1], zeroed
  start_after_prior_grid();
  backward_position(p, static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x, order, invalid,
                    [acc](int64_t atom, const float (&g)[3], float sign) { add_row(acc, atom, g, sign); });
}

// The [N, 4] accumulator into the [N, 3] gradient; NaN everywhere after an out-of-range index or
// a handed-in sender order that failed its check.
__global__ void __launch_bounds__(kThreads) pair_vectors_finish_kernel(const float4* acc,  // [N]
                                                                       const int* invalid,  // [1]
                                                                       OrderCheck check,
                                                                       float* grad,         // [N, 3] out
                                                                       int64_t values) {    // 3N
  start_after_prior_grid();
  const bool rejected = order_rejected(check);  // a barrier: every thread, before the early return
  const bool bad = *invalid != 0 || rejected;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= values) return;
  grad[e] = bad ? __int_as_float(0x7fc00000) : reinterpret_cast<const float*>(acc + e / 3)[e % 3];
}

// Small systems: the whole backward in one block, the accumulator in shared memory: one launch
// where the grid takes three (a memset, the scatter and the conversion), each of which costs a
// CUDA graph 1-2 us however little it does (benzene: 12 atoms, 132 pairs).
constexpr int kOneBlockMaxAtoms = 1024;
constexpr int64_t kOneBlockMaxPairs = 8192;
constexpr int kOneBlockThreads = 1024;

__global__ void __launch_bounds__(kOneBlockThreads)
    pair_vectors_backward_one_block_kernel(PairVectorsBackwardParams p) {
  start_after_prior_grid();
  __shared__ float acc[3 * kOneBlockMaxAtoms];
  __shared__ int invalid;
  const int values = static_cast<int>(3 * p.num_atoms);
  for (int e = threadIdx.x; e < values; e += blockDim.x) acc[e] = 0.0f;
  if (threadIdx.x == 0) invalid = 0;
  __syncthreads();
  for (int64_t k0 = 0; k0 < p.num_pairs; k0 += blockDim.x)  // the same trip count in every warp
    backward_position(p, k0 + threadIdx.x, nullptr, &invalid, [](int64_t atom, const float (&g)[3], float sign) {
      for (int c = 0; c < 3; ++c) atomicAdd(&acc[3 * atom + c], sign * g[c]);
    });
  __syncthreads();
  for (int e = threadIdx.x; e < values; e += blockDim.x)
    p.grad_positions[e] = invalid ? __int_as_float(0x7fc00000) : acc[e];
}

unsigned blocks_for(int64_t pairs) { return static_cast<unsigned>(ceil_div(pairs, kThreads)); }

// The backward's scratch: the flag and the accumulator (16 bytes aligned, zeroed by one memset),
// then the sender order's (none for short lists).
struct BackwardWorkspace {
  int* invalid;
  float4* acc;
  size_t zeroed_bytes;
  void* order;
  size_t bytes;
  BackwardWorkspace(int64_t num_atoms, int64_t num_pairs, bool given_order, char* base) {
    WorkspaceLayout layout(base);
    zeroed_bytes = 16 + static_cast<size_t>(num_atoms) * sizeof(float4);
    char* front = static_cast<char*>(layout.take(zeroed_bytes));
    invalid = reinterpret_cast<int*>(front);
    acc = reinterpret_cast<float4*>(front + 16);
    order = layout.take(sender_order_workspace_bytes(num_atoms, num_pairs, given_order));
    bytes = layout.bytes();
  }
};

}  // namespace

size_t pair_vectors_backward_workspace_bytes(int64_t num_atoms, int64_t num_pairs, bool given_order) {
  return BackwardWorkspace(num_atoms, num_pairs, given_order, nullptr).bytes;
}

cudaError_t launch_pair_vectors(const PairVectorsParams& params, cudaStream_t stream) {
  if (params.num_pairs == 0) return cudaSuccess;
  if (ceil_div(params.num_pairs, kThreads) > INT32_MAX) return cudaErrorInvalidValue;
  return launch_overlapped(pair_vectors_kernel, blocks_for(params.num_pairs), dim3(kThreads), 0, stream, false, params);
}

cudaError_t launch_pair_vectors_backward(const PairVectorsBackwardParams& params, void* workspace,
                                         cudaStream_t stream) {
  const int64_t values = params.num_atoms * 3;
  if (params.num_atoms <= kOneBlockMaxAtoms && params.num_pairs <= kOneBlockMaxPairs) {
    if (values == 0) return cudaSuccess;
    return launch_overlapped(pair_vectors_backward_one_block_kernel, dim3(1), dim3(kOneBlockThreads), 0, stream, false,
                             params);
  }
  if (ceil_div(std::max(params.num_pairs, values), kThreads) > INT32_MAX) return cudaErrorInvalidValue;
  const BackwardWorkspace w(params.num_atoms, params.num_pairs, params.sender_order != nullptr,
                            static_cast<char*>(workspace));
  cudaError_t status = cudaMemsetAsync(workspace, 0, w.zeroed_bytes, stream);
  if (status != cudaSuccess || values == 0) return status;
  SenderOrder walk;  // by sender for long lists, else none
  if (params.num_pairs > 0) {
    status = launch_sender_order(params.pairs, params.num_atoms, params.num_pairs, /*live=*/nullptr,
                                 params.sender_order, w.order, &walk, stream);
    if (status != cudaSuccess) return status;
    status = launch_overlapped(pair_vectors_backward_kernel, blocks_for(params.num_pairs), dim3(kThreads), 0, stream,
                               false, params, walk.order, w.acc, w.invalid);
    if (status != cudaSuccess) return status;
  }
  return launch_overlapped(pair_vectors_finish_kernel, blocks_for(values), dim3(kThreads), 0, stream, false, w.acc,
                           w.invalid, walk.check, params.grad_positions, values);
}

}  // namespace mirage::cuda
