// Building blocks of the whole-model force-field kernels (schnet_energy, painn_energy): a block's
// Linear products over a few atom rows, their one store type, the cluster barrier and the
// largest cluster a device runs. Device code: included by .cu files only.
#pragma once

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include <cooperative_groups.h>

#include "float_arena.h"
#include "kernel_utils.cuh"

namespace mirage::cuda::atomwise {

constexpr int kThreads = 512;
constexpr int kRowTile = 4;          // rows a thread carries in registers in `product`
constexpr int kPartialFloats = kThreads * kRowTile;  // `product`'s partial sums (split sums over k)
constexpr int kMaxCluster = 16;  // Hopper's largest (non-portable) cluster

__device__ __forceinline__ float bias_at(const float* bias, int o) { return bias ? bias[o] : 0.0f; }

__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();  // release/acquire at cluster scope: global writes too
#else
  __syncthreads();  // the launcher runs a single block here
#endif
}

// cluster_sync in two halves (its release, then its acquire): what a block does between them,
// on what only it reads, runs while the other blocks arrive. Every thread calls both.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().barrier_arrive();
#else
  __syncthreads();
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().barrier_wait();
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
// Copies started only where the block reads no weights (cp.async during the message phases and
// cluster barriers before f2out's first product and the backward's in2f, and during the pair
// listing before the first product: seven of SchNet's 21 products read from shared memory) were
// slower too: 49.8 -> 57.5 us (H200, 2026-11-29 15:35, prepared weights, A/B on one machine).
// Nor is it the bytes: the weights read as bfloat16 (half of them; a timing probe) made SchNet's
// and PaiNN's kernels slower, not faster. Nsight Compute counts ~9k instructions a warp in SchNet's
// kernel, 10.5 cycles each, of which FFMA is a seventh in PaiNN's; the predicated loads cost five
// instructions each. A third loop without predicates (inputs a multiple of 128) took PaiNN 3%
// faster and SchNet 4% slower, its code 175 -> 219 KB (2026-11-29 17:41-17:58; docs/perf/
// forcefield.md, "The Verlet kernels joined").
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
// among threads too, the parts added in `partial`. A tile's rows are stored by one thread in
// order, row after row (the filters' stores rely on it: an even row's value before the odd
// row of its derivative). Every thread of the block calls it.
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

// The whole-model kernels' atom-wise products: rows a0 + r (a block's atoms), and their outputs
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

// transpose()'s tile in shared memory: 32 x 32 floats (a column of padding keeps the reads of
// its columns off a single bank).
constexpr int kTransposeTile = 32;
constexpr size_t kTransposeSharedBytes = kTransposeTile * (kTransposeTile + 1) * sizeof(float);

// a [rows][cols] into a_t [cols][rows] (its rows `stride` floats apart), a 32 x 32 tile at a time
// through shared memory so that both the reads and the writes are coalesced (read straight from
// a's columns, 4-byte loads 4 * cols bytes apart, the transposes of PaiNN's weights took 14 us
// over 64 blocks on an H200). Tile t goes to block (offset + t) % gridDim.x of this grid row;
// returns offset plus the tile count, the next call's offset, so that a sequence of calls deals
// its tiles round the blocks. Every thread of the block calls it.
__device__ inline int transpose(const float* a, int rows, int cols, float* a_t, int stride, int offset) {
  __shared__ float tile[kTransposeTile][kTransposeTile + 1];
  const int tile_rows = (rows + kTransposeTile - 1) / kTransposeTile;
  const int tile_cols = (cols + kTransposeTile - 1) / kTransposeTile;
  const int x = threadIdx.x % kTransposeTile, y0 = threadIdx.x / kTransposeTile;
  const int y_step = blockDim.x / kTransposeTile, blocks = gridDim.x;
  for (int t = ((static_cast<int>(blockIdx.x) - offset) % blocks + blocks) % blocks; t < tile_rows * tile_cols;
       t += blocks) {
    const int r0 = t / tile_cols * kTransposeTile, c0 = t % tile_cols * kTransposeTile;
    for (int y = y0; y < kTransposeTile; y += y_step)
      if (r0 + y < rows && c0 + x < cols) tile[y][x] = a[static_cast<int64_t>(r0 + y) * cols + c0 + x];
    __syncthreads();
    for (int y = y0; y < kTransposeTile; y += y_step)
      if (c0 + y < cols && r0 + x < rows) a_t[static_cast<int64_t>(c0 + y) * stride + r0 + x] = tile[x][y];
    __syncthreads();
  }
  return offset + tile_rows * tile_cols;
}

// A pair the block owns: its receiver is one of the block's atoms.
struct alignas(16) OwnPair {
  int pair, receiver, sender;
  float distance;  // its pair_distance
};

