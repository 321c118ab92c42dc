// mirage::schnet_energy: SchNet's energy and its gradient in the pair vectors in two launches.
//
// Small molecules are launch-bound: the layer-by-layer model is ~160 kernels per energy+forces
// (docs/perf/forcefield.md), each too small to fill the GPU. Here the filter networks, which
// depend on the distances alone, run first as a kernel of their own over many blocks (in the
// cluster they were 42% of the benzene kernel's cycles: each block's ~11 pairs in sequence on one
// multiprocessor, H200, 2026-11-24). Then one thread-block cluster runs the rest, forward and
// backward. Block b owns a contiguous range of atoms and every pair whose receiving atom it owns,
// so messages, updates and their backward stay inside the block; blocks meet at a cluster
// barrier twice per interaction: after the in2f features h_t (read by every block through the
// pairs' senders) and after the senders' gradients grad_h_t (added by every block).
// Intermediates live in a global workspace (L2-resident at these sizes); data written by another
// block is read with __ldcg, past the non-coherent L1.
// The filters' derivative in the distance is carried forward (a tangent row beside each pair's
// row in the filter network's products) instead of back-propagated: the backward then needs no
// product through the filter networks, only a dot product per pair.
// Below sm_90 (no clusters) the launcher runs one block, where the barrier is __syncthreads.
#include <cfloat>

#include <cooperative_groups.h>

#include "kernel_utils.cuh"
#include "radial_functions.cuh"
#include "schnet_energy.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kRowTile = 4;          // rows a thread carries in registers in `product`
constexpr int kPartialFloats = kThreads * kRowTile;  // `product`'s partial sums (split sums over k)
constexpr int kMaxCluster = 16;  // Hopper's largest (non-portable) cluster
// Up to this many pairs in all (the neighbor list's capacity, padding included) each block keeps
// its pairs' indices and geometry in shared memory: the message phases read them on the path of
// their loads (from the workspace, an L2 round trip each).
constexpr int kSharedPairs = 512;

// A pair the block owns (its receiver is one of the block's atoms) and its geometry.
struct alignas(16) OwnPair {
  int pair, receiver, sender, unused;
};
struct alignas(16) PairGeometry {
  float distance, cutoff_value, cutoff_slope;  // the cosine cutoff and its derivative
  float grad_distance;                          // d energy / d distance, summed over interactions
};

__host__ __device__ inline int64_t pad4(int64_t n) { return (n + 3) / 4 * 4; }

// Floats a rows x cols matrix takes in a workspace array of them, 16-byte aligned.
__host__ __device__ inline int64_t padded_matrix(int64_t rows, int64_t cols) { return pad4(rows * cols); }

// Offsets (in floats) of the workspace arrays; row strides are padded to 4 floats so that rows
// are 16-byte aligned. [T] = one per interaction.
struct Layout {
  int64_t R4, H4, M4, F4, K4, Kr4;
  // Beyond kSharedPairs pairs, each block's OwnPair and PairGeometry rows [kMaxCluster][P]
  // (otherwise in shared memory).
  int64_t own_pairs, pair_geometry;
  int64_t filter_out;     // [T][P][M4]: the filters before the cutoff (schnet_filters_kernel)
  int64_t filter_slope;   // [T][P][M4]: their derivative in the distance
  int64_t x;            // [N][F4]: atom features
  int64_t h;            // [T][N][M4]: in2f(x), read by every block
  int64_t grad_h;       // [T][N][M4]: added to by every block
  int64_t m;            // [N][M4]: messages, later their gradient
  int64_t q;            // [T][N][K4]: f2out's hidden layer before the activation
  int64_t u;            // [N][K4]: after it, later the gradient before it
  int64_t readout;      // [N][Kr4]: the readout's hidden layer, later its gradient
  int64_t grad_x;       // [N][F4]
  int64_t parts;        // [kMaxCluster]: each block's share of the energy
  // The atom-wise weights transposed (schnet_filters_kernel), for the backward's products:
  // readout1 [F][Kr], then per interaction f2out2 [K][F], f2out1 [M][K], in2f [F][M] (each
  // interaction's matrix padded_matrix(...) floats after the last one's).
  int64_t readout1_t, f2out2_t, f2out1_t, in2f_t;
  int64_t total;
};

