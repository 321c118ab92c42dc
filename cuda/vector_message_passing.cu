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
// A fused filter (FusedFilter) is formed in the kernel a few pairs at a time, so that each
// weight load from shared memory serves several pairs: the block keeps the weight transposed in
// shared memory and each warp its run's basis rows; the grid is then one wave of blocks, each
// warp walking runs, so that the weight is staged once per block.
// With a fused filter on a list walked in sender order, the backward returns the basis' gradient
// [P, K] instead of the filter's [P, 3F]: basis_backward_kernel forms it on tensor cores from the
// filter's gradient in registers (see there). Tried before and not kept (2026-11-28,
// docs/perf/forcefield.md): the same contraction on CUDA cores inside the former backward's loop
// over the basis, twice its FFMAs; PaiNN at 3,000 atoms, 897-1063 against 869 us for the three
// backwards and basis gradients on an H200.
#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "kernel_utils.cuh"
#include "pair_order.cuh"
#include "tf32.cuh"
#include "vector_message_passing.cuh"

namespace mirage::cuda {
namespace {

constexpr int kLanes = 32;
constexpr int kWarps = 8;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr size_t kAlign = 256;

size_t round_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

__device__ __forceinline__ bool in_range(int64_t i, int64_t n) { return i >= 0 && i < n; }

// A run of pairs: [begin, begin + count). count <= 0 past the last pair.
struct PairRun {
  int64_t begin;
  int count;
};

__device__ __forceinline__ PairRun pair_run(int64_t index, int64_t num_pairs, int pairs_per_warp) {
  const int64_t begin = index * static_cast<int64_t>(pairs_per_warp);
  const int64_t left = num_pairs - begin;
  return {begin, static_cast<int>(left < pairs_per_warp ? left : pairs_per_warp)};
}

// Warp w of the grid takes runs w, w + (warps in the grid), ... (one each unless the grid was
// capped: fused filters).
template <typename F>
__device__ __forceinline__ void for_each_run(int64_t num_pairs, int pairs_per_warp, F&& f) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.y;; index += warps) {
    const PairRun run = pair_run(index, num_pairs, pairs_per_warp);
    if (run.count <= 0) return;  // the whole warp
    f(run);
  }
}

// A fused filter's grid is one wave of `warps` warps walking runs of this many pairs, as evenly as
// the runs allow. With the caller's count the kernels split the walked pairs again over the same
// warps (the host chose from the capacity), so that the skipped padding shortens every warp's walk
// instead of idling the last warps while the others take as long as before.
__host__ __device__ inline int wave_pairs_per_warp(int64_t pairs, int64_t warps) {
  int64_t runs_per_warp = ceil_div(pairs, warps * kLanes);
  if (runs_per_warp < 1) runs_per_warp = 1;
  const int64_t per_run = ceil_div(pairs, warps * runs_per_warp);
  return static_cast<int>(per_run < 1 ? 1 : per_run > kLanes ? kLanes : per_run);
}

// The run length a kernel walks: the host's, or with a fused filter and a count the walked pairs'
// split over the grid's warps.
template <bool kFused>
__device__ __forceinline__ int run_length(const int64_t* live, int64_t walked, int pairs_per_warp) {
  if (!kFused || live == nullptr) return pairs_per_warp;
  return wave_pairs_per_warp(walked, static_cast<int64_t>(gridDim.x) * kWarps);
}

// Fused filters are formed a group of pairs at a time, each weight load serving the group: four
// in the forward, two in the backward (four spill registers at two blocks an SM: 229 against
// 270 us a layer of PaiNN at 3,000 atoms on an H100, 2026-11-24; three spill fewer but still
// lose, 227 against 222 us on an H200).
constexpr int kForwardGroup = 4;
constexpr int kBackwardGroup = 2;

// Shared memory of a fused filter: the weight transposed, [K][3F], then each warp's basis rows
// transposed, [K][32] (column k: its run's k-th pair).
size_t fused_shared_bytes(int64_t features, int width) {
  return static_cast<size_t>(width) * static_cast<size_t>(3 * features + kWarps * kLanes) * sizeof(float);
}

struct FilterStage {
  const float* weight_t;  // [K][3F]
  float* basis;           // this warp's [K][32]
  int width;              // K
  int64_t columns;        // 3F

  // Every thread of the block: the weight into shared memory (a __syncthreads must follow).
  __device__ FilterStage(const FusedFilter& fused, int64_t features) : width(fused.width), columns(3 * features) {
    extern __shared__ float4 smem4[];
    float* weight = reinterpret_cast<float*>(smem4);
    for (int64_t idx = threadIdx.y * kLanes + threadIdx.x; idx < columns * width; idx += kLanes * kWarps) {
      const int64_t c = idx / width;
      weight[(idx - c * width) * columns + c] = fused.weight[idx];
    }
    weight_t = weight;
    basis = weight + columns * width + threadIdx.y * width * kLanes;
  }

