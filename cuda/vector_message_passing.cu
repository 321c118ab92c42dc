// PaiNN message passing, forward and backward.
//
// Layout: a block is 8 warps; each warp takes a run of up to 32 consecutive pairs and one tile of
// 32 * V feature columns (grid.y walks the tiles), its lanes side by side along the features so
// that every row access is coalesced. Lane k loads the indices and direction of the run's k-th
// pair once; the loop hands them round with shuffles.
// Forward: receivers arrive grouped when the pairs come from mirage::neighbor_list (sorted by i),
// so a lane sums consecutive pairs of the same i in registers and adds to the output with fp32
// atomics only when i changes. Any order stays correct, only slower.
// Backward: pair-level gradients (filter, directions) are written per pair; node-level ones (x,
// vectors) go to the sender j, summed over runs of equal j like the forward's receivers. Large
// lists are walked in sender order (pair_order.cuh) so that those runs are long; small ones in
// their own order, an atomic per pair. The directions' gradient is a sum over features: a warp
// reduction per pair, then one atomic per tile.
// float16/bfloat16 outputs accumulate in a float32 workspace that a last kernel converts; that
// kernel also writes NaN everywhere when an index was out of range.
#include <algorithm>
#include <initializer_list>

#include "kernel_utils.cuh"
#include "pair_order.cuh"
#include "vector_message_passing.cuh"