__host__ __device__ inline Layout layout_of(const SchnetEnergyParams& p) {
  Layout l{};
  const int64_t N = p.num_atoms, P = p.num_pairs, T = p.num_interactions;
  l.R4 = pad4(p.num_rbf);
  l.H4 = pad4(p.filter_hidden);
  l.M4 = pad4(p.message_width);
  l.F4 = pad4(p.features);
  l.K4 = pad4(p.update_hidden);
  l.Kr4 = pad4(p.readout_hidden);
  int64_t at = 0;
  const auto take = [&at](int64_t floats) {
    const int64_t offset = at;
    at += pad4(floats);
    return offset;
  };
  const int64_t per_block_pairs = P > kSharedPairs ? kMaxCluster * P : 0;
  l.own_pairs = take(4 * per_block_pairs);
  l.pair_geometry = take(4 * per_block_pairs);
  l.filter_out = take(T * P * l.M4);
  l.filter_slope = take(T * P * l.M4);
  l.x = take(N * l.F4);
  l.h = take(T * N * l.M4);
  l.grad_h = take(T * N * l.M4);
  l.m = take(N * l.M4);
  l.q = take(T * N * l.K4);
  l.u = take(N * l.K4);
  l.readout = take(N * l.Kr4);
  l.grad_x = take(N * l.F4);
  l.parts = take(kMaxCluster);
  const int64_t F = p.features, M = p.message_width, K = p.update_hidden;
  l.readout1_t = take(F * p.readout_hidden);
  l.f2out2_t = take(T * padded_matrix(K, F));
  l.f2out1_t = take(T * padded_matrix(M, K));
  l.in2f_t = take(T * padded_matrix(F, M));
  l.total = at;
  return l;
}

__device__ __forceinline__ float bias_at(const float* bias, int o) { return bias ? bias[o] : 0.0f; }

// |vectors[e]|, computed the same way by both kernels, so that they agree on which pairs count.
__device__ __forceinline__ float pair_distance(const SchnetEnergyParams& p, int64_t e) {
  const float vx = p.vectors[3 * e], vy = p.vectors[3 * e + 1], vz = p.vectors[3 * e + 2];
  return sqrtf(vx * vx + vy * vy + vz * vz);
}

// Pairs at or beyond the cutoff add exactly nothing (the cosine cutoff's value and slope are 0
// there); finite distances only: NaN and Inf stay in, to come out as NaN.
__device__ __forceinline__ bool beyond_cutoff(const SchnetEnergyParams& p, int64_t e) {
  const float d = pair_distance(p, e);
  return d >= p.cutoff && d <= FLT_MAX;
}

__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();  // release/acquire at cluster scope: global writes too
#else
  __syncthreads();  // the launcher runs a single block here
#endif
}

// p[k .. k + 3], zero from n on. kVector: p + k is 16-byte aligned and n % 4 == 0, so one float4
// load, predicated (branch-free: the kernel is large enough that its code is fetched from L2 at
// every call, and each branch path of an unrolled loop adds to it).
template <bool kVector>
__device__ __forceinline__ float4 load4(const float* p, int k, int n) {
  if constexpr (kVector) return k < n ? *reinterpret_cast<const float4*>(p + k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  return make_float4(k < n ? p[k] : 0.0f, k + 1 < n ? p[k + 1] : 0.0f, k + 2 < n ? p[k + 2] : 0.0f,
                     k + 3 < n ? p[k + 3] : 0.0f);
}

__device__ __forceinline__ float dot4(float acc, float4 a, float4 w) {
  return fmaf(a.w, w.w, fmaf(a.z, w.z, fmaf(a.y, w.y, fmaf(a.x, w.x, acc))));
}

// kRows rows from `first` (clamped to the last row; what they add past it is dropped) times the
// outputs o, o + 1 of this lane's group. See linear_product.
template <int kRows, bool kVector, class RowOf, class Store>
__device__ __forceinline__ void linear_tile(int first, int rows, RowOf row_of, const float* in, int64_t in_stride,
                                            int ins, const float* w, const float* bias, int o, int outs, Store store) {
  const int lane = threadIdx.x % 32, li = lane % 8;
  // The biases first: loaded behind the product, they cost a memory round trip of their own.
  const float b0 = o < outs ? bias_at(bias, o) : 0.0f, b1 = o + 1 < outs ? bias_at(bias, o + 1) : 0.0f;
  float acc[kRows][2] = {};
  const float* x[kRows];
#pragma unroll
  for (int t = 0; t < kRows; ++t) x[t] = in + row_of(min(first + t, rows - 1)) * in_stride;
  // Rows o and o + 1 of w, empty past its last.
  const float* w_o = w + static_cast<int64_t>(o) * ins;
  const int n0 = o < outs ? ins : 0, n1 = o + 1 < outs ? ins : 0;
#pragma unroll 1  // one pass at 128 inputs; unrolled it only multiplies the code (see load4)
  for (int k0 = 0; k0 < ins; k0 += 128) {
    float4 w0[4], w1[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int k = k0 + 4 * (li + 8 * c);
      w0[c] = load4<kVector>(w_o, k, n0);
      w1[c] = load4<kVector>(w_o + ins, k, n1);
    }
#pragma unroll
    for (int t = 0; t < kRows; ++t) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float4 a = load4<kVector>(x[t], k0 + 4 * (li + 8 * c), ins);
        acc[t][0] = dot4(acc[t][0], a, w0[c]);
        acc[t][1] = dot4(acc[t][1], a, w1[c]);
      }
    }
  }
  // The group's 8 lanes add their parts: lanes 0-3 keep output o, lanes 4-7 output o + 1.
  const bool upper = li & 4;