  // The warp's run: lane k < count stores its pair's basis row, the others zeros.
  __device__ void stage_run(const FusedFilter& fused, int64_t pair, bool has_pair) {
    __syncwarp();  // the previous run's filters are formed
    for (int r = 0; r < width; ++r) basis[r * kLanes + threadIdx.x] = has_pair ? fused.basis[pair * width + r] : 0.0f;
    __syncwarp();
  }

  // The filters of the run's pairs k0 .. k0 + G - 1 at this lane's columns f .. f + 3 of each
  // part, summed over the basis in order.
  template <int G>
  __device__ void form(int k0, int64_t features, int64_t f, float (&out)[G][3][4]) const {
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int part = 0; part < 3; ++part)
#pragma unroll
        for (int v = 0; v < 4; ++v) out[g][part][v] = 0.0f;
    for (int r = 0; r < width; ++r) {
      float b[G], w[3][4];
      load_packed<float, G>(basis + r * kLanes + k0, b);
#pragma unroll
      for (int part = 0; part < 3; ++part) load_packed<float, 4>(weight_t + r * columns + part * features + f, w[part]);
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int part = 0; part < 3; ++part)
#pragma unroll
          for (int v = 0; v < 4; ++v) out[g][part][v] = fmaf(b[g], w[part][v], out[g][part][v]);
    }
  }
};

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

// Nothing to stage: the filter is read.
struct ReadFilter {};

// The block's filter stage (a barrier after it: every thread staged part of the weight).
template <bool kFused>
__device__ __forceinline__ std::conditional_t<kFused, FilterStage, ReadFilter> make_stage(const FusedFilter& fused,
                                                                                         int64_t features) {
  if constexpr (kFused) {
    FilterStage stage(fused, features);
    __syncthreads();
    return stage;
  } else {
    return {};
  }
}

// This lane's filter columns f .. f + V - 1 of each part for the run's pair k0 + g: formed for
// the group (fused) or read.
template <typename T, int V, bool kFused, int G>
__device__ __forceinline__ void filter_parts(const T* filter, int64_t pair, int64_t features, int64_t f,
                                             const float (&formed)[G][3][4], int g, float (&out)[3][V]) {
  if constexpr (kFused) {
#pragma unroll
    for (int part = 0; part < 3; ++part)
#pragma unroll
      for (int v = 0; v < V; ++v) out[part][v] = formed[g][part][v];
  } else {
#pragma unroll
    for (int part = 0; part < 3; ++part) load_packed<T, V>(filter + (pair * 3 + part) * features + f, out[part]);
  }
}

template <typename T, int V, bool kFused>
__global__ void __launch_bounds__(kLanes* kWarps, kFused ? 2 : 1)
    forward_kernel(VectorMessagePassingParams p, int pairs_per_warp,
                   float* scalar,  // [N, F], zeroed
                   float* vector,  // [N, 3, F], zeroed
                   int* invalid) {  // [1]
  start_after_prior_grid();
  static_assert(!kFused || (std::is_same_v<T, float> && V == 4), "fused filters: float32, 4 columns a lane");
  constexpr int kStep = kFused ? kForwardGroup : 1;
  const T* x = static_cast<const T*>(p.x);
  const T* filter = static_cast<const T*>(p.filter);
  const T* vectors = static_cast<const T*>(p.vectors);
  const int64_t F = p.features, N = p.nodes;
  const int64_t f = (static_cast<int64_t>(blockIdx.y) * kLanes + threadIdx.x) * V;
  const bool active = f < F;  // V divides F when V > 1
  auto stage = make_stage<kFused>(p.fused, F);

  const int64_t walked = pairs_to_walk(p.live_pairs, p.num_pairs);
  for_each_run(walked, run_length<kFused>(p.live_pairs, walked, pairs_per_warp), [&](const PairRun run) {
    const LanePair<T> mine(p.pairs, static_cast<const T*>(p.directions), p.num_pairs, N, run, nullptr, invalid);
    if constexpr (kFused) stage.stage_run(p.fused, mine.pair, threadIdx.x < run.count);
    float acc_s[V], acc_v[3][V];
    int64_t current = -1;
    const auto flush = [&] {
      if (current < 0 || !active) return;
      atomic_add<V>(scalar + current * F + f, acc_s);
#pragma unroll
      for (int c = 0; c < 3; ++c) atomic_add<V>(vector + (current * 3 + c) * F + f, acc_v[c]);
    };
    for (int k0 = 0; k0 < run.count; k0 += kStep) {
      float formed[kStep][3][4];
      if constexpr (kFused) {
        if (active) stage.template form<kStep>(k0, F, f, formed);
      }
#pragma unroll
      for (int g = 0; g < kStep; ++g) {
        const int k = k0 + g;
        if (k >= run.count) break;  // uniform over the warp
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
        float xs[V], xvv[V], xvs[V], fp[3][V], vec[3][V];
        load_packed<T, V>(x + j * 3 * F + f, xs);
        load_packed<T, V>(x + j * 3 * F + F + f, xvv);
        load_packed<T, V>(x + j * 3 * F + 2 * F + f, xvs);
        filter_parts<T, V, kFused, kStep>(filter, run.begin + k, F, f, formed, g, fp);
#pragma unroll
        for (int c = 0; c < 3; ++c) load_packed<T, V>(vectors + (j * 3 + c) * F + f, vec[c]);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          acc_s[v] += xs[v] * fp[0][v];
          const float m_vv = xvv[v] * fp[1][v], m_vs = xvs[v] * fp[2][v];
#pragma unroll
          for (int c = 0; c < 3; ++c) acc_v[c][v] += vec[c][v] * m_vv + m_vs * d[c];
        }
      }
    }
    flush();
  });
}