// Whole-model kernels whose params may give every pair of an open system instead of a pair list
// (a `positions` field; schnet_energy_all_pairs): with positions set, pair e = i (N - 1) + k is
// atom i receiving from atom k + (k >= i), and its vector r_j - r_i is formed here.
template <class Params, class = void>
constexpr bool kTakesAllPairs = false;
template <class Params>
constexpr bool kTakesAllPairs<Params, std::void_t<decltype(Params::positions)>> = true;

template <class Params>
__device__ __forceinline__ bool all_pairs(const Params& p) {
  if constexpr (kTakesAllPairs<Params>) return p.positions != nullptr;
  return false;
}

// Pair e's receiver i and sender j.
template <class Params>
__device__ __forceinline__ void pair_atoms(const Params& p, int64_t e, int64_t& i, int64_t& j) {
  if constexpr (kTakesAllPairs<Params>) {
    if (p.positions != nullptr) {  // 32-bit division: the op keeps N (N - 1) below 2^31
      const int others = static_cast<int>(p.num_atoms - 1), k = static_cast<int>(e) % others;
      i = static_cast<int>(e) / others;
      j = k + (k >= i ? 1 : 0);
      return;
    }
  }
  i = p.pairs[e];
  j = p.pairs[p.num_pairs + e];
}

// Pair e's vector r_j - r_i (+ shift), its atoms i and j given (pair_atoms).
template <class Params>
__device__ __forceinline__ float3 pair_vector(const Params& p, int64_t e, int64_t i, int64_t j) {
  if constexpr (kTakesAllPairs<Params>) {
    if (p.positions != nullptr) {
      const float* ri = p.positions + 3 * i;
      const float* rj = p.positions + 3 * j;
      return make_float3(rj[0] - ri[0], rj[1] - ri[1], rj[2] - ri[2]);
    }
  }
  return make_float3(p.vectors[3 * e], p.vectors[3 * e + 1], p.vectors[3 * e + 2]);
}

template <class Params>
__device__ __forceinline__ float3 pair_vector(const Params& p, int64_t e) {
  int64_t i = 0, j = 0;
  if (all_pairs(p)) pair_atoms(p, e, i, j);
  return pair_vector(p, e, i, j);
}

// |v|, computed the same way by every kernel of a call (pair_distance), so that they agree on
// which pairs count.
__device__ __forceinline__ float length(float3 v) { return sqrtf(v.x * v.x + v.y * v.y + v.z * v.z); }

template <class Params>
__device__ __forceinline__ float pair_distance(const Params& p, int64_t e) {
  return length(pair_vector(p, e));
}

// Pairs at or beyond the cutoff add exactly nothing (the cosine cutoff's value and slope are 0
// there); finite distances only: NaN and Inf stay in, to come out as NaN.
__device__ __forceinline__ bool beyond_cutoff(float distance, float cutoff) {
  return distance >= cutoff && distance <= FLT_MAX;
}
template <class Params>
__device__ __forceinline__ bool beyond_cutoff(const Params& p, int64_t e) {
  return beyond_cutoff(pair_distance(p, e), p.cutoff);
}