#pragma unroll
  for (int t = 0; t < kRows; ++t) {
    float v = (upper ? acc[t][1] : acc[t][0]) + __shfl_xor_sync(0xffffffffu, upper ? acc[t][0] : acc[t][1], 4);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    const int out = o + (upper ? 1 : 0);
    if (li % 4 == 0 && first + t < rows && out < outs) store(first + t, out, v, upper ? b1 : b0);
  }
}

// nn.Linear: for r < rows and o < outs, store(r, o, sum_k in[row_of(r)][k] * w[o][k], bias[o]) (a
// null bias: 0), w [outs][ins], the input rows `in_stride` floats apart and 16-byte aligned. The
// weights' rows are contiguous in k, so lanes go along k: a group of 8 lanes covers 128 inputs
// (lane l the float4s at 4 (l + 8 c), so a group reads 128 consecutive bytes at once), holds the
// weights of two outputs in registers and multiplies up to 4 rows by them; a warp is 4 groups (8
// outputs), the block 128 outputs at a time. Every Linear uses it (the backward's on the
// transposed weights) but the filters' first (few inputs, the radial basis: most lanes would
// idle), where `product` is faster. Against `product` (H200, benzene, one block
// an atom): a 128 x 128 product of one row ~3-5k cycles instead of ~10-13k, of 11 pair rows ~12k
// instead of ~21k; the whole kernel 219 -> 175 us. Every thread of the block calls it; it ends
// with a barrier. Not inlined: its registers on top of the kernel's would spill.
//
// The code size matters as much as the arithmetic: the kernel's code (460 KB on sm_90a then) did
// not fit the instruction caches, so each phase waited for its instructions from L2 (ncu: "no
// instruction" stalls). Keeping the loads branch-free (load4) and the k loop rolled cut the
// benzene kernel from 136 to 114 us (H200, 2026-11-24); one store type for every atom-wise
// product (AtomStore) took the code to 194 KB.
//
// A one-row product's ~2.8k cycles are mostly its 64 KB of weights arriving. Fetching the next
// product's weights ahead, while this one runs, made each product slower, not faster (H200,
// 2026-11-24, benzene): into L1 with prefetch.global.L1, 2.8k -> 3.2-3.6k cycles; into shared
// memory with cp.async (two 64 KB slots), 4.0-4.7k. The fetch seems bound by the requests one
// multiprocessor keeps in flight, which the early fetch shares with the product's own loads.
// Staging every product's weights in shared memory with the bulk-copy engine (TMA,
// cp.async.bulk into two 64 KB slots, each refilled for the product after next, the products
// reading them from there) was slower still: the cluster kernel 48 -> 74 us (H200, 2026-11-24
// 14:45, benzene, all -m cuda schnet_energy tests passing), and with one copy multicast to the
// whole cluster by block 0 (slots released to it through an mbarrier in its shared memory) 48 ->
// 68 us (14:52): a 64 KB bulk copy seems to arrive no faster than the product's own loads.
template <bool kVector, class RowOf, class Store>
__device__ __forceinline__ void linear_rows(int rows, RowOf row_of, const float* in, int64_t in_stride, int ins,
                                            const float* w, const float* bias, int outs, Store store) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int o0 = warp * 8; o0 < outs; o0 += warps * 8) {
    const int o = o0 + 2 * (lane / 8);
    int first = 0;
    for (; first + 1 < rows; first += 4)  // 4 rows at a time while two or more are left
      linear_tile<4, kVector>(first, rows, row_of, in, in_stride, ins, w, bias, o, outs, store);
    if (first < rows) linear_tile<1, kVector>(first, rows, row_of, in, in_stride, ins, w, bias, o, outs, store);
  }
}

template <class RowOf, class Store>
__device__ __noinline__ void linear_product(int rows, RowOf row_of, const float* in, int64_t in_stride, int ins,
                                            const float* w, const float* bias, int outs, Store store) {
  if (ins % 4 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0)
    linear_rows<true>(rows, row_of, in, in_stride, ins, w, bias, outs, store);
  else
    linear_rows<false>(rows, row_of, in, in_stride, ins, w, bias, outs, store);
  __syncthreads();
}

