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
// pairs' senders) and after the senders' gradients grad_h_t (added by every block; none for the
// first interaction, whose h is of the embedding, without a gradient in the positions).
// Intermediates live in a global workspace (L2-resident at these sizes); data written by another
// block is read with __ldcg, past the L1, or in place after the cluster barrier whose acquire
// makes it visible.
// The filters' derivative in the distance is carried forward (a tangent row beside each pair's
// row in the filter network's products) instead of back-propagated: the backward then needs no
// product through the filter networks, only a dot product per pair.
// The cluster kernel starts beside the filters kernel (programmatic dependent launch): its pairs,
// embedding and first product need none of the filters.
// Below sm_90 (no clusters) the launcher runs one block, where the barrier is __syncthreads.
// Prepared (mirage::schnet_energy_prepare, for runs of calls with the same weights: an MD run), the
// filters kernel's work is done once: the filter networks as radial_cfconv's tables (the cosine
// cutoff in them), which each block reads for its own pairs, and the transposed weights; and the
// first in2f of every embedding row, looked up by species. The op is then the cluster kernel
// alone: an MD step of SchNet on benzene 66 -> 59.5 us (H200, 2026-11-29); its phases' times are
// in docs/perf/forcefield.md ("Work the cluster kernel no longer does").
//
// Tried and not kept (H200, 2026-11-27, benzene, every -m cuda schnet_energy test passing in each
// version): the cluster's blocks splitting every Linear by its outputs instead of the atoms, each
// block a sixteenth of each weight (staged in its shared memory) and every atom's row; the
// messages and their backward then need only the block's own columns, and the products' inputs,
// whole rows, were written by each block into every block's shared memory (distributed shared
// memory) before a cluster barrier, 19 of them a call. The cluster kernel took 85-111 us against
// 48: each product ~2.7-3 us by globaltimer stamps, of which the barrier's wait was ~0.03-0.3 us;
// Nsight Compute counted 14.6k instructions a warp (3.7M in all) at 11 cycles a warp per issued
// instruction. The per-column products, the stores to 16 blocks and the index arithmetic of a
// phase cost more instructions than the row-split kernel's phases spend waiting for weights.
// Written again from scratch (2026-11-29, same tests passing): eight lanes an output, a product
// 1.2-2.2 us and its barrier 0.4-1.0 us, yet 76 us in all (weights staged by cp.async; 12 us of
// it issuing their 4-byte copies, 9 us each interaction's message backward); a probe of the bare
// phase had promised 1.3 us. Near 48 us at best: docs/perf/forcefield.md, "A column-split cluster
// kernel".
#include "atom_products.cuh"
#include "cfconv.cuh"
#include "filter_table.h"
#include "radial_functions.cuh"
#include "schnet_energy.cuh"