template <typename T, int V, bool kFused>
__global__ void __launch_bounds__(kLanes* kWarps, kFused ? 2 : 1)
    backward_kernel(VectorMessagePassingBackwardParams p, int pairs_per_warp,
                    const int* order,        // [P] pairs grouped by sender, or null: their own order
                    float* grad_x,           // [N, 3F], zeroed
                    float* grad_vectors,     // [N, 3, F], zeroed
                    float* grad_directions,  // [P, 3], zeroed
                    int* invalid) {          // [1]
  start_after_prior_grid();
  static_assert(!kFused || (std::is_same_v<T, float> && V == 4), "fused filters: float32, 4 columns a lane");
  constexpr int kStep = kFused ? kBackwardGroup : 1;
  const T* grad_scalar = static_cast<const T*>(p.grad_scalar);
  const T* grad_vector = static_cast<const T*>(p.grad_vector);
  const T* x = static_cast<const T*>(p.x);
  const T* filter = static_cast<const T*>(p.filter);
  const T* vectors = static_cast<const T*>(p.vectors);
  T* grad_filter = static_cast<T*>(p.grad_filter);
  const int64_t F = p.features, N = p.nodes;
  const int64_t f = (static_cast<int64_t>(blockIdx.y) * kLanes + threadIdx.x) * V;
  const bool active = f < F;
  auto stage = make_stage<kFused>(p.fused, F);

  const int64_t walked = pairs_to_walk(p.live_pairs, p.num_pairs);
  zero_padding(grad_filter, walked, p.num_pairs, 3 * F);  // (their grad_directions: the zeroed accumulator's)
  for_each_run(walked, run_length<kFused>(p.live_pairs, walked, pairs_per_warp), [&](const PairRun run) {
    const LanePair<T> mine(p.pairs, static_cast<const T*>(p.directions), p.num_pairs, N, run, order, invalid);
    if constexpr (kFused) stage.stage_run(p.fused, mine.pair, threadIdx.x < run.count);
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
    for (int k0 = 0; k0 < run.count; k0 += kStep) {
      float formed[kStep][3][4];
      if constexpr (kFused) {
        if (active) stage.template form<kStep>(k0, F, f, formed);
      }
#pragma unroll
      for (int g = 0; g < kStep; ++g) {
        const int k = k0 + g;
        if (k >= run.count) break;  // uniform over the warp
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
          float gs[V], gv[3][V], fp[3][V];
          load_packed<T, V>(grad_scalar + i * F + f, gs);
#pragma unroll
          for (int c = 0; c < 3; ++c) load_packed<T, V>(grad_vector + (i * 3 + c) * F + f, gv[c]);
          filter_parts<T, V, kFused, kStep>(filter, pair, F, f, formed, g, fp);
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
            acc_x[0][v] += g_s * fp[0][v];
            acc_x[1][v] += g_vv * fp[1][v];
            acc_x[2][v] += g_vs * fp[2][v];
            const float m_vv = xvv[v] * fp[1][v], m_vs = xvs[v] * fp[2][v];
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
    }
    flush();
  });
}

// ---- The backward with the basis' gradient on tensor cores (grad_basis) --------------------------
// A warp takes a window of 16 consecutive places of the walk (sender order for long lists) and each
// run of one sender that starts in it, walked to its end in tiles of 16 places (any permutation is
// correct, a scattered one only slower). Tiles aligned to the runs' starts, rather than each
// window's pieces of the runs that cross it, take a sixth fewer MMA passes on the 3,000-atom box
// (139,046 pairs in runs of 46 on average: 9,714 tiles against 11,504 pieces). The run's pairs are
// the M side of TF32 MMAs (three products with split operands: float32's accuracy): lane (g, t)
// holds pairs g and g + 8. The filter, basis [16 x K] times W^T, comes out with lane t holding, in
// chunk c of 16 features, features 16 c + 4 t .. + 3 of each part (the weight's columns permuted
// so: n8 tile j = 2 c + h of a part, column n, is feature 16 c + 4 (n / 2) + 2 h + n % 2), so that
// the loads of x, vectors and the gradients stay 16 bytes a lane. The filter's gradient then sits
// in the accumulator layout, which is the A layout of the next product: d basis [16 x K] = d filter
// [16 x 3F] x W, straight from the registers (a k8 step: features 16 c + 4 t + 2 e and + 1 as k = t
// and t + 4). No [P, 3F] tensor, no GEMM after it: on the 3,000-atom box (PaiNN, H200, 2026-11-30)
// a prototype took 176 against 282 us for the former backward kernel and linear's narrow kernel
// together.
constexpr int kBasisWarps = 12;  // one block an SM (168 registers, 1152 F bytes of shared memory)
constexpr int kBasisSteps = 3;   // K <= 24: three k8 steps of the filter, three n8 tiles of its gradient
constexpr int kBasisRows = 16;   // a window: the MMAs' M
// A segment of the walk: a long run (a hub sender; the padding (0, 0) of a list passed without
// num_pairs) is walked a segment at a time, by as many warps, not by one warp to its end. A run
// split at a boundary may take one more tile, so segments are long. Counted on the CPU with these
// rules (2026-11-30): the 3,000-atom box's list takes 9,765 tiles against 9,714 unsplit; walked
// with the padding of its 174,000-pair capacity, a warp's longest walk is 64 tiles against 2,188.
constexpr int kBasisSegment = 64 * kBasisRows;

// Shared memory: each weight fragment a lane reads, split, as uint4 {hi0, hi1, lo0, lo1}: the
// filter's B fragments [3][F / 8][kBasisSteps][32] (k = basis, n = feature), then the gradient
// product's [3][F / 16][2][kBasisSteps][32] (k = feature, n = basis).
size_t basis_shared_bytes(int64_t features) {
  return static_cast<size_t>(3 * (features / 8) * kBasisSteps * 32 + 3 * (features / 16) * 2 * kBasisSteps * 32) *
         sizeof(uint4);
}

__device__ __forceinline__ float lane_of(const float4& v, int e) {
  return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint4 split_pair(float v0, float v1) {
  uint4 out;
  split<true>(v0, out.x, out.z);
  split<true>(v1, out.y, out.w);
  return out;
}

__global__ void __launch_bounds__(kLanes* kBasisWarps, 1)
    basis_backward_kernel(VectorMessagePassingBackwardParams p, const int* order,
                          float* grad_x,           // [N, 3F], zeroed
                          float* grad_vectors,     // [N, 3, F], zeroed
                          float* grad_directions,  // [P, 3], zeroed
                          int* invalid,            // [1]
                          int* taken) {            // [1], zeroed: windows handed out
  start_after_prior_grid();
  const int64_t F = p.features, N = p.nodes, P = p.num_pairs;
  const int K = p.fused.width, J = static_cast<int>(F / 8), C = static_cast<int>(F / 16);
  const float* weight = p.fused.weight;
  extern __shared__ uint4 fragments[];
  uint4* filter_b = fragments;                           // [3][J][kBasisSteps][32]
  uint4* grad_b = fragments + 3 * J * kBasisSteps * 32;  // [3][C][2][kBasisSteps][32]
  const int tid = threadIdx.y * kLanes + threadIdx.x;
  for (int idx = tid; idx < 3 * J * kBasisSteps * 32; idx += kLanes * kBasisWarps) {
    const int l = idx % 32, ks = idx / 32 % kBasisSteps, j = idx / (32 * kBasisSteps) % J,
              part = idx / (32 * kBasisSteps * J);
    const int col = part * static_cast<int>(F) + 16 * (j / 2) + 4 * (l / 8) + 2 * (j % 2) + l / 4 % 2;
    const int k0 = 8 * ks + l % 4, k1 = k0 + 4;
    filter_b[idx] = split_pair(k0 < K ? weight[col * K + k0] : 0.0f, k1 < K ? weight[col * K + k1] : 0.0f);
  }
  for (int idx = tid; idx < 3 * C * 2 * kBasisSteps * 32; idx += kLanes * kBasisWarps) {
    const int l = idx % 32, nt = idx / 32 % kBasisSteps, e = idx / (32 * kBasisSteps) % 2,
              c = idx / (32 * kBasisSteps * 2) % C, part = idx / (32 * kBasisSteps * 2 * C);
    const int k = 8 * nt + l / 4, col = part * static_cast<int>(F) + 16 * c + 4 * (l % 4) + 2 * e;
    grad_b[idx] = split_pair(k < K ? weight[col * K + k] : 0.0f, k < K ? weight[(col + 1) * K + k] : 0.0f);
  }
  __syncthreads();
  const int64_t walked = pairs_to_walk(p.live_pairs, P);
  zero_padding(static_cast<float*>(p.grad_basis), walked, P, K);
  const float* gs = static_cast<const float*>(p.grad_scalar);
  const float* gv = static_cast<const float*>(p.grad_vector);
  const float* x = static_cast<const float*>(p.x);
  const float* vec = static_cast<const float*>(p.vectors);
  const float* dirs = static_cast<const float*>(p.directions);
  float* grad_basis = static_cast<float*>(p.grad_basis);
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  const int windows = static_cast<int>(ceil_div(walked, int64_t{kBasisRows}));
  // Windows are handed out one at a time: the work of one is the tiles of the runs starting in it
  // (none to several), so with a fixed share a warp the kernel waits on its unluckiest warp: PaiNN
  // on the 3,000-atom box took 2.26 ms a call so, against 1.90 with each window's pieces of runs
  // (H200, 2026-11-30).
  for (;;) {
    const int w = __shfl_sync(kFullMask, lane == 0 ? atomicAdd(taken, 1) : 0, 0);
    if (w >= windows) break;
    // Lane q < 16: the sender of the window's q-th walk position, -1 outside the walk or for an
    // index out of range (which raises the flag: every output NaN); lanes 16 + q: the previous
    // window's (at a segment's first window; else lane 31 alone, the place before this window).
    // 32-bit: the launcher takes lists that use_sender_order admits (an int32 order, fewer than
    // 2^31 nodes).
    const int64_t first = kBasisRows * static_cast<int64_t>(w);
    const bool segment_start = first % kBasisSegment == 0;
    const int64_t pos = lane < kBasisRows ? first + lane : first - 2 * kBasisRows + lane;
    int key = -1;
    if ((lane < kBasisRows || segment_start || lane == kLanes - 1) && pos >= 0 && pos < walked) {
      const int pair = order[pos];
      const int64_t i = p.pairs[pair], j = p.pairs[P + pair];
      if (in_range(i, N) && in_range(j, N)) {
        key = static_cast<int>(j);
      } else if (lane < kBasisRows) {
        *invalid = 1;  // every writer stores the same value
      }
    }
    // The runs (of one sender) that start in the window, each walked in tiles of 16 to its end or
    // to the first segment boundary 16 places or more after its start. A run that reaches that
    // boundary covers the 16 places before it, and that is what makes the boundary a start here
    // (the window before it all the sender's): so one warp walks at most a segment and 16 places
    // of a run, and each place belongs to exactly one walk.
    const int before = __shfl_sync(kFullMask, key, lane == 0 ? kLanes - 1 : lane - 1);
    const int key0 = __shfl_sync(kFullMask, key, 0);
    const bool resumed = segment_start && key0 >= 0 &&
                         __ballot_sync(kFullMask, lane >= kBasisRows && key == key0) == ~((1u << kBasisRows) - 1);
    unsigned starts =
        __ballot_sync(kFullMask, lane < kBasisRows && key >= 0 && (key != before || (lane == 0 && resumed)));
    while (starts != 0) {  // uniform over the warp
      const int start = __ffs(starts) - 1;
      starts &= starts - 1;
      const int64_t sender = __shfl_sync(kFullMask, key, start);
      const int64_t end =
          std::min(walked, ceil_div(first + start + kBasisRows, int64_t{kBasisSegment}) * kBasisSegment);
      for (int64_t base = first + start;; base += kBasisRows) {
        // Lane q < 16: the tile's q-th pair and receiver; the run is the tile's first rows of the sender.
        int my_pair = 0, my_i = 0;
        bool same = false;
        if (lane < kBasisRows && base + lane < end) {
          my_pair = order[base + lane];
          const int64_t i = p.pairs[my_pair];
          same = in_range(i, N) && p.pairs[P + my_pair] == sender;
          my_i = static_cast<int>(i);
        }
        const unsigned same_rows = __ballot_sync(kFullMask, same);
        const unsigned run = (~same_rows & (same_rows + 1)) - 1;  // the ones below the lowest zero
        if (run == 0) break;
        // This lane's rows g and g + 8 of the run: pair, receiver, direction, basis (split).
        int pair[2], receiver[2];
        bool valid[2];
        float d[2][3];
        uint32_t a_hi[kBasisSteps][4], a_lo[kBasisSteps][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int q = g + 8 * r;
          valid[r] = (run >> q) & 1u;
          pair[r] = __shfl_sync(kFullMask, my_pair, q);
          receiver[r] = __shfl_sync(kFullMask, my_i, q);
#pragma unroll
          for (int c3 = 0; c3 < 3; ++c3) d[r][c3] = valid[r] ? dirs[3 * static_cast<int64_t>(pair[r]) + c3] : 0.0f;
#pragma unroll
          for (int ks = 0; ks < kBasisSteps; ++ks)
#pragma unroll
            for (int u = 0; u < 2; ++u) {  // a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
              const int k = 8 * ks + t + 4 * u;
              const float b = valid[r] && k < K ? p.fused.basis[static_cast<int64_t>(pair[r]) * K + k] : 0.0f;
              split<true>(b, a_hi[ks][r + 2 * u], a_lo[ks][r + 2 * u]);
            }
        }
        float basis_grad[kBasisSteps][4] = {};
        float dir_grad[2][3] = {};
#pragma unroll 1
        for (int c = 0; c < C; ++c) {
          float filt[3][2][4];  // [part][h][accumulator]: rows g, g + 8 at features 16 c + 4 t + 2 h (+ 1)
#pragma unroll
          for (int part = 0; part < 3; ++part)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float(&acc)[4] = filt[part][h];
              acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
#pragma unroll
              for (int ks = 0; ks < kBasisSteps; ++ks) {
                const uint4 b = filter_b[((part * J + 2 * c + h) * kBasisSteps + ks) * 32 + lane];
                const uint32_t b_hi[2] = {b.x, b.y}, b_lo[2] = {b.z, b.w};
                mma_tf32(acc, a_lo[ks], b_hi);
                mma_tf32(acc, a_hi[ks], b_lo);
                mma_tf32(acc, a_hi[ks], b_hi);
              }
            }
          const int64_t f = 16 * c + 4 * t;
          const float4 xs = *reinterpret_cast<const float4*>(x + sender * 3 * F + f);
          const float4 xvv = *reinterpret_cast<const float4*>(x + sender * 3 * F + F + f);
          const float4 xvs = *reinterpret_cast<const float4*>(x + sender * 3 * F + 2 * F + f);
          float4 vj[3];
#pragma unroll
          for (int c3 = 0; c3 < 3; ++c3) vj[c3] = *reinterpret_cast<const float4*>(vec + (sender * 3 + c3) * F + f);
          float grad_filter[3][2][4] = {};  // [part][row][feature f + e]: 0 on rows outside the run
          float sums[6][4] = {};            // the sender's: x's three parts, then its vectors' three components
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            // Rows outside the run add nothing; skipped rather than multiplied by zeros, so that an
            // infinite x[j] or vectors[j] reaches the sender's sums as an infinity, not NaN.
            if (!valid[r]) continue;
            const float4 g_s4 = *reinterpret_cast<const float4*>(gs + static_cast<int64_t>(receiver[r]) * F + f);
            float4 g_v4[3];
#pragma unroll
            for (int c3 = 0; c3 < 3; ++c3)
              g_v4[c3] = *reinterpret_cast<const float4*>(gv + (static_cast<int64_t>(receiver[r]) * 3 + c3) * F + f);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int h = e / 2, o = 2 * r + e % 2;
              const float f_s = filt[0][h][o], f_vv = filt[1][h][o], f_vs = filt[2][h][o];
              // Gradients of the message parts m_s, m_vv, m_vs of this pair.
              const float g_s = lane_of(g_s4, e);
              float g_vv = 0.0f, g_vs = 0.0f;
#pragma unroll
              for (int c3 = 0; c3 < 3; ++c3) {
                g_vv += lane_of(g_v4[c3], e) * lane_of(vj[c3], e);
                g_vs += lane_of(g_v4[c3], e) * d[r][c3];
              }
              grad_filter[0][r][e] = g_s * lane_of(xs, e);
              grad_filter[1][r][e] = g_vv * lane_of(xvv, e);
              grad_filter[2][r][e] = g_vs * lane_of(xvs, e);
              sums[0][e] += g_s * f_s;
              sums[1][e] += g_vv * f_vv;
              sums[2][e] += g_vs * f_vs;
              const float m_vv = lane_of(xvv, e) * f_vv, m_vs = lane_of(xvs, e) * f_vs;
#pragma unroll
              for (int c3 = 0; c3 < 3; ++c3) {
                sums[3 + c3][e] += lane_of(g_v4[c3], e) * m_vv;
                dir_grad[r][c3] += lane_of(g_v4[c3], e) * m_vs;
              }
            }
          }
          // d basis += d filter [16 x (the chunk's 4 features a lane, 3 parts)] x W: two k8 steps a
          // part, into accumulators of the chunk's own, added in float32 after. The tensor cores'
          // accumulation rounds less exactly than an FFMA (it truncates, by published measurements):
          // a chain of all the chunks' (144 MMAs at F = 128) drifted past float32's bound (an H200,
          // 2026-11-30: 6.2 units of the terms' magnitude; 2.1 with a chain a chunk).
          float chunk_grad[kBasisSteps][4] = {};
#pragma unroll
          for (int part = 0; part < 3; ++part)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              uint32_t hi[4], lo[4];
              split<true>(grad_filter[part][0][2 * e], hi[0], lo[0]);
              split<true>(grad_filter[part][1][2 * e], hi[1], lo[1]);
              split<true>(grad_filter[part][0][2 * e + 1], hi[2], lo[2]);
              split<true>(grad_filter[part][1][2 * e + 1], hi[3], lo[3]);
#pragma unroll
              for (int nt = 0; nt < kBasisSteps; ++nt) {
                const uint4 b = grad_b[(((part * C + c) * 2 + e) * kBasisSteps + nt) * 32 + lane];
                const uint32_t b_hi[2] = {b.x, b.y}, b_lo[2] = {b.z, b.w};
                mma_tf32(chunk_grad[nt], lo, b_hi);
                mma_tf32(chunk_grad[nt], hi, b_lo);
                mma_tf32(chunk_grad[nt], hi, b_hi);
              }
            }
#pragma unroll
          for (int nt = 0; nt < kBasisSteps; ++nt)
#pragma unroll
            for (int q = 0; q < 4; ++q) basis_grad[nt][q] += chunk_grad[nt][q];
          // The sender's sums over the run (the 8 lanes of one t); lanes g == c % 8 add them.
#pragma unroll
          for (int k = 0; k < 6; ++k)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float v = sums[k][e];
              v += __shfl_xor_sync(kFullMask, v, 4);
              v += __shfl_xor_sync(kFullMask, v, 8);
              v += __shfl_xor_sync(kFullMask, v, 16);
              sums[k][e] = v;
            }
          if (g == c % 8) {
#pragma unroll
            for (int k = 0; k < 3; ++k) atomic_add<4>(grad_x + sender * 3 * F + k * F + f, sums[k]);
#pragma unroll
            for (int c3 = 0; c3 < 3; ++c3) atomic_add<4>(grad_vectors + (sender * 3 + c3) * F + f, sums[3 + c3]);
          }
        }
        // Each pair's direction gradient: its row's features, summed over the four lanes of the row.
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int c3 = 0; c3 < 3; ++c3) {
            float v = dir_grad[r][c3];
            v += __shfl_xor_sync(kFullMask, v, 1);
            v += __shfl_xor_sync(kFullMask, v, 2);
            if (t == 0 && valid[r]) grad_directions[3 * static_cast<int64_t>(pair[r]) + c3] = v;
          }
        // The basis' gradient: accumulator q of tile nt is row g + 8 (q / 2), column 8 nt + 2 t + q % 2.