// For r < rows and o < outs: store(r, o, sum_k in[row_of(r)][k] * w[o][k], bias[o]), w [outs][ins], the
// input rows `in_stride` floats apart and 16-byte aligned: nn.Linear for few inputs (the filters'
// first, on the radial basis, where most of linear_product's lanes would idle). Thread items are
// (o, tile of kRowTile rows), o fastest. With fewer items than threads the sum over k is split
// among threads too, the parts added in `partial`. Every thread of the block calls it.
template <class RowOf, class Store>
__device__ __forceinline__ void product(int rows, RowOf row_of, const float* in, int64_t in_stride, int ins,
                                        const float* w, const float* bias, int outs, Store store, float* partial) {
  const int tiles = (rows + kRowTile - 1) / kRowTile, items = outs * tiles;
  int splits = 1;
  while (2 * splits * items <= static_cast<int>(blockDim.x) && ins >= 32 * splits) splits *= 2;
  const int chunk = static_cast<int>(pad4((ins + splits - 1) / splits));
  const bool vector = ins % 4 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;
  for (int work = threadIdx.x; work < items * splits; work += blockDim.x) {
    const int item = work % items, split = work / items;
    const int o = item % outs, tile = item / outs;
    const int k0 = split * chunk, k1 = min(ins, k0 + chunk);
    const float b = splits == 1 ? bias_at(bias, o) : 0.0f;  // ahead of the product (see linear_tile)
    const float* row[kRowTile];
#pragma unroll
    for (int t = 0; t < kRowTile; ++t) row[t] = in + row_of(min(tile * kRowTile + t, rows - 1)) * in_stride;
    const float* wo = w + static_cast<int64_t>(o) * ins;
    float acc[kRowTile] = {};
    if (vector) {
#pragma unroll 2
      for (int k = k0; k < k1; k += 4) {
        const float4 wv = *reinterpret_cast<const float4*>(wo + k);
#pragma unroll
        for (int t = 0; t < kRowTile; ++t) acc[t] = dot4(acc[t], *reinterpret_cast<const float4*>(row[t] + k), wv);
      }
    } else {
      for (int k = k0; k < k1; ++k) {
#pragma unroll
        for (int t = 0; t < kRowTile; ++t) acc[t] += row[t][k] * wo[k];
      }
    }
#pragma unroll
    for (int t = 0; t < kRowTile; ++t) {
      if (splits > 1) partial[work * kRowTile + t] = acc[t];
      else if (tile * kRowTile + t < rows) store(tile * kRowTile + t, o, acc[t], b);
    }
  }
  if (splits == 1) return;
  __syncthreads();
  for (int item = threadIdx.x; item < items; item += blockDim.x) {
    const int o = item % outs, tile = item / outs;
    const float b = bias_at(bias, o);
#pragma unroll
    for (int t = 0; t < kRowTile; ++t) {
      float sum = 0.0f;
      for (int split = 0; split < splits; ++split) sum += partial[(split * items + item) * kRowTile + t];
      if (tile * kRowTile + t < rows) store(tile * kRowTile + t, o, sum, b);
    }
  }
  __syncthreads();  // partial is free again
}

// The schnet_energy kernel's atom-wise products: rows a0 + r (a block's atoms), and their outputs
// out[a0 + r][o] = f(v), written or (accumulate) added, `stride` floats a row. Forward, with the
// bias b: f = activate(v + b), v + b kept in `pre` where given. Backward (the transposed weights,
// no bias): f = v * activation_grad(gate[a0 + r][o]) where a gate is given, else v. One type for every
// call, so that each product's code is compiled once: the kernel's code outgrows the instruction
// caches (see linear_product), and a phase whose instructions were fetched by the last one runs
// without waiting for them.
struct AtomRows {
  int64_t a0;
  __device__ int64_t operator()(int r) const { return a0 + r; }
};

struct AtomStore {
  float* out;
  int64_t stride, a0;
  Activation activation = Activation::kNone;
  float* pre = nullptr;
  const float* gate = nullptr;
  bool accumulate = false;
  __device__ void operator()(int r, int o, float v, float b) const {
    const int64_t at = (a0 + r) * stride + o;
    if (gate != nullptr) {
      v *= activation_grad(gate[at], activation);
    } else {
      v += b;
      if (pre != nullptr) pre[at] = v;
      v = activate(v, activation);
    }
    out[at] = accumulate ? out[at] + v : v;
  }
};

// Pairs a block of schnet_filters_kernel takes through one interaction's filter network: their
// value and derivative rows (8) are two row tiles of `product` and `linear_product`. Benzene's
// 132 pairs and 3 interactions make 99 blocks, one wave; with 2 pairs a block (one row tile)
// the kernel took 12 us in two waves (H200).
constexpr int kFilterPairs = 4;
static_assert((2 * kFilterPairs) % kRowTile == 0 && kRowTile % 2 == 0,
              "a pair's value and derivative rows must share a row tile, and a block's rows make whole tiles");