// Lists into `own` the pairs that atoms [a0, a1) (this block's, an even split) receive within
// the cutoff and returns their count; `counters` is 2 ints of shared memory (3 with all pairs: the
// third, set to whether a position is not finite, which every block checks). Pairs at or beyond
// the cutoff add exactly nothing, so they are left out, their gradient set to 0 here: the
// neighbor list's padding, pair (0, 0) at the cutoff, would otherwise pile onto atom 0's block
// (in MD, where molecules move apart, most of the capacity can be padding). An index out of
// range: every output NaN and -1 returned. Every block checks every index, so all of them agree
// on leaving early (none waits at a barrier alone). All pairs of an open system (all_pairs): the
// block scans its own receivers' pairs only, and writes the vectors of those it keeps into
// own_vectors (by pair; the block alone reads them). Not inlined: inlined, it took the
// schnet_energy kernel's register spills from 20 to 44 bytes.
template <class Params>
__device__ __noinline__ int own_pairs_of(const Params& p, int64_t a0, int64_t a1, OwnPair* own, int* counters,
                                         float* own_vectors = nullptr) {
  const int tid = threadIdx.x, threads = blockDim.x, block = blockIdx.x, blocks = gridDim.x;
  const int64_t N = p.num_atoms, P = p.num_pairs;
  int &count = counters[0], &invalid = counters[1];
  if (tid == 0) count = invalid = 0;
  __syncthreads();
  // All pairs of an open system: only the block's receivers' pairs, whose indices are in range.
  const int64_t e0 = all_pairs(p) ? a0 * (N - 1) : 0, e1 = all_pairs(p) ? a1 * (N - 1) : P;
  for (int64_t e = e0 + tid; e < e1; e += threads) {
    int64_t i, j;
    pair_atoms(p, e, i, j);
    if (i < 0 || i >= N || j < 0 || j >= N) {
      invalid = 1;
    } else if (i >= a0 && i < a1) {
      const float3 v = pair_vector(p, e, i, j);
      const float distance = length(v);
      if (beyond_cutoff(distance, p.cutoff)) continue;
      own[atomicAdd(&count, 1)] = OwnPair{static_cast<int>(e), static_cast<int>(i), static_cast<int>(j), distance};
      if (own_vectors != nullptr) {
        own_vectors[3 * e] = v.x;
        own_vectors[3 * e + 1] = v.y;
        own_vectors[3 * e + 2] = v.z;
      }
    }
  }
  if constexpr (kTakesAllPairs<Params>) {
    if (p.positions != nullptr) {
      if (tid == 0) counters[2] = 0;
      __syncthreads();
      for (int64_t e = tid; e < 3 * N; e += threads)
        if (!isfinite(p.positions[e])) counters[2] = 1;
    }
  }
  for (int64_t a = tid; a < N; a += threads)
    if (p.atomic_numbers[a] < 0 || p.atomic_numbers[a] >= p.num_embeddings) invalid = 1;
  __syncthreads();
  // The block's atoms' rows of grad_positions: NaN, or zero for the pairs' gradients that every
  // block adds after the cluster barriers ahead (store_pair_gradient).
  for (int64_t e = 3 * a0 + tid; e < 3 * a1; e += threads)
    p.grad_positions[e] = invalid ? __int_as_float(0x7fc00000) : 0.0f;
  if (invalid) {
    for (int64_t e = block + static_cast<int64_t>(blocks) * tid; e < P; e += static_cast<int64_t>(blocks) * threads)
      for (int c = 0; c < 3; ++c) p.grad_vectors[3 * e + c] = __int_as_float(0x7fc00000);
    if (block == 0 && tid == 0) {
      *p.energy = __int_as_float(0x7fc00000);
      if constexpr (kTakesAllPairs<Params>)
        if (p.found_pairs != nullptr) *p.found_pairs = -1;
    }
    return -1;
  }
  // After the index check: its NaNs must not race these. All pairs: the gradient in the vectors is
  // a buffer nobody reads.
  for (int64_t e = tid; e < P && !all_pairs(p); e += threads)
    if (p.pairs[e] >= a0 && p.pairs[e] < a1 && beyond_cutoff(p, e))
      for (int c = 0; c < 3; ++c) p.grad_vectors[3 * e + c] = 0.0f;
  return count;
}

// A pair's energy gradient in its vector r_j - r_i (+ shift): into grad_vectors, and onto its atoms'
// grad_positions (+ the sender's, - the receiver's; own_pairs_of zeroed them, cluster barriers ago).
template <class Params>
__device__ __forceinline__ void store_pair_gradient(const Params& p, const OwnPair& pair, const float (&g)[3]) {
  for (int c = 0; c < 3; ++c) {
    p.grad_vectors[3 * static_cast<int64_t>(pair.pair) + c] = g[c];
    atomicAdd(&p.grad_positions[3 * static_cast<int64_t>(pair.sender) + c], g[c]);
    atomicAdd(&p.grad_positions[3 * static_cast<int64_t>(pair.receiver) + c], -g[c]);
  }
}

// The readout (Linear, activation, Linear to one output) of the block's atom rows `x`, their
// energy into parts[blockIdx.x], then its backward: d energy / d x into grad_x. `readout` holds
// the hidden layer, then its gradient; `readout1_t` is readout1_w transposed [F][Kr]. Every
// thread of the block calls it.
template <class Params>
__device__ void readout_and_gradient(const Params& p, int64_t a0, int na, const float* x, int64_t x_stride,
                                     float* readout, int64_t readout_stride, const float* readout1_t, float* parts,
                                     float* grad_x, int64_t grad_stride, float* scratch) {
  const int F = p.features, Kr = p.readout_hidden;
  const AtomRows atom_row{a0};
  linear_product(na, atom_row, x, x_stride, F, p.readout1_w, p.readout1_b, Kr, AtomStore{readout, readout_stride, a0});
  float energy = 0.0f;
  for (int e = threadIdx.x; e < na * Kr; e += blockDim.x) {
    const int64_t at = (a0 + e / Kr) * readout_stride + e % Kr;
    const float v = readout[at];
    energy += activate(v, p.readout_activation) * p.readout2_w[e % Kr];
    readout[at] = activation_grad(v, p.readout_activation) * p.readout2_w[e % Kr];  // its gradient
  }
  energy = block_sum(energy, scratch);  // its barrier also orders the readout gradient's writes
  if (threadIdx.x == 0) parts[blockIdx.x] = energy + na * bias_at(p.readout2_b, 0);
  linear_product(na, atom_row, readout, readout_stride, Kr, readout1_t, nullptr, F,
                 AtomStore{grad_x, grad_stride, a0});
}