namespace mirage::cuda {
namespace {

using namespace atomwise;

// Up to this many pairs in all (the neighbor list's capacity, padding included) each block keeps
// its pairs' indices and geometry in shared memory: the message phases read them on the path of
// their loads (from the workspace, an L2 round trip each).
constexpr int kSharedPairs = 512;

// The geometry of a pair the block owns.
struct alignas(16) PairGeometry {
  float distance, cutoff_value, cutoff_slope;  // the cosine cutoff and its derivative
  float grad_distance;                          // d energy / d distance, summed over interactions
};

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
  int64_t grad_h;       // [T - 1][N][M4]: added to by every block (none for interaction 0: see the backward)
  int64_t m;            // [N][M4]: messages, later their gradient
  int64_t q;            // [T][N][K4]: f2out's hidden layer before the activation
  int64_t u;            // [N][K4]: after it, later the gradient before it
  int64_t readout;      // [N][Kr4]: the readout's hidden layer, later its gradient
  int64_t grad_x;       // [N][F4]
  int64_t parts;        // [kMaxCluster]: each block's share of the energy
  int64_t pair_counts;  // [kMaxCluster] ints: each block's pairs within the cutoff (all pairs, found_pairs)
  int64_t vectors;      // [P][3], all pairs: the vectors of its pairs each block keeps (own_pairs_of)
  int64_t transposed;   // the atom-wise weights transposed (SchnetTransposed), unless prepared
  int64_t total;
};

__host__ __device__ inline SchnetTransposed transposed_of(const SchnetEnergyParams& p) {
  return schnet_transposed(p.num_interactions, p.features, p.message_width, p.update_hidden, p.readout_hidden);
}
__host__ __device__ inline SchnetPrepared prepared_of(const SchnetEnergyParams& p) {
  return schnet_prepared(p.num_interactions, p.num_rbf, p.num_embeddings, p.features, p.message_width,
                         p.update_hidden, p.readout_hidden);
}

__host__ __device__ inline Layout layout_of(const SchnetEnergyParams& p) {
  Layout l{};
  const int64_t N = p.num_atoms, P = p.num_pairs, T = p.num_interactions;
  l.R4 = pad4(p.num_rbf);
  l.H4 = pad4(p.filter_hidden);
  l.M4 = pad4(p.message_width);
  l.F4 = pad4(p.features);
  l.K4 = pad4(p.update_hidden);
  l.Kr4 = pad4(p.readout_hidden);
  FloatArena arena;
  const int64_t per_block_pairs = P > kSharedPairs ? kMaxCluster * P : 0;
  l.own_pairs = arena.take_items<OwnPair>(per_block_pairs);
  l.pair_geometry = arena.take_items<PairGeometry>(per_block_pairs);
  l.filter_out = arena.take(T * P * l.M4);
  l.filter_slope = arena.take(T * P * l.M4);
  l.x = arena.take(N * l.F4);
  l.h = arena.take(T * N * l.M4);
  l.grad_h = arena.take((T - 1) * N * l.M4);
  l.m = arena.take(N * l.M4);
  l.q = arena.take(T * N * l.K4);
  l.u = arena.take(N * l.K4);
  l.readout = arena.take(N * l.Kr4);
  l.grad_x = arena.take(N * l.F4);
  l.parts = arena.take(kMaxCluster);
  l.pair_counts = arena.take(kMaxCluster);
  l.vectors = arena.take(p.positions != nullptr ? 3 * P : 0);
  l.transposed = arena.take(p.prepared != nullptr ? 0 : transposed_of(p).total);
  l.total = arena.size;
  return l;
}

// Pairs a block of schnet_filters_kernel takes through one interaction's filter network: their
// value and derivative rows (8) are two row tiles of `product` and `linear_product`. Benzene's
// 132 pairs and 3 interactions make 99 blocks, one wave; with 2 pairs a block (one row tile)
// the kernel took 12 us in two waves (H200).
constexpr int kFilterPairs = 4;
static_assert((2 * kFilterPairs) % kRowTile == 0 && kRowTile % 2 == 0,
              "a pair's value and derivative rows must share a row tile, and a block's rows make whole tiles");

size_t filters_shared_bytes(const Layout& l) { return 2 * kFilterPairs * (l.R4 + l.H4) * sizeof(float); }

// schnet_filters_kernel's blocks of row T (at least this many) transpose the atom-wise weights.
// A block per 32 x 32 tile instead (152 on benzene, the grid's other rows as wide, their spare
// blocks returning at once) took the kernel from 9 to 13 us (H200, 2026-11-27 18:30 UTC).
constexpr int kTransposeBlocks = 8;


// The backward's products read the atom-wise weights transposed, so that they run as
// linear_product, lanes along the inputs: the products of each weight's columns (a thread per
// four outputs, a slice of k, the slices' sums met in shared memory behind a second barrier) took
// ~4k cycles a one-row product on benzene where linear_product takes ~2.8k (H200, 2026-11-24).
// Into `out`, laid out as SchnetTransposed says.
__device__ void transpose_weights(const SchnetEnergyParams& p, float* out) {
  const SchnetTransposed L = transposed_of(p);
  const int F = p.features, M = p.message_width, K = p.update_hidden;
  int tiles = transpose(p.readout1_w, p.readout_hidden, F, out + L.readout1, p.readout_hidden, 0);
  for (int t = 0; t < p.num_interactions; ++t) {
    const SchnetInteraction& layer = p.interactions[t];
    tiles = transpose(layer.f2out2_w, F, K, out + L.f2out2 + t * padded_matrix(K, F), F, tiles);
    tiles = transpose(layer.f2out1_w, K, M, out + L.f2out1 + t * padded_matrix(M, K), K, tiles);
    if (t > 0) tiles = transpose(layer.in2f_w, M, F, out + L.in2f + (t - 1) * padded_matrix(F, M), M, tiles);
  }
}

__global__ void __launch_bounds__(kThreads) schnet_transpose_kernel(const __grid_constant__ SchnetEnergyParams p,
                                                                    float* out) {
  start_after_prior_grid();
  transpose_weights(p, out);
}

// The first interaction's in2f of every embedding row [Z][M] (SchnetPrepared::first_h), a thread
// an element, summed in float64 as the CPU's prepare does.
__global__ void __launch_bounds__(kThreads) schnet_first_h_kernel(const __grid_constant__ SchnetEnergyParams p,
                                                                   float* first_h) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t M = p.message_width, F = p.features;
  if (e >= p.num_embeddings * M) return;
  const int64_t z = e / M, o = e % M;
  const SchnetInteraction& layer = p.interactions[0];
  double sum = layer.in2f_b != nullptr ? layer.in2f_b[o] : 0.0;
  for (int64_t k = 0; k < F; ++k) sum += static_cast<double>(p.embedding[z * F + k]) * layer.in2f_w[o * F + k];
  first_h[e] = static_cast<float>(sum);
}