size_t filters_shared_bytes(const Layout& l) { return 2 * kFilterPairs * (l.R4 + l.H4) * sizeof(float); }

// schnet_filters_kernel's blocks of row T (at least this many) transpose the atom-wise weights.
constexpr int kTransposeBlocks = 8;

// a [rows][cols] into a_t [cols][rows], over the blocks of this grid row (writes coalesced).
__device__ void transpose(const float* a, int rows, int cols, float* a_t) {
  const int64_t count = static_cast<int64_t>(rows) * cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < count;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    a_t[e] = a[(e % rows) * cols + e / rows];
}

// The backward's products read the atom-wise weights transposed, so that they run as
// linear_product, lanes along the inputs: the products of each weight's columns (a thread per
// four outputs, a slice of k, the slices' sums met in shared memory behind a second barrier) took
// ~4k cycles a one-row product on benzene where linear_product takes ~2.8k (H200, 2026-11-24).
__device__ void transpose_weights(const SchnetEnergyParams& p) {
  const Layout L = layout_of(p);
  float* ws = static_cast<float*>(p.workspace);
  const int F = p.features, M = p.message_width, K = p.update_hidden;
  transpose(p.readout1_w, p.readout_hidden, F, ws + L.readout1_t);
  for (int t = 0; t < p.num_interactions; ++t) {
    const SchnetInteraction& layer = p.interactions[t];
    transpose(layer.f2out2_w, F, K, ws + L.f2out2_t + t * padded_matrix(K, F));
    transpose(layer.f2out1_w, K, M, ws + L.f2out1_t + t * padded_matrix(M, K));
    transpose(layer.in2f_w, M, F, ws + L.in2f_t + t * padded_matrix(F, M));
  }
}

// Each interaction's filters before the cutoff and their derivatives in the distance, on every
// pair but those at or beyond the cutoff (the cluster kernel leaves them out), into the
// workspace's filter_out and filter_slope. Block (b, t): pairs kFilterPairs b on, interaction t;
// the blocks (b, T) transpose the atom-wise weights instead (transpose_weights).
// The derivative is carried forward: a row of the basis' derivative goes through the same
// products beside each pair's row, without the biases, times the activation's slope between them.
__global__ void __launch_bounds__(kThreads) schnet_filters_kernel(const __grid_constant__ SchnetEnergyParams p) {
  extern __shared__ float4 shared_rows[];  // [2 kFilterPairs][R4] basis, then [2 kFilterPairs][H4] hidden
  __shared__ float4 partial[kPartialFloats / 4];
  if (blockIdx.y == p.num_interactions) {
    transpose_weights(p);
    return;
  }
  const Layout L = layout_of(p);
  const int64_t P = p.num_pairs, R4 = L.R4, H4 = L.H4, M4 = L.M4;
  const int R = p.num_rbf, H = p.filter_hidden, M = p.message_width, t = blockIdx.y;
  const SchnetInteraction& layer = p.interactions[t];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kFilterPairs;
  // A block whose pairs all lie at or beyond the cutoff has nothing to compute: the cluster kernel
  // leaves such pairs out (in MD most of the capacity can be such padding).
  const bool needed = threadIdx.x < kFilterPairs && first + threadIdx.x < P && !beyond_cutoff(p, first + threadIdx.x);
  if (!__syncthreads_or(needed)) return;
  float* basis = reinterpret_cast<float*>(shared_rows);
  float* hidden = basis + 2 * kFilterPairs * R4;
  // Row 2 q is pair first + q's value, row 2 q + 1 its derivative; past the last pair the rows
  // repeat it, their results not stored.
  const float spacing = gaussian_spacing(R, p.cutoff);
  for (int e = threadIdx.x; e < kFilterPairs * R; e += blockDim.x) {
    const int q = e / R, k = e % R;
    const float d = pair_distance(p, min(first + q, P - 1)), value = gaussian(d, k, spacing);
    basis[2 * q * R4 + k] = value;
    basis[(2 * q + 1) * R4 + k] = gaussian_derivative(value, d, k, spacing);
  }
  __syncthreads();
  const auto row = [](int r) -> int64_t { return r; };
  // product's thread stores a row tile's rows in order: the value's store leaves the
  // activation's slope where the derivative's store multiplies by it.
  const auto to_hidden = [&](int r, int o, float v, float b) {
    float* at = hidden + r * H4 + o;
    if (r % 2 == 0) {
      const float pre = v + b;
      at[0] = activate(pre, p.filter_activation);
      at[H4] = activation_grad(pre, p.filter_activation);
    } else {
      at[0] *= v;
    }
  };
  product(2 * kFilterPairs, row, basis, R4, R, layer.filter1_w, layer.filter1_b, H, to_hidden,
          reinterpret_cast<float*>(partial));
  __syncthreads();
  float* ws = static_cast<float*>(p.workspace);
  float *out = ws + L.filter_out + t * P * M4, *slope = ws + L.filter_slope + t * P * M4;
  linear_product(2 * kFilterPairs, row, hidden, H4, H, layer.filter2_w, layer.filter2_b, M,
                 [&](int r, int o, float v, float b) {
    const int64_t pair = first + r / 2;
    if (pair >= P) return;
    if (r % 2 == 0) out[pair * M4 + o] = v + b;
    else slope[pair * M4 + o] = v;
  });
}