#pragma unroll
        for (int nt = 0; nt < kBasisSteps; ++nt)
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int r = q / 2, k = 8 * nt + 2 * t + q % 2;
            if (valid[r] && k < K) grad_basis[static_cast<int64_t>(pair[r]) * K + k] = basis_grad[nt][q];
          }
        if (run != (1u << kBasisRows) - 1) break;  // the run ended inside this tile
      }
    }
  }
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

// Workspace: the flag (and after it basis_backward_kernel's count of windows handed out), then
// (float16/bfloat16 only) the float32 accumulators.
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

// Runs kernel(params, pairs_per_warp, args...) over the pairs: a run per warp; with a fused
// filter, one wave of blocks (as many as fit on the GPU at once, each staging the weight once)
// whose warps walk the same number of runs, as long as the runs allow (up to 32 pairs).
template <typename Params, typename... KernelArgs, typename... Args>
cudaError_t launch_over_pairs(void (*kernel)(Params, int, KernelArgs...), const Params& p, int64_t tiles,
                              cudaStream_t stream, Args... args) {
  if (p.fused.basis == nullptr) {
    const int pairs_per_warp = pick_pairs_per_warp(p.num_pairs, tiles);
    return launch_overlapped(kernel, pair_grid(p.num_pairs, pairs_per_warp, tiles), dim3(kLanes, kWarps), 0, stream,
                             false, p, pairs_per_warp, args...);
  }
  const size_t shared = fused_shared_bytes(p.features, p.fused.width);
  int64_t wave = 0;
  const cudaError_t status = blocks_per_wave(kernel, kLanes * kWarps, shared, wave);
  if (status != cudaSuccess) return status;
  const int64_t blocks = std::max<int64_t>(1, wave / tiles);
  const int pairs_per_warp = wave_pairs_per_warp(p.num_pairs, blocks * kWarps);
  dim3 grid = pair_grid(p.num_pairs, pairs_per_warp, tiles);
  grid.x = static_cast<unsigned>(std::min<int64_t>(grid.x, blocks));
  return launch_overlapped(kernel, grid, dim3(kLanes, kWarps), shared, stream, false, p, pairs_per_warp, args...);
}