// Block 0 adds the blocks' energies, behind a cluster barrier that follows every block's part: a
// lane a part (at most kMaxCluster), so that their loads are in flight together. One thread
// adding them in a loop waited for each L2 round trip in turn, and the rest of block 0 for it at
// its next barrier, on the path of every block's next cluster barrier: SchNet's MD on benzene
// 19,908-19,945 -> 20,721-20,728 steps/s (H200, 2026-11-30, A/B on one machine, with
// total_pairs). PaiNN's kernel keeps the loop (painn_energy.cu).
__device__ inline void total_energy(float* energy, const float* parts) {
  static_assert(kMaxCluster <= 32, "a lane a block");
  if (blockIdx.x != 0 || threadIdx.x >= 32) return;
  const float total = warp_sum(threadIdx.x < gridDim.x ? __ldcg(&parts[threadIdx.x]) : 0.0f);
  if (threadIdx.x == 0) *energy = total;
}

// The largest cluster (at most kMaxCluster blocks of kThreads) this device runs kKernel in, 1
// below sm_90 (and at most MIRAGE_CLUSTER_LIMIT); cached per kernel (a template instance each)
// and device.
template <auto kKernel>
int cluster_limit() {
  static std::atomic<int> cached[64] = {};  // 0 unknown (as overlapped_launches' cache)
  int device = 0;
  cudaGetDevice(&device);
  const int known = device < 64 ? cached[device].load(std::memory_order_relaxed) : 0;
  if (known > 0) return known;
  int limit = 1;
  if (whole_model_clusters()) {
    limit = 8;  // portable
    if (cudaFuncSetAttribute(kKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) {
      LaunchConfig config(dim3(kMaxCluster), dim3(kThreads), 0, nullptr);
      int most = 0;
      if (cudaOccupancyMaxPotentialClusterSize(&most, kKernel, config.get()) == cudaSuccess && most > 0)
        limit = std::min(most, kMaxCluster);
    }
    cudaGetLastError();  // a refused query leaves the portable size; clear its error
    if (cluster_limit_from_env() > 1) limit = std::min(limit, cluster_limit_from_env());
  }
  if (device < 64) cached[device].store(limit, std::memory_order_relaxed);
  return limit;
}

// Launches kKernel as one cluster of `blocks` blocks (a plain launch below sm_90). `overlap`: it
// may start before the kernel ahead of it in the stream has finished (programmatic dependent
// launch), and must wait for it (wait_for_prior_grid) before reading what that kernel writes.
// `shared_bytes`: dynamic shared memory a block, as much as the kernel was opted in to.
template <auto kKernel, class Params>
cudaError_t launch_cluster(int blocks, const Params& params, cudaStream_t stream, bool overlap = false,
                           size_t shared_bytes = 0) {
  LaunchConfig config(dim3(blocks), dim3(kThreads), shared_bytes, stream);
  if (cluster_limit<kKernel>() > 1) {
    config.one_cluster();
    if (overlap) config.overlapped();
  }
  return config.launch(kKernel, params);
}

// PaiNN's gated update, v' = v + a_vv (U v) and s' = s + a_sv <U v, V v> + a_ss, backward at one
// atom and feature: from g = d s' and gv = d v' (3 rows `gv_stride` apart) to d (U v) and the part
// of d (V v) that does not pass through |V v| (into guv: 3 rows `uv_stride` apart as uv's, V v
// `width` after U v), and d a = (sum_xyz gv U v, g <U v, V v>, g) (into grad_a, `width` apart).
__device__ __forceinline__ void gated_update_backward(float g, float a_vv, float a_sv, const float* uv,
                                                      int64_t uv_stride, int width, const float* gv,
                                                      int64_t gv_stride, float* guv, float* grad_a) {
  float dot = 0.0f, grad_a_vv = 0.0f;
  for (int c = 0; c < 3; ++c) {
    const float u = uv[c * uv_stride], v = uv[c * uv_stride + width], grad_v = gv[c * gv_stride];
    dot = fmaf(u, v, dot);
    grad_a_vv = fmaf(grad_v, u, grad_a_vv);
    guv[c * uv_stride] = fmaf(g * a_sv, v, grad_v * a_vv);
    guv[c * uv_stride + width] = g * a_sv * u;
  }
  grad_a[0] = grad_a_vv;
  grad_a[width] = g * dot;
  grad_a[2 * width] = g;
}

}  // namespace mirage::cuda::atomwise