__global__ void __launch_bounds__(kThreads) schnet_energy_kernel(const __grid_constant__ SchnetEnergyParams p) {
  __shared__ int own_pairs, invalid;
  __shared__ OwnPair shared_own_pairs[kSharedPairs];
  __shared__ PairGeometry shared_geometry[kSharedPairs];
  __shared__ float scratch[32];
  const int tid = threadIdx.x, threads = blockDim.x, block = blockIdx.x, blocks = gridDim.x;
  const int64_t N = p.num_atoms, P = p.num_pairs;
  const int M = p.message_width, F = p.features;
  const int K = p.update_hidden, Kr = p.readout_hidden, T = p.num_interactions;
  const Layout L = layout_of(p);
  const int64_t M4 = L.M4, F4 = L.F4, K4 = L.K4, Kr4 = L.Kr4;
  float* ws = static_cast<float*>(p.workspace);
  const bool shared_pairs = P <= kSharedPairs;
  OwnPair* own = shared_pairs ? shared_own_pairs : reinterpret_cast<OwnPair*>(ws + L.own_pairs) + block * P;
  PairGeometry* geometry =
      shared_pairs ? shared_geometry : reinterpret_cast<PairGeometry*>(ws + L.pair_geometry) + block * P;
  float *x = ws + L.x, *m = ws + L.m, *u = ws + L.u, *readout = ws + L.readout, *grad_x = ws + L.grad_x;
  const auto filter_out = [&](int t) { return ws + L.filter_out + t * P * M4; };
  const auto filter_slope = [&](int t) { return ws + L.filter_slope + t * P * M4; };
  const auto h = [&](int t) { return ws + L.h + t * N * M4; };
  const auto grad_h = [&](int t) { return ws + L.grad_h + t * N * M4; };
  const auto q = [&](int t) { return ws + L.q + t * N * K4; };
  const int64_t* senders = p.pairs + P;

  // This block's atoms [a0, a1) (an even split) and the pairs they receive within the cutoff.
  // Pairs at or beyond it add exactly nothing (the cosine cutoff's value and slope are 0 there),
  // so they are left out, their gradient 0: the neighbor list's padding, pair (0, 0) at the
  // cutoff, would otherwise pile onto atom 0's block (in MD, where molecules move apart, most of
  // the capacity can be padding). Every block checks every index, so all of them agree on leaving
  // early (none waits at a barrier alone).
  const int64_t a0 = block * N / blocks, a1 = (block + 1) * N / blocks;
  const int na = static_cast<int>(a1 - a0);
  if (tid == 0) own_pairs = invalid = 0;
  __syncthreads();
  for (int64_t e = tid; e < P; e += threads) {
    const int64_t i = p.pairs[e], j = senders[e];
    if (i < 0 || i >= N || j < 0 || j >= N) invalid = 1;
    else if (i >= a0 && i < a1 && !beyond_cutoff(p, e))
      own[atomicAdd(&own_pairs, 1)] = OwnPair{static_cast<int>(e), static_cast<int>(i), static_cast<int>(j), 0};
  }
  for (int64_t a = tid; a < N; a += threads)
    if (p.atomic_numbers[a] < 0 || p.atomic_numbers[a] >= p.num_embeddings) invalid = 1;
  __syncthreads();
  if (invalid) {
    for (int64_t e = block + static_cast<int64_t>(blocks) * tid; e < P; e += static_cast<int64_t>(blocks) * threads)
      for (int c = 0; c < 3; ++c) p.grad_vectors[3 * e + c] = __int_as_float(0x7fc00000);
    if (block == 0 && tid == 0) *p.energy = __int_as_float(0x7fc00000);
    return;
  }
  for (int64_t e = tid; e < P; e += threads)  // after the index check: its NaNs must not race these
    if (p.pairs[e] >= a0 && p.pairs[e] < a1 && beyond_cutoff(p, e))
      for (int c = 0; c < 3; ++c) p.grad_vectors[3 * e + c] = 0.0f;
  const int np = own_pairs;
  const AtomRows atom_row{a0};
  const auto to = [&](float* out, int64_t stride) { return AtomStore{out, stride, a0}; };

  for (int e = tid; e < T * na * M; e += threads) {
    const int t = e / (na * M), rest = e % (na * M);
    grad_h(t)[(a0 + rest / M) * M4 + rest % M] = 0.0f;
  }
  // Geometry of the block's pairs (read by the messages, after the barriers below).
  for (int r = tid; r < np; r += threads) {
    const float d = pair_distance(p, own[r].pair);
    geometry[r] = PairGeometry{d, envelope(CutoffFn::kCosine, d, p.cutoff),
                               envelope_derivative(CutoffFn::kCosine, d, p.cutoff), 0.0f};
  }

  // Forward over the atoms. m, where the messages are added up, is zeroed here and after each
  // interaction's last read of it (the barriers before the next messages order the writes).
  for (int e = tid; e < na * F; e += threads) {
    const int64_t a = a0 + e / F;
    x[a * F4 + e % F] = p.embedding[p.atomic_numbers[a] * F + e % F];
  }
  const auto zero_messages = [&] {
    for (int e = tid; e < na * M; e += threads) m[(a0 + e / M) * M4 + e % M] = 0.0f;
  };
  zero_messages();
  __syncthreads();
  const auto features_to_h = [&](int t) {
    const SchnetInteraction& layer = p.interactions[t];
    linear_product(na, atom_row, x, F4, F, layer.in2f_w, layer.in2f_b, M, to(h(t), M4));
  };
  features_to_h(0);
  cluster_sync();
  for (int t = 0; t < T; ++t) {
    const SchnetInteraction& layer = p.interactions[t];
    const float* ht = h(t);
    const float* filters = filter_out(t);
    for (int e = tid; e < np * M; e += threads) {
      const int r = e / M, o = e % M;
      const OwnPair pair = own[r];
      const float w = filters[pair.pair * M4 + o] * geometry[r].cutoff_value;
      atomicAdd(&m[pair.receiver * M4 + o], __ldcg(&ht[pair.sender * M4 + o]) * w);
    }
    __syncthreads();
    AtomStore to_u = to(u, K4);  // u = activation(q), q kept for the backward
    to_u.activation = layer.update_activation;
    to_u.pre = q(t);
    linear_product(na, atom_row, m, M4, M, layer.f2out1_w, layer.f2out1_b, K, to_u);
    zero_messages();
    AtomStore add_to_x = to(x, F4);
    add_to_x.accumulate = true;
    linear_product(na, atom_row, u, K4, K, layer.f2out2_w, layer.f2out2_b, F, add_to_x);
    if (t + 1 < T) {
      features_to_h(t + 1);
      cluster_sync();
    }
  }
  linear_product(na, atom_row, x, F4, F, p.readout1_w, p.readout1_b, Kr, to(readout, Kr4));
  float energy = 0.0f;
  for (int e = tid; e < na * Kr; e += threads) {
    const int64_t at = (a0 + e / Kr) * Kr4 + e % Kr;
    const float v = readout[at];
    energy += activate(v, p.readout_activation) * p.readout2_w[e % Kr];
    readout[at] = activation_grad(v, p.readout_activation) * p.readout2_w[e % Kr];  // its gradient
  }
  energy = block_sum(energy, scratch);  // its barrier also orders the readout gradient's writes
  if (tid == 0) ws[L.parts + block] = energy + na * bias_at(p.readout2_b, 0);

  // Backward. grad_x = d energy / d x, interaction by interaction from the last.
  // The backward's products read the weights transposed (transpose_weights).
  linear_product(na, atom_row, readout, Kr4, Kr, ws + L.readout1_t, nullptr, F, to(grad_x, F4));
  AtomStore add_to_grad_x = to(grad_x, F4);
  add_to_grad_x.accumulate = true;
  for (int t = T - 1; t >= 0; --t) {
    const SchnetInteraction& layer = p.interactions[t];
    AtomStore to_grad_q = to(u, K4);  // the gradient before f2out's activation, in u
    to_grad_q.activation = layer.update_activation;
    to_grad_q.gate = q(t);
    linear_product(na, atom_row, grad_x, F4, F, ws + L.f2out2_t + t * padded_matrix(K, F), nullptr, K, to_grad_q);
    linear_product(na, atom_row, u, K4, K, ws + L.f2out1_t + t * padded_matrix(M, K), nullptr, M, to(m, M4));
    // Per pair (i <- j), w = filter * fcut: grad_h[j] += grad_m[i] * w, and d energy / d distance
    // += sum over features of grad_m[i] * h[j] * dw/dd. One warp a pair.
    const float* ht = h(t);
    float* ght = grad_h(t);
    const float *filters = filter_out(t), *slopes = filter_slope(t);
    const int lane = tid % 32;
    for (int r = tid / 32; r < np; r += threads / 32) {
      const OwnPair own_pair = own[r];
      const int64_t pair = own_pair.pair, i = own_pair.receiver, j = own_pair.sender;
      const float fcut = geometry[r].cutoff_value, fcut_slope = geometry[r].cutoff_slope;
      float distance_sum = 0.0f;
      for (int o = lane; o < M; o += 32) {
        const float gm = m[i * M4 + o], f = filters[pair * M4 + o];
        atomicAdd(&ght[j * M4 + o], gm * f * fcut);
        distance_sum += gm * __ldcg(&ht[j * M4 + o]) * (f * fcut_slope + slopes[pair * M4 + o] * fcut);
      }
      distance_sum = warp_sum(distance_sum);
      if (lane == 0) geometry[r].grad_distance += distance_sum;
    }
    cluster_sync();  // grad_h(t) complete; every block's energy share written
    if (t == T - 1 && block == 0 && tid == 0) {
      float total = 0.0f;
      for (int b = 0; b < blocks; ++b) total += __ldcg(&ws[L.parts + b]);
      *p.energy = total;
    }
    for (int e = tid; e < na * M; e += threads) {
      const int64_t at = (a0 + e / M) * M4 + e % M;
      m[at] = __ldcg(&ght[at]);
    }
    __syncthreads();
    linear_product(na, atom_row, m, M4, M, ws + L.in2f_t + t * padded_matrix(F, M), nullptr, F, add_to_grad_x);
  }

  // d energy / d vectors = (d energy / d distance) * v / |v| (0 at |v| = 0, as PyTorch's norm).
  for (int r = tid; r < np; r += threads) {
    const int64_t pair = own[r].pair;
    const float d = geometry[r].distance;
    const float scale = d > 0.0f ? geometry[r].grad_distance / d : 0.0f;
    for (int c = 0; c < 3; ++c) p.grad_vectors[3 * pair + c] = scale * p.vectors[3 * pair + c];
  }
}