// The kernel for the dtype T, packing and filter source: kernel(std::integral_constant<int, V>,
// std::bool_constant<kFused>). A fused filter needs float32 and packing (fused_filter_supported
// and 16-byte aligned rows, which the op checks).
template <typename T, typename F>
cudaError_t with_kernel_kind(bool pack, bool fused, F&& kernel) {
  if (fused) {
    if constexpr (std::is_same_v<T, float>) {
      if (pack) return kernel(std::integral_constant<int, 4>{}, std::true_type{});
    }
    return cudaErrorInvalidValue;
  }
  return pack ? kernel(std::integral_constant<int, 4>{}, std::false_type{})
              : kernel(std::integral_constant<int, 1>{}, std::false_type{});
}

}  // namespace

bool basis_gradient_supported(int64_t features, int64_t width, DType dtype) {
  return fused_filter_supported(features, width, dtype) && features % 16 == 0 && width <= 8 * kBasisSteps &&
         basis_shared_bytes(features) <= max_shared_bytes_per_block();
}

bool fused_filter_supported(int64_t features, int64_t width, DType dtype) {
  if (dtype != DType::kFloat32 || features < 4 || features % 4 != 0 || width < 1 || width > kMaxFusedFilterWidth)
    return false;
  return fused_shared_bytes(features, static_cast<int>(width)) <= max_shared_bytes_per_block();
}