namespace mirage::cuda {
namespace {

constexpr int kLanes = 32;
constexpr int kWarps = 8;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr size_t kAlign = 256;

size_t round_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

__device__ __forceinline__ bool in_range(int64_t i, int64_t n) { return i >= 0 && i < n; }

// The run of pairs of this warp: [begin, begin + count). count <= 0 when the warp has none.
struct PairRun {
  int64_t begin;
  int count;
};

__device__ __forceinline__ PairRun pair_run(int64_t num_pairs, int pairs_per_warp) {
  const int64_t begin =
      (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.y) * static_cast<int64_t>(pairs_per_warp);
  const int64_t left = num_pairs - begin;
  return {begin, static_cast<int>(left < pairs_per_warp ? left : pairs_per_warp)};
}

// Lane k's copy of the run's k-th pair (pair begin + k, or order[begin + k] when walking an
// order): its index, its node indices, its direction. Raises the flag when any pair of the run
// indexes outside [0, nodes).
template <typename T>
struct LanePair {
  int64_t pair = 0, i = 0, j = 0;
  float d[3] = {0.0f, 0.0f, 0.0f};
  __device__ LanePair(const int64_t* pairs, const T* directions, int64_t num_pairs, int64_t nodes,
                      PairRun run, const int* order, int* invalid) {
    const int lane = threadIdx.x;
    bool bad = false;
    if (lane < run.count) {
      const int64_t p = order == nullptr ? run.begin + lane : order[run.begin + lane];
      pair = p;
      i = pairs[p];
      j = pairs[num_pairs + p];
#pragma unroll
      for (int c = 0; c < 3; ++c) d[c] = to_float(directions[3 * p + c]);
      bad = !in_range(i, nodes) || !in_range(j, nodes);
    }
    if (__any_sync(kFullMask, bad) && lane == 0) *invalid = 1;  // every writer stores the same value
  }
};

template <typename T, int V>
__global__ void __launch_bounds__(kLanes* kWarps)
    forward_kernel(VectorMessagePassingParams p, int pairs_per_warp,
                   float* scalar,  // [N, F], zeroed
                   float* vector,  // [N, 3, F], zeroed
                   int* invalid) {  // [1]
  const T* x = static_cast<const T*>(p.x);
  const T* filter = static_cast<const T*>(p.filter);
  const T* vectors = static_cast<const T*>(p.vectors);
  const int64_t F = p.features, N = p.nodes;
  const PairRun run = pair_run(p.num_pairs, pairs_per_warp);
  if (run.count <= 0) return;  // the whole warp
  const LanePair<T> mine(p.pairs, static_cast<const T*>(p.directions), p.num_pairs, N, run, nullptr,
                         invalid);
  const int64_t f = (static_cast<int64_t>(blockIdx.y) * kLanes + threadIdx.x) * V;
  const bool active = f < F;  // V divides F when V > 1

  float acc_s[V], acc_v[3][V];
  int64_t current = -1;
  const auto flush = [&] {
    if (current < 0 || !active) return;
    atomic_add<V>(scalar + current * F + f, acc_s);
#pragma unroll
    for (int c = 0; c < 3; ++c) atomic_add<V>(vector + (current * 3 + c) * F + f, acc_v[c]);
  };
  for (int k = 0; k < run.count; ++k) {
    const int64_t i = __shfl_sync(kFullMask, mine.i, k);
    const int64_t j = __shfl_sync(kFullMask, mine.j, k);
    float d[3];
#pragma unroll
    for (int c = 0; c < 3; ++c) d[c] = __shfl_sync(kFullMask, mine.d[c], k);
    if (!in_range(i, N) || !in_range(j, N)) continue;  // uniform over the warp
    if (i != current) {
      flush();
      current = i;
#pragma unroll
      for (int v = 0; v < V; ++v) {
        acc_s[v] = 0.0f;
#pragma unroll
        for (int c = 0; c < 3; ++c) acc_v[c][v] = 0.0f;
      }
    }
    if (!active) continue;
    const int64_t pair = run.begin + k;
    float xs[V], xvv[V], xvs[V], fs[V], fvv[V], fvs[V], vec[3][V];
    load_packed<T, V>(x + j * 3 * F + f, xs);
    load_packed<T, V>(x + j * 3 * F + F + f, xvv);
    load_packed<T, V>(x + j * 3 * F + 2 * F + f, xvs);
    load_packed<T, V>(filter + pair * 3 * F + f, fs);
    load_packed<T, V>(filter + pair * 3 * F + F + f, fvv);
    load_packed<T, V>(filter + pair * 3 * F + 2 * F + f, fvs);
#pragma unroll
    for (int c = 0; c < 3; ++c) load_packed<T, V>(vectors + (j * 3 + c) * F + f, vec[c]);
#pragma unroll
    for (int v = 0; v < V; ++v) {
      acc_s[v] += xs[v] * fs[v];
      const float m_vv = xvv[v] * fvv[v], m_vs = xvs[v] * fvs[v];
#pragma unroll
      for (int c = 0; c < 3; ++c) acc_v[c][v] += vec[c][v] * m_vv + m_vs * d[c];
    }
  }
  flush();
}

template <typename T, int V>
__global__ void __launch_bounds__(kLanes* kWarps)
    backward_kernel(VectorMessagePassingBackwardParams p, int pairs_per_warp,
                    const int* order,        // [P] pairs grouped by sender, or null: their own order
                    float* grad_x,           // [N, 3F], zeroed
                    float* grad_vectors,     // [N, 3, F], zeroed
                    float* grad_directions,  // [P, 3], zeroed
                    int* invalid) {          // [1]
  const T* grad_scalar = static_cast<const T*>(p.grad_scalar);
  const T* grad_vector = static_cast<const T*>(p.grad_vector);
  const T* x = static_cast<const T*>(p.x);
  const T* filter = static_cast<const T*>(p.filter);
  const T* vectors = static_cast<const T*>(p.vectors);
  T* grad_filter = static_cast<T*>(p.grad_filter);
  const int64_t F = p.features, N = p.nodes;
  const PairRun run = pair_run(p.num_pairs, pairs_per_warp);
  if (run.count <= 0) return;
  const LanePair<T> mine(p.pairs, static_cast<const T*>(p.directions), p.num_pairs, N, run, order, invalid);
  const int64_t f = (static_cast<int64_t>(blockIdx.y) * kLanes + threadIdx.x) * V;
  const bool active = f < F;

  // This lane's sums for the sender `current`: the gradients of x's three parts and of its
  // vectors; and that sender's rows of x and vectors, read once per run of it.
  float acc_x[3][V], acc_vec[3][V], xs[V], xvv[V], xvs[V], vec[3][V];
  int64_t current = -1;
  const auto flush = [&] {
    if (current < 0 || !active) return;
#pragma unroll
    for (int c = 0; c < 3; ++c) {
      atomic_add<V>(grad_x + current * 3 * F + c * F + f, acc_x[c]);
      atomic_add<V>(grad_vectors + (current * 3 + c) * F + f, acc_vec[c]);
    }
  };
  for (int k = 0; k < run.count; ++k) {
    const int64_t pair = __shfl_sync(kFullMask, mine.pair, k);
    const int64_t i = __shfl_sync(kFullMask, mine.i, k);
    const int64_t j = __shfl_sync(kFullMask, mine.j, k);
    float d[3];
#pragma unroll
    for (int c = 0; c < 3; ++c) d[c] = __shfl_sync(kFullMask, mine.d[c], k);
    if (!in_range(i, N) || !in_range(j, N)) continue;  // uniform over the warp
    if (j != current) {
      flush();
      current = j;
#pragma unroll
      for (int c = 0; c < 3; ++c)
#pragma unroll
        for (int v = 0; v < V; ++v) acc_x[c][v] = acc_vec[c][v] = 0.0f;
      if (active) {
        load_packed<T, V>(x + j * 3 * F + f, xs);
        load_packed<T, V>(x + j * 3 * F + F + f, xvv);
        load_packed<T, V>(x + j * 3 * F + 2 * F + f, xvs);
#pragma unroll
        for (int c = 0; c < 3; ++c) load_packed<T, V>(vectors + (j * 3 + c) * F + f, vec[c]);
      }
    }
    float part[3] = {0.0f, 0.0f, 0.0f};  // this lane's share of grad_directions[pair]
    if (active) {
      float gs[V], gv[3][V], fs[V], fvv[V], fvs[V];
      load_packed<T, V>(grad_scalar + i * F + f, gs);
#pragma unroll
      for (int c = 0; c < 3; ++c) load_packed<T, V>(grad_vector + (i * 3 + c) * F + f, gv[c]);
      load_packed<T, V>(filter + pair * 3 * F + f, fs);
      load_packed<T, V>(filter + pair * 3 * F + F + f, fvv);
      load_packed<T, V>(filter + pair * 3 * F + 2 * F + f, fvs);
      float gf_s[V], gf_vv[V], gf_vs[V];
#pragma unroll
      for (int v = 0; v < V; ++v) {
        // Gradients of the message parts m_s, m_vv, m_vs of this pair.
        const float g_s = gs[v];
        float g_vv = 0.0f, g_vs = 0.0f;
#pragma unroll
        for (int c = 0; c < 3; ++c) {
          g_vv += gv[c][v] * vec[c][v];
          g_vs += gv[c][v] * d[c];
        }
        gf_s[v] = g_s * xs[v];
        gf_vv[v] = g_vv * xvv[v];
        gf_vs[v] = g_vs * xvs[v];
        acc_x[0][v] += g_s * fs[v];
        acc_x[1][v] += g_vv * fvv[v];
        acc_x[2][v] += g_vs * fvs[v];
        const float m_vv = xvv[v] * fvv[v], m_vs = xvs[v] * fvs[v];
#pragma unroll
        for (int c = 0; c < 3; ++c) {
          acc_vec[c][v] += gv[c][v] * m_vv;
          part[c] += gv[c][v] * m_vs;
        }
      }
      store_packed<T, V>(grad_filter + pair * 3 * F + f, gf_s);
      store_packed<T, V>(grad_filter + pair * 3 * F + F + f, gf_vv);
      store_packed<T, V>(grad_filter + pair * 3 * F + 2 * F + f, gf_vs);
    }
#pragma unroll
    for (int c = 0; c < 3; ++c) part[c] = warp_sum(part[c]);
    if (threadIdx.x == 0) {
#pragma unroll
      for (int c = 0; c < 3; ++c) atomicAdd(grad_directions + 3 * pair + c, part[c]);
    }
  }
  flush();
}

// Pairs per warp: enough warps to fill the GPU a few times over before runs get long (long runs
// merge more atomics in the forward, short ones spread a small system over more SMs).
int pick_pairs_per_warp(int64_t num_pairs, int64_t tiles) {
  const int64_t target_warps = 64LL * sm_count();
  const int64_t per_warp = ceil_div(num_pairs * tiles, target_warps);
  return static_cast<int>(std::clamp<int64_t>(per_warp, 1, kLanes));
}

// V = 4 feature columns per lane when every row of the inputs (dtype) and of the float32
// accumulators starts 4-element aligned, else 1.
bool can_pack(int64_t features, std::initializer_list<const void*> inputs, DType dtype,
              std::initializer_list<const float*> accumulators) {
  if (features % 4 != 0) return false;
  for (const void* ptr : inputs)
    if (!is_aligned(ptr, 4 * dtype_size(dtype))) return false;
  for (const float* ptr : accumulators)
    if (!is_aligned(ptr, 4 * sizeof(float))) return false;
  return true;
}

// Workspace: the flag, then (float16/bfloat16 only) the float32 accumulators.
struct Workspace {
  int* invalid;
  float* acc[3];
};

Workspace carve(void* workspace, bool float32, std::initializer_list<int64_t> counts) {
  char* base = static_cast<char*>(workspace);
  Workspace w{reinterpret_cast<int*>(base), {nullptr, nullptr, nullptr}};
  size_t offset = kAlign;
  int k = 0;
  for (const int64_t count : counts) {
    if (!float32) {
      w.acc[k] = reinterpret_cast<float*>(base + offset);
      offset += round_up(static_cast<size_t>(count) * sizeof(float));
    }
    ++k;
  }
  return w;
}

size_t workspace_bytes(DType dtype, std::initializer_list<int64_t> counts) {
  size_t bytes = kAlign;
  if (dtype != DType::kFloat32)
    for (const int64_t count : counts) bytes += round_up(static_cast<size_t>(count) * sizeof(float));
  return bytes;
}

// Empty outputs may have no storage at all: their null pointer is never handed to CUDA.
cudaError_t zero(void* ptr, int64_t count, size_t element_bytes, cudaStream_t stream) {
  return count > 0 ? cudaMemsetAsync(ptr, 0, static_cast<size_t>(count) * element_bytes, stream)
                   : cudaSuccess;
}

dim3 pair_grid(int64_t num_pairs, int pairs_per_warp, int64_t tiles) {
  return dim3(static_cast<unsigned>(ceil_div(num_pairs, static_cast<int64_t>(kWarps) * pairs_per_warp)),
              static_cast<unsigned>(tiles));
}

}  // namespace

size_t vector_message_passing_workspace_bytes(const VectorMessagePassingParams& p) {
  return workspace_bytes(p.dtype, {p.nodes * p.features, p.nodes * 3 * p.features});
}

size_t vector_message_passing_backward_workspace_bytes(const VectorMessagePassingBackwardParams& p) {
  const size_t bytes =
      workspace_bytes(p.dtype, {p.nodes * 3 * p.features, p.nodes * 3 * p.features, p.num_pairs * 3});
  return use_sender_order(p.nodes, p.num_pairs) ? bytes + sender_order_workspace_bytes(p.nodes, p.num_pairs)
                                                : bytes;
}

cudaError_t launch_vector_message_passing(const VectorMessagePassingParams& p, void* workspace,
                                          cudaStream_t stream) {
  const bool float32 = p.dtype == DType::kFloat32;
  const int64_t n_scalar = p.nodes * p.features, n_vector = p.nodes * 3 * p.features;
  const Workspace w = carve(workspace, float32, {n_scalar, n_vector});
  float* scalar = float32 ? static_cast<float*>(p.scalar) : w.acc[0];
  float* vector = float32 ? static_cast<float*>(p.vector) : w.acc[1];
  cudaError_t status = zero(w.invalid, 1, sizeof(int), stream);
  if (status == cudaSuccess) status = zero(scalar, n_scalar, sizeof(float), stream);
  if (status == cudaSuccess) status = zero(vector, n_vector, sizeof(float), stream);
  if (status != cudaSuccess) return status;
  const bool pack = can_pack(p.features, {p.x, p.filter, p.vectors}, p.dtype, {scalar, vector});
  const int V = pack ? 4 : 1;
  const int64_t tiles = std::max<int64_t>(1, ceil_div(p.features, kLanes * V));
  const int pairs_per_warp = pick_pairs_per_warp(p.num_pairs, tiles);
  const dim3 block(kLanes, kWarps);
  MIRAGE_DISPATCH_FLOAT(p.dtype, [&] {
    if (p.num_pairs > 0) {
      const dim3 grid = pair_grid(p.num_pairs, pairs_per_warp, tiles);
      if (pack) {
        forward_kernel<scalar_t, 4><<<grid, block, 0, stream>>>(p, pairs_per_warp, scalar, vector, w.invalid);
      } else {
        forward_kernel<scalar_t, 1><<<grid, block, 0, stream>>>(p, pairs_per_warp, scalar, vector, w.invalid);
      }
      status = cudaGetLastError();
      if (status != cudaSuccess) return;
    }
    Segments segments{{{float32 ? nullptr : scalar, p.scalar, n_scalar},
                       {float32 ? nullptr : vector, p.vector, n_vector},
                       {nullptr, nullptr, 0},
                       {nullptr, nullptr, 0}}};
    status = launch_finish<scalar_t>(segments, w.invalid, stream);
  });
  return status;
}

cudaError_t launch_vector_message_passing_backward(const VectorMessagePassingBackwardParams& p,
                                                   void* workspace, cudaStream_t stream) {
  const bool float32 = p.dtype == DType::kFloat32;
  const int64_t n_node = p.nodes * 3 * p.features, n_dir = p.num_pairs * 3;
  const Workspace w = carve(workspace, float32, {n_node, n_node, n_dir});
  float* grad_x = float32 ? static_cast<float*>(p.grad_x) : w.acc[0];
  float* grad_vectors = float32 ? static_cast<float*>(p.grad_vectors) : w.acc[1];
  float* grad_directions = float32 ? static_cast<float*>(p.grad_directions) : w.acc[2];
  cudaError_t status = zero(w.invalid, 1, sizeof(int), stream);
  if (status == cudaSuccess) status = zero(grad_x, n_node, sizeof(float), stream);
  if (status == cudaSuccess) status = zero(grad_vectors, n_node, sizeof(float), stream);
  if (status == cudaSuccess) status = zero(grad_directions, n_dir, sizeof(float), stream);
  if (status != cudaSuccess) return status;
  const int* order = nullptr;
  if (use_sender_order(p.nodes, p.num_pairs)) {
    // The order's scratch follows the accumulators (workspace_bytes of them, a multiple of 256).
    void* order_workspace = static_cast<char*>(workspace) +
                            workspace_bytes(p.dtype, {n_node, n_node, n_dir});
    status = launch_sender_order(p.pairs, p.nodes, p.num_pairs, order_workspace, &order, stream);
    if (status != cudaSuccess) return status;
  }
  const bool pack = can_pack(p.features,
                             {p.grad_scalar, p.grad_vector, p.x, p.filter, p.vectors, p.grad_filter},
                             p.dtype, {grad_x, grad_vectors});
  const int V = pack ? 4 : 1;
  const int64_t tiles = std::max<int64_t>(1, ceil_div(p.features, kLanes * V));
  const int pairs_per_warp = pick_pairs_per_warp(p.num_pairs, tiles);
  const dim3 block(kLanes, kWarps);
  MIRAGE_DISPATCH_FLOAT(p.dtype, [&] {
    if (p.num_pairs > 0) {
      const dim3 grid = pair_grid(p.num_pairs, pairs_per_warp, tiles);
      if (pack) {
        backward_kernel<scalar_t, 4><<<grid, block, 0, stream>>>(p, pairs_per_warp, order, grad_x,
                                                                 grad_vectors, grad_directions, w.invalid);
      } else {
        backward_kernel<scalar_t, 1><<<grid, block, 0, stream>>>(p, pairs_per_warp, order, grad_x,
                                                                 grad_vectors, grad_directions, w.invalid);
      }
      status = cudaGetLastError();
      if (status != cudaSuccess) return;
    }
    Segments segments{{{float32 ? nullptr : grad_x, p.grad_x, n_node},
                       {float32 ? nullptr : grad_vectors, p.grad_vectors, n_node},
                       {float32 ? nullptr : grad_directions, p.grad_directions, n_dir},
                       {nullptr, p.grad_filter, p.num_pairs * 3 * p.features}}};
    status = launch_finish<scalar_t>(segments, w.invalid, stream);
  });
  return status;
}

}  // namespace mirage::cuda