// The largest cluster this device runs the kernel in (1 below sm_90), per device.
int cluster_limit() {
  static int cached[64] = {};
  int device = 0, major = 0;
  cudaGetDevice(&device);
  if (device < 64 && cached[device] > 0) return cached[device];
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  int limit = 1;
  if (major >= 9) {
    limit = 8;  // portable
    if (cudaFuncSetAttribute(schnet_energy_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) ==
        cudaSuccess) {
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(kMaxCluster);
      config.blockDim = dim3(kThreads);
      int most = 0;
      if (cudaOccupancyMaxPotentialClusterSize(&most, schnet_energy_kernel, &config) == cudaSuccess && most > 0)
        limit = std::min(most, kMaxCluster);
    }
    cudaGetLastError();  // a refused query leaves the portable size; clear its error
  }
  if (device < 64) cached[device] = limit;
  return limit;
}

cudaError_t launch_schnet_filters(const SchnetEnergyParams& params, cudaStream_t stream) {
  const size_t shared = filters_shared_bytes(layout_of(params));
  // Static and dynamic shared memory beyond the default 48 KB (filter networks ~1,000 wide or
  // more) need the kernel's opt-in; beyond the device's limit the launch fails with its error.
  if (shared + kPartialFloats * sizeof(float) > 48 * 1024) {
    const cudaError_t error = cudaFuncSetAttribute(schnet_filters_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(shared));
    if (error != cudaSuccess) return error;
  }
  const int64_t pair_blocks = ceil_div(params.num_pairs, kFilterPairs);
  const dim3 grid(static_cast<unsigned>(std::max<int64_t>(pair_blocks, kTransposeBlocks)), params.num_interactions + 1);
  schnet_filters_kernel<<<grid, kThreads, shared, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace

size_t schnet_energy_workspace_bytes(const SchnetEnergyParams& params) {
  return static_cast<size_t>(layout_of(params).total) * sizeof(float);
}

cudaError_t launch_schnet_energy(const SchnetEnergyParams& params, cudaStream_t stream) {
  const cudaError_t error = launch_schnet_filters(params, stream);
  if (error != cudaSuccess) return error;
  const int limit = cluster_limit();
  const int blocks = static_cast<int>(std::min<int64_t>(limit, std::max<int64_t>(params.num_atoms, 1)));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = blocks;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  if (limit > 1) {
    config.attrs = &cluster;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, schnet_energy_kernel, params);
}

}  // namespace mirage::cuda