// A prepared call's filters (the cutoff included) and their slopes in the distance, for the
// block's own pairs (no other block reads them), into the rows where schnet_filters_kernel would
// write them: a quintic of the piece each distance falls in, four outputs a thread.
__device__ void filters_from_tables(const SchnetEnergyParams& p, const Layout& L, const OwnPair* own, int np,
                                    const PairGeometry* geometry) {
  using filter_table::kCoefficients;
  const int64_t intervals = schnet_table_intervals(p.num_rbf);
  const int64_t M = p.message_width, P = p.num_pairs, M4 = L.M4;
  const int columns = p.message_width / 4, T = p.num_interactions;
  const float scale = static_cast<float>(intervals) / p.cutoff;
  float* ws = static_cast<float*>(p.workspace);
  for (int e = threadIdx.x; e < T * np * columns; e += blockDim.x) {
    const int t = e / (np * columns), r = e / columns % np, c = 4 * (e % columns);
    // The pairs here lie inside the cutoff; a NaN distance takes piece 0 at s = NaN: NaN filters.
    const float d = geometry[r].distance, u = d * scale;
    const int64_t piece = d >= 0.0f ? min(static_cast<int64_t>(u), intervals - 1) : 0;
    const float s = d >= 0.0f ? u - static_cast<float>(piece) : __int_as_float(0x7fc00000);
    const float* a = p.prepared + ((t * intervals + piece) * kCoefficients) * M + c;
    float q[kCoefficients][4], value[4], slope[4];
#pragma unroll
    for (int k = 0; k < kCoefficients; ++k) load_packed<float, 4>(a + k * M, q[k]);
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      value[x] = q[kCoefficients - 1][x];
      slope[x] = (kCoefficients - 1) * q[kCoefficients - 1][x];
#pragma unroll
      for (int k = kCoefficients - 2; k >= 0; --k) {
        value[x] = fmaf(value[x], s, q[k][x]);
        if (k >= 1) slope[x] = fmaf(slope[x], s, k * q[k][x]);
      }
      slope[x] *= scale;
    }
    const int64_t at = (t * P + own[r].pair) * M4 + c;
    store_packed<float, 4>(ws + L.filter_out + at, value);
    store_packed<float, 4>(ws + L.filter_slope + at, slope);
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
  allow_next_grid();  // the cluster reads what this kernel writes only after wait_for_prior_grid
  if (blockIdx.y == p.num_interactions) {
    transpose_weights(p, static_cast<float*>(p.workspace) + layout_of(p).transposed);
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

// Block 0 adds the blocks' pair counts into found_pairs (-1 where own_pairs_of found a position
// that is not finite), behind a cluster barrier that follows them; a lane a block, as total_energy.
// Not inlined, as the other rare phases: the kernel's registers.
__device__ __noinline__ void total_pairs(const SchnetEnergyParams& p, const int* pair_counts, bool infinite) {
  if (blockIdx.x != 0 || threadIdx.x >= 32) return;
  const int found = warp_sum(threadIdx.x < gridDim.x ? __ldcg(&pair_counts[threadIdx.x]) : 0);
  if (threadIdx.x == 0) *p.found_pairs = infinite ? -1 : found;
}

__global__ void __launch_bounds__(kThreads) schnet_energy_kernel(const __grid_constant__ SchnetEnergyParams p) {
  __shared__ int counters[3];
  __shared__ OwnPair shared_own_pairs[kSharedPairs];
  __shared__ PairGeometry shared_geometry[kSharedPairs];
  __shared__ float scratch[32];
  const int tid = threadIdx.x, threads = blockDim.x, block = blockIdx.x, blocks = gridDim.x;
  const int64_t N = p.num_atoms, P = p.num_pairs;
  const int M = p.message_width, F = p.features;
  const int K = p.update_hidden, T = p.num_interactions;
  const Layout L = layout_of(p);
  const int64_t M4 = L.M4, F4 = L.F4, K4 = L.K4, Kr4 = L.Kr4;
  float* ws = static_cast<float*>(p.workspace);
  // Prepared, this kernel is the op's only one, launched overlapped with the kernel ahead: it must
  // wait for it before touching memory. Otherwise it waits for the filters kernel further down.
  if (p.prepared != nullptr) wait_for_prior_grid();
  const bool shared_pairs = P <= kSharedPairs;
  OwnPair* own = shared_pairs ? shared_own_pairs : reinterpret_cast<OwnPair*>(ws + L.own_pairs) + block * P;
  PairGeometry* geometry =
      shared_pairs ? shared_geometry : reinterpret_cast<PairGeometry*>(ws + L.pair_geometry) + block * P;
  float *x = ws + L.x, *m = ws + L.m, *u = ws + L.u, *readout = ws + L.readout, *grad_x = ws + L.grad_x;
  const auto filter_out = [&](int t) { return ws + L.filter_out + t * P * M4; };
  const auto filter_slope = [&](int t) { return ws + L.filter_slope + t * P * M4; };
  const auto h = [&](int t) { return ws + L.h + t * N * M4; };
  const auto grad_h = [&](int t) { return ws + L.grad_h + (t - 1) * N * M4; };  // t >= 1
  const auto q = [&](int t) { return ws + L.q + t * N * K4; };

  const int64_t a0 = block * N / blocks, a1 = (block + 1) * N / blocks;
  const int na = static_cast<int>(a1 - a0);
  // All pairs: each block forms its pairs' vectors from the positions, for itself.
  float* own_vectors = p.positions != nullptr ? ws + L.vectors : nullptr;
  const float* vectors = own_vectors != nullptr ? own_vectors : p.vectors;
  const int np = own_pairs_of(p, a0, a1, own, counters, own_vectors);
  int* pair_counts = reinterpret_cast<int*>(ws + L.pair_counts);
  if (np < 0) return;
  if (p.found_pairs != nullptr && tid == 0) pair_counts[block] = np;
  // Block 0's totals, behind a cluster barrier that follows every block's part.
  const auto totals = [&] {
    total_energy(p.energy, ws + L.parts);
    if (p.found_pairs != nullptr) total_pairs(p, pair_counts, counters[2] != 0);
  };
  const AtomRows atom_row{a0};
  const auto to = [&](float* out, int64_t stride) { return AtomStore{out, stride, a0}; };

  for (int e = tid; e < (T - 1) * na * M; e += threads) {
    const int t = 1 + e / (na * M), rest = e % (na * M);
    grad_h(t)[(a0 + rest / M) * M4 + rest % M] = 0.0f;
  }
  // Geometry of the block's pairs (read by the messages, after the barriers below). Prepared
  // filters have the cutoff in them: it is 1 here, its slope 0.
  const bool prepared = p.prepared != nullptr;
  for (int r = tid; r < np; r += threads) {
    const float d = own[r].distance;
    geometry[r] = PairGeometry{d, prepared ? 1.0f : envelope(CutoffFn::kCosine, d, p.cutoff),
                               prepared ? 0.0f : envelope_derivative(CutoffFn::kCosine, d, p.cutoff), 0.0f};
  }
  const float* transposed = prepared ? p.prepared + prepared_of(p).transposed : ws + L.transposed;
  const SchnetTransposed TL = transposed_of(p);

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
  const auto features_to_h = [&](int t) {
    const SchnetInteraction& layer = p.interactions[t];
    linear_product(na, atom_row, x, F4, F, layer.in2f_w, layer.in2f_b, M, to(h(t), M4));
  };
  if (prepared) {  // the first h by species, one of the ~20 products less (M4 == M: tables need M % 4 == 0)
    const float* first_h = p.prepared + prepared_of(p).first_h;
    for (int e = tid; e < na * M; e += threads) {
      const int64_t a = a0 + e / M;
      h(0)[a * M + e % M] = first_h[p.atomic_numbers[a] * M + e % M];
    }
  } else {
    __syncthreads();  // x
    features_to_h(0);
  }
  wait_for_prior_grid();  // the filters and the transposed weights (the writes above are the cluster's own)
  // h(0) to the other blocks. Prepared, the block forms its pairs' filters (its own rows) while
  // the others arrive: ~2 us of table reads that would otherwise come before the barrier.
  cluster_arrive();
  if (prepared) {
    __syncthreads();  // the distances
    filters_from_tables(p, L, own, np, geometry);
  }
  __syncthreads();  // the filters, x, the zeroed messages
  cluster_wait();
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
  // The readout and its gradient; then grad_x = d energy / d x, interaction by interaction from
  // the last. The backward's products read the weights transposed (transpose_weights).
  readout_and_gradient(p, a0, na, x, F4, readout, Kr4, transposed + TL.readout1, ws + L.parts, grad_x, F4, scratch);
  AtomStore add_to_grad_x = to(grad_x, F4);
  add_to_grad_x.accumulate = true;
  for (int t = T - 1; t >= 0; --t) {
    const SchnetInteraction& layer = p.interactions[t];
    AtomStore to_grad_q = to(u, K4);  // the gradient before f2out's activation, in u
    to_grad_q.activation = layer.update_activation;
    to_grad_q.gate = q(t);
    linear_product(na, atom_row, grad_x, F4, F, transposed + TL.f2out2 + t * padded_matrix(K, F), nullptr, K,
                   to_grad_q);
    linear_product(na, atom_row, u, K4, K, transposed + TL.f2out1 + t * padded_matrix(M, K), nullptr, M, to(m, M4));
    // Per pair (i <- j), w = filter * fcut: grad_h[j] += grad_m[i] * w, and d energy / d distance
    // += sum over features of grad_m[i] * h[j] * dw/dd. One warp a pair. Interaction 0's h is
    // in2f of the embedding, which has no gradient in the positions: no grad_h there, and no
    // backward through its in2f (one product and one cluster barrier less).
    const float* ht = h(t);
    float* ght = t > 0 ? grad_h(t) : nullptr;
    const float *filters = filter_out(t), *slopes = filter_slope(t);
    const int lane = tid % 32;
    for (int r = tid / 32; r < np; r += threads / 32) {
      const OwnPair own_pair = own[r];
      const int64_t pair = own_pair.pair, i = own_pair.receiver, j = own_pair.sender;
      const float fcut = geometry[r].cutoff_value, fcut_slope = geometry[r].cutoff_slope;
      float distance_sum = 0.0f;
      for (int o = lane; o < M; o += 32) {
        const float gm = m[i * M4 + o], f = filters[pair * M4 + o];
        if (ght != nullptr) atomicAdd(&ght[j * M4 + o], gm * f * fcut);
        distance_sum += gm * __ldcg(&ht[j * M4 + o]) * (f * fcut_slope + slopes[pair * M4 + o] * fcut);
      }
      distance_sum = warp_sum(distance_sum);
      if (lane == 0) geometry[r].grad_distance += distance_sum;
    }
    if (t == 0) break;
    cluster_sync();  // grad_h(t) complete; every block's energy share written
    if (t == T - 1) totals();
    // The product reads grad_h(t) as it is: the barrier's acquire makes the other blocks' atomics
    // visible, and no load of this call has brought its rows into the L1 before.
    linear_product(na, atom_row, ght, M4, M, transposed + TL.in2f + (t - 1) * padded_matrix(F, M), nullptr, F,
                   add_to_grad_x);
  }
  if (T == 1) {  // no cluster barrier above followed the blocks' energy shares
    cluster_sync();
    totals();
  } else {
    __syncthreads();  // the pairs' distance gradients
  }

  // d energy / d vectors = (d energy / d distance) * v / |v| (0 at |v| = 0, as PyTorch's norm).
  for (int r = tid; r < np; r += threads) {
    const int64_t pair = own[r].pair;
    const float d = geometry[r].distance;
    const float scale = d > 0.0f ? geometry[r].grad_distance / d : 0.0f;
    const float g[3] = {scale * vectors[3 * pair], scale * vectors[3 * pair + 1], scale * vectors[3 * pair + 2]};
    store_pair_gradient(p, own[r], g);
  }
}

cudaError_t launch_schnet_filters(const SchnetEnergyParams& params, cudaStream_t stream) {
  const size_t shared = filters_shared_bytes(layout_of(params));
  // Static and dynamic shared memory beyond the default 48 KB (filter networks ~1,000 wide or
  // more) need the kernel's opt-in; beyond the device's limit the launch fails with its error.
  if (shared + kPartialFloats * sizeof(float) + kTransposeSharedBytes > 48 * 1024) {
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
  const bool prepared = params.prepared != nullptr;
  if (!prepared) {
    const cudaError_t error = launch_schnet_filters(params, stream);
    if (error != cudaSuccess) return error;
  }
  const int limit = cluster_limit<schnet_energy_kernel>();
  const int blocks = static_cast<int>(std::min<int64_t>(limit, std::max<int64_t>(params.num_atoms, 1)));
  // The cluster starts beside the filters kernel: its pairs, embedding and first product read none
  // of what that kernel writes. Prepared, it starts beside the kernel ahead of the op (another
  // op's), as the other overlapped launches do.
  return launch_cluster<schnet_energy_kernel>(blocks, params, stream, prepared ? overlapped_launches() : true);
}

bool schnet_prepare_supported(const SchnetEnergyParams& params) {
  return params.filter_activation != Activation::kRelu &&
         radial_cfconv_supported(params.num_rbf, params.filter_hidden, params.message_width);
}

cudaError_t launch_schnet_prepare(const SchnetEnergyParams& params, float* prepared, cudaStream_t stream) {
  const int64_t intervals = schnet_table_intervals(params.num_rbf);
  for (int t = 0; t < params.num_interactions; ++t) {
    const SchnetInteraction& layer = params.interactions[t];
    FilterTableParams table{};
    table.w1 = layer.filter1_w;
    table.b1 = layer.filter1_b;
    table.w2 = layer.filter2_w;
    table.b2 = layer.filter2_b;
    table.num_rbf = params.num_rbf;
    table.hidden = params.filter_hidden;
    table.width = params.message_width;
    table.activation = params.filter_activation;
    table.basis = RadialBasisKind::kGaussian;
    table.envelope = CutoffFn::kCosine;
    table.cutoff = params.cutoff;
    table.intervals = intervals;
    table.table = prepared + t * intervals * filter_table::kCoefficients * params.message_width;
    const cudaError_t error = launch_filter_table(table, stream);
    if (error != cudaSuccess) return error;
  }
  const SchnetPrepared layout = prepared_of(params);
  const cudaError_t error = launch_overlapped(schnet_transpose_kernel, dim3(kTransposeBlocks * 4), dim3(kThreads), 0,
                                              stream, false, params, prepared + layout.transposed);
  if (error != cudaSuccess) return error;
  const int64_t first_h = params.num_embeddings * params.message_width;
  schnet_first_h_kernel<<<static_cast<unsigned>(ceil_div(first_h, kThreads)), kThreads, 0, stream>>>(
      params, prepared + layout.first_h);
  return cudaGetLastError();
}

}  // namespace mirage::cuda