size_t vector_message_passing_workspace_bytes(const VectorMessagePassingParams& p) {
  return workspace_bytes(p.dtype, {p.nodes * p.features, p.nodes * 3 * p.features});
}

size_t vector_message_passing_backward_workspace_bytes(const VectorMessagePassingBackwardParams& p) {
  return workspace_bytes(p.dtype, {p.nodes * 3 * p.features, p.nodes * 3 * p.features, p.num_pairs * 3}) +
         sender_order_workspace_bytes(p.nodes, p.num_pairs, p.sender_order != nullptr);
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
  const int64_t tiles = std::max<int64_t>(1, ceil_div(p.features, kLanes * (pack ? 4 : 1)));
  MIRAGE_DISPATCH_FLOAT(p.dtype, [&] {
    if (p.num_pairs > 0) {
      status = with_kernel_kind<scalar_t>(pack, p.fused.basis != nullptr, [&](auto v, auto fused) {
        return launch_over_pairs(forward_kernel<scalar_t, v(), fused()>, p, tiles, stream, scalar, vector,
                                 w.invalid);
      });
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
  const bool pack = can_pack(p.features,
                             {p.grad_scalar, p.grad_vector, p.x, p.filter, p.vectors, p.grad_filter},
                             p.dtype, {grad_x, grad_vectors});
  // The basis' gradient on tensor cores: refused before anything is queued where it does not apply.
  if (p.grad_basis != nullptr &&
      (p.fused.basis == nullptr || !pack || !use_sender_order(p.nodes, p.num_pairs) ||
       !basis_gradient_supported(p.features, p.fused.width, p.dtype)))
    return cudaErrorInvalidValue;
  cudaError_t status = zero(w.invalid, 2, sizeof(int), stream);  // the flag, basis_backward_kernel's `taken`
  if (status == cudaSuccess) status = zero(grad_x, n_node, sizeof(float), stream);
  if (status == cudaSuccess) status = zero(grad_vectors, n_node, sizeof(float), stream);
  if (status == cudaSuccess) status = zero(grad_directions, n_dir, sizeof(float), stream);
  if (status != cudaSuccess) return status;
  // Sender order for long lists (null: list order); its scratch follows the accumulators
  // (workspace_bytes of them, a multiple of 256).
  SenderOrder walk;
  void* order_workspace = static_cast<char*>(workspace) + workspace_bytes(p.dtype, {n_node, n_node, n_dir});
  status = launch_sender_order(p.pairs, p.nodes, p.num_pairs, p.live_pairs, p.sender_order, order_workspace, &walk,
                               stream);
  if (status != cudaSuccess) return status;
  if (p.grad_basis != nullptr) {  // the basis' gradient on tensor cores (walk.order: use_sender_order)
    const size_t shared = basis_shared_bytes(p.features);
    int64_t wave = 0;
    status = blocks_per_wave(basis_backward_kernel, kLanes * kBasisWarps, shared, wave);
    if (status != cudaSuccess) return status;
    const int64_t windows = ceil_div(p.num_pairs, int64_t{kBasisRows});
    const int64_t blocks = std::max<int64_t>(1, std::min(wave, ceil_div(windows, int64_t{kBasisWarps})));
    status = launch_overlapped(basis_backward_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kLanes, kBasisWarps),
                               shared, stream, false, p, walk.order, grad_x, grad_vectors, grad_directions,
                               w.invalid, w.invalid + 1);
    if (status != cudaSuccess) return status;
    Segments segments{{{nullptr, p.grad_x, n_node},
                       {nullptr, p.grad_vectors, n_node},
                       {nullptr, p.grad_directions, n_dir},
                       {nullptr, p.grad_basis, p.num_pairs * p.fused.width}}};
    return launch_finish<float>(segments, w.invalid, stream, walk.check);
  }
  const int64_t tiles = std::max<int64_t>(1, ceil_div(p.features, kLanes * (pack ? 4 : 1)));
  MIRAGE_DISPATCH_FLOAT(p.dtype, [&] {
    if (p.num_pairs > 0) {
      status = with_kernel_kind<scalar_t>(pack, p.fused.basis != nullptr, [&](auto v, auto fused) {
        return launch_over_pairs(backward_kernel<scalar_t, v(), fused()>, p, tiles, stream, walk.order, grad_x,
                                 grad_vectors, grad_directions, w.invalid);
      });
      if (status != cudaSuccess) return;
    }
    Segments segments{{{float32 ? nullptr : grad_x, p.grad_x, n_node},
                       {float32 ? nullptr : grad_vectors, p.grad_vectors, n_node},
                       {float32 ? nullptr : grad_directions, p.grad_directions, n_dir},
                       {nullptr, p.grad_filter, p.num_pairs * 3 * p.features}}};
    status = launch_finish<scalar_t>(segments, w.invalid, stream, walk.check);
  });
  return status;
}

}  // namespace mirage::cuda
