// mirage::painn_energy: PaiNN's energy and its gradient in the pair vectors in two launches.
//
// Small molecules are launch-bound: the layer-by-layer model is ~165 kernels per energy+forces
// on benzene (docs/perf/forcefield.md). Here one thread-block cluster runs the whole model,
// forward and backward, as schnet_energy does: block b owns a contiguous range of atoms and every
// pair whose receiving atom it owns, so messages, updates and their backward stay inside the
// block. Blocks meet at a cluster barrier twice per interaction: after phi(s) and the vectors v
// (read by every block through the pairs' senders), and after the senders' gradients of both
// (added by every block). Each block forms its own pairs' filters (one Linear of the basis) at the
// start, with their derivative in the distance carried forward beside them (a second row), so the
// backward needs one dot product per pair for the distance, none through the filter.
// Intermediates live in a global workspace (L2-resident at these sizes); data written by another
// block is read with __ldcg, past the non-coherent L1. The backward's products read the weights
// transposed, and U v, V v one product on [U; V], both written by a kernel before the cluster's
// that runs beside the start of its forward.
// Below sm_90 (no clusters) the launcher runs one block, where the barrier is __syncthreads.
//
// Each block reads every weight for its one or few atoms, which bounds the kernel. Tried and not
// kept: the four products with 3F on one side (128 x 384) over every atom's row, each block taking
// its share of the outputs between two cluster barriers, so that a block reads a twelfth of their
// weights on benzene. Correct (the CUDA tests passed), but the kernel took 312 us against 176
// (H200, 2026-11-24 17:20 UTC, benzene): 18 more barriers a call (each a MEMBAR.GPU, the barrier
// and an L1 invalidation in SASS) and products of few outputs over every row; which of the two
// cost more was not measured. Nor a cluster whose blocks split the features instead of the atoms
// (every elementwise phase and the messages inside a block's columns, every product over all
// rows into the block's columns, reading 1/16 of the weights behind a cluster barrier; 33
// barriers a call): correct (the CUDA tests passed), but 260-282 us against 171 for the kernel
// (H200, 2026-11-30 02:33-02:45 UTC). Its clock64 marks: a cluster barrier 1.3-1.9k cycles, a
// product 6-14k (its weights and its input rows from L2, a round trip or more a 128-input pass),
// so the barriers were the lesser part; what a block stores, then loads, comes back from L2.
// That split with every weight in shared memory is painn_split.cu's kernel, which
// launch_painn_energy runs instead where it applies (sm_90, widths divisible by 16, a molecule of
// benzene's size): 150 us against this kernel's 172 (H200, 2026-12-01).
#include "atom_products.cuh"
#include "painn_energy.cuh"
#include "radial_functions.cuh"

namespace mirage::cuda {
namespace {

using namespace atomwise;

// Up to this many pairs in all (the neighbor list's capacity) each block keeps its pairs'
// indices and geometry in shared memory; beyond, in the workspace.
constexpr int kSharedPairs = 512;

// The geometry of a pair the block owns, and the energy's gradient in its distance and direction
// (summed over the interactions).
struct alignas(16) PairGeometry {
  float distance, cutoff_value, cutoff_slope, grad_distance;
  float direction[3], unused;
  float grad_direction[3], unused2;
};

// Offsets (in floats) of the workspace arrays; row strides are padded to 4 floats so that rows
// are 16-byte aligned. [T] = one per interaction; vector rows are (atom, xyz), 3 an atom.
struct Layout {
  int64_t R4, F4, H4, M4, K4, Z4, Kr4;  // M = 3F, Z = 2F
  int64_t own_pairs, pair_geometry;     // [kMaxCluster][P] each beyond kSharedPairs pairs
  int64_t filter;       // [T][P][M4]: filter(basis) * fcut
  int64_t filter_slope; // [T][P][M4]: its derivative in the distance
  int64_t s;            // [N][F4]: the scalars
  int64_t v;            // [T][3N][F4]: each interaction's input vectors (0 for the first)
  int64_t vm;           // [3N][F4]: the vectors after the messages
  int64_t z;            // [T][N][Z4]: the update MLP's input [s after the messages, |V v|]
  int64_t pre1, h1;     // [T][N][H4], [N][H4]: phi's hidden layer before / after its activation
  int64_t phi;          // [T][N][M4]
  int64_t uvv;          // [T][3N][Z4]: U v and V v side by side
  int64_t pre2, h2;     // [T][N][K4], [N][K4]: the update MLP's hidden layer
  int64_t a;            // [T][N][M4]: its output (a_vv, a_sv, a_ss)
  int64_t readout;      // [N][Kr4]: the readout's hidden layer, later its gradient
  int64_t gs, gv;       // [N][F4], [3N][F4]: d energy / d s, d energy / d v
  int64_t ga;           // [N][M4]: d energy / d a, later / d phi
  int64_t gz;           // [N][Z4]
  int64_t guvv;         // [3N][Z4]: d energy / d (U v, V v), side by side
  int64_t gphi;         // [T][N][M4]: added to by every block
  int64_t gvs;          // [T][3N][F4]: the senders' share of d energy / d v, added to by every block
  int64_t parts;        // [kMaxCluster]: each block's share of the energy
  // Per interaction [U; V] [Z][F] (one product forms U v and V v); the weights transposed for
  // the backward's products: readout1 [F][Kr]; per interaction phi1 [F][H], phi2 [H][M],
  // [U; V] [F][Z], mlp1 [Z][K], mlp2 [K][M].
  int64_t uv_cat, readout1_t, phi1_t, phi2_t, uv_t, mlp1_t, mlp2_t;
  int64_t total;
};

__host__ __device__ inline Layout layout_of(const PainnEnergyParams& p) {
  Layout l{};
  const int64_t N = p.num_atoms, P = p.num_pairs, T = p.num_interactions;
  const int64_t F = p.features, H = p.phi_hidden, K = p.update_hidden, Kr = p.readout_hidden;
  l.R4 = pad4(p.num_rbf);
  l.F4 = pad4(F);
  l.H4 = pad4(H);
  l.M4 = pad4(3 * F);
  l.K4 = pad4(K);
  l.Z4 = pad4(2 * F);
  l.Kr4 = pad4(Kr);
  FloatArena arena;
  const int64_t per_block_pairs = P > kSharedPairs ? kMaxCluster * P : 0;
  l.own_pairs = arena.take_items<OwnPair>(per_block_pairs);
  l.pair_geometry = arena.take_items<PairGeometry>(per_block_pairs);
  l.filter = arena.take(T * P * l.M4);
  l.filter_slope = arena.take(T * P * l.M4);
  l.s = arena.take(N * l.F4);
  l.v = arena.take(T * 3 * N * l.F4);
  l.vm = arena.take(3 * N * l.F4);
  l.z = arena.take(T * N * l.Z4);
  l.pre1 = arena.take(T * N * l.H4);
  l.h1 = arena.take(N * l.H4);
  l.phi = arena.take(T * N * l.M4);
  l.uvv = arena.take(T * 3 * N * l.Z4);
  l.pre2 = arena.take(T * N * l.K4);
  l.h2 = arena.take(N * l.K4);
  l.a = arena.take(T * N * l.M4);
  l.readout = arena.take(N * l.Kr4);
  l.gs = arena.take(N * l.F4);
  l.gv = arena.take(3 * N * l.F4);
  l.ga = arena.take(N * l.M4);
  l.gz = arena.take(N * l.Z4);
  l.guvv = arena.take(3 * N * l.Z4);
  l.gphi = arena.take(T * N * l.M4);
  l.gvs = arena.take(T * 3 * N * l.F4);
  l.parts = arena.take(kMaxCluster);
  l.uv_cat = arena.take(T * padded_matrix(2 * F, F));
  l.readout1_t = arena.take(F * Kr);
  l.phi1_t = arena.take(T * padded_matrix(F, H));
  l.phi2_t = arena.take(T * padded_matrix(H, 3 * F));
  l.uv_t = arena.take(T * padded_matrix(F, 2 * F));
  l.mlp1_t = arena.take(T * padded_matrix(2 * F, K));
  l.mlp2_t = arena.take(T * padded_matrix(K, 3 * F));
  l.total = arena.size;
  return l;
}

// The backward's weights transposed, over the grid's blocks (transpose() splits the work), and
// [U; V]. In the cluster kernel (on benzene's 12 multiprocessors) the transposes made it 240 us
// instead of 178 with them here (H200, 2026-11-24).
__global__ void __launch_bounds__(kThreads) painn_transpose_kernel(const __grid_constant__ PainnEnergyParams p) {
  allow_next_grid();  // the cluster reads what this kernel writes only after wait_for_prior_grid
  const Layout L = layout_of(p);
  float* ws = static_cast<float*>(p.workspace);
  const int F = p.features, H = p.phi_hidden, K = p.update_hidden;
  int tiles = transpose(p.readout1_w, p.readout_hidden, F, ws + L.readout1_t, p.readout_hidden, 0);
  for (int t = 0; t < p.num_interactions; ++t) {
    const PainnInteraction& layer = p.interactions[t];
    tiles = transpose(layer.phi1_w, H, F, ws + L.phi1_t + t * padded_matrix(F, H), H, tiles);
    tiles = transpose(layer.phi2_w, 3 * F, H, ws + L.phi2_t + t * padded_matrix(H, 3 * F), 3 * F, tiles);
    tiles = transpose(layer.mlp1_w, K, 2 * F, ws + L.mlp1_t + t * padded_matrix(2 * F, K), K, tiles);
    tiles = transpose(layer.mlp2_w, 3 * F, K, ws + L.mlp2_t + t * padded_matrix(K, 3 * F), 3 * F, tiles);
    // [U; V] ([2F][F]) and its transpose, whose row k holds U[:, k] then V[:, k].
    float *uv_cat = ws + L.uv_cat + t * padded_matrix(2 * F, F), *uv_t = ws + L.uv_t + t * padded_matrix(F, 2 * F);
    const int64_t count = static_cast<int64_t>(F) * F;
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < count;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      uv_cat[e] = layer.u_w[e];
      uv_cat[count + e] = layer.v_w[e];
    }
    tiles = transpose(layer.u_w, F, F, uv_t, 2 * F, tiles);
    tiles = transpose(layer.v_w, F, F, uv_t + F, 2 * F, tiles);
  }
}

// atom_products.cuh's total_energy, one thread adding the parts in a loop: the lane-parallel sum
// took PaiNN's kernel on benzene from 198.5 to 213 us (H200, 2026-11-30, A/B on one machine; its
// register spills 496 -> 532 bytes), where it made SchNet's faster.
__device__ inline void total_energy_in_a_loop(float* energy, const float* parts) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  float total = 0.0f;
  for (int b = 0; b < static_cast<int>(gridDim.x); ++b) total += __ldcg(&parts[b]);
  *energy = total;
}

__global__ void __launch_bounds__(kThreads) painn_energy_kernel(const __grid_constant__ PainnEnergyParams p) {
  __shared__ int counters[2];
  __shared__ OwnPair shared_own_pairs[kSharedPairs];
  __shared__ PairGeometry shared_geometry[kSharedPairs];
  __shared__ float partial[kPartialFloats];
  __shared__ float scratch[32];
  // In shared memory, not registers: held in registers through the whole kernel, the layout's
  // ~40 offsets made it spill.
  __shared__ Layout L;
  const int tid = threadIdx.x, threads = blockDim.x, block = blockIdx.x, blocks = gridDim.x;
  const int64_t N = p.num_atoms, P = p.num_pairs;
  const int F = p.features, H = p.phi_hidden, K = p.update_hidden;
  const int R = p.num_rbf, T = p.num_interactions, M = 3 * F, Z = 2 * F;
  if (tid == 0) L = layout_of(p);
  __syncthreads();
  const int64_t F4 = L.F4, H4 = L.H4, M4 = L.M4, K4 = L.K4, Z4 = L.Z4, Kr4 = L.Kr4, R4 = L.R4;
  float* ws = static_cast<float*>(p.workspace);
  const bool shared_pairs = P <= kSharedPairs;
  OwnPair* own = shared_pairs ? shared_own_pairs : reinterpret_cast<OwnPair*>(ws + L.own_pairs) + block * P;
  PairGeometry* geometry =
      shared_pairs ? shared_geometry : reinterpret_cast<PairGeometry*>(ws + L.pair_geometry) + block * P;
  const auto at_t = [&](int64_t offset, int t, int64_t size) { return ws + offset + t * size; };
  const auto filter = [&](int t) { return at_t(L.filter, t, P * M4); };
  const auto filter_slope = [&](int t) { return at_t(L.filter_slope, t, P * M4); };
  const auto v_in = [&](int t) { return at_t(L.v, t, 3 * N * F4); };
  const auto z = [&](int t) { return at_t(L.z, t, N * Z4); };
  const auto pre1 = [&](int t) { return at_t(L.pre1, t, N * H4); };
  const auto phi = [&](int t) { return at_t(L.phi, t, N * M4); };
  const auto uvv = [&](int t) { return at_t(L.uvv, t, 3 * N * Z4); };
  const auto pre2 = [&](int t) { return at_t(L.pre2, t, N * K4); };
  const auto a_out = [&](int t) { return at_t(L.a, t, N * M4); };
  const auto gphi = [&](int t) { return at_t(L.gphi, t, N * M4); };
  const auto gvs = [&](int t) { return at_t(L.gvs, t, 3 * N * F4); };
  float *s = ws + L.s, *vm = ws + L.vm, *h1 = ws + L.h1, *h2 = ws + L.h2, *readout = ws + L.readout;
  float *gs = ws + L.gs, *gv = ws + L.gv, *ga = ws + L.ga, *gz = ws + L.gz, *guvv = ws + L.guvv;

  const int64_t a0 = block * N / blocks, a1 = (block + 1) * N / blocks;
  const int na = static_cast<int>(a1 - a0);
  const int np = own_pairs_of(p, a0, a1, own, counters);
  if (np < 0) return;
  const AtomRows atom_row{a0}, vector_row{3 * a0};
  const auto to = [&](float* out, int64_t stride) { return AtomStore{out, stride, a0}; };
  const auto to_vectors = [&](float* out, int64_t stride) { return AtomStore{out, stride, 3 * a0}; };

  // The block's pairs' geometry.
  for (int r = tid; r < np; r += threads) {
    const int64_t e = own[r].pair;
    const float d = own[r].distance, inverse = 1.0f / d;
    PairGeometry g{};
    g.distance = d;
    g.cutoff_value = envelope(CutoffFn::kCosine, d, p.cutoff);
    g.cutoff_slope = envelope_derivative(CutoffFn::kCosine, d, p.cutoff);
    for (int c = 0; c < 3; ++c) g.direction[c] = p.vectors[3 * e + c] * inverse;
    geometry[r] = g;
  }
  // Zero what the blocks add to; the first atoms' vectors are 0; the scalars are the embedding.
  for (int t = 0; t < T; ++t) {
    for (int e = tid; e < na * M; e += threads) gphi(t)[(a0 + e / M) * M4 + e % M] = 0.0f;
    for (int e = tid; e < 3 * na * F; e += threads) gvs(t)[(3 * a0 + e / F) * F4 + e % F] = 0.0f;
  }
  for (int e = tid; e < 3 * na * F; e += threads) {
    v_in(0)[(3 * a0 + e / F) * F4 + e % F] = 0.0f;
    gv[(3 * a0 + e / F) * F4 + e % F] = 0.0f;
  }
  for (int e = tid; e < na * F; e += threads) {
    const int64_t a = a0 + e / F;
    s[a * F4 + e % F] = p.embedding[p.atomic_numbers[a] * F + e % F];
  }
  __syncthreads();

  // Each interaction's filters on the block's pairs, as many pairs at a time as the shared memory
  // basis_rows holds: their basis and its derivative as two rows a pair there, then filter = fcut
  // (W basis + b) and its slope fcut' (W basis + b) + fcut W basis'. product's thread stores a row
  // tile's rows in order, the value's row (even) before the derivative's (odd), so the value's
  // W basis + b waits in a register for the slope. The basis in the workspace and the slope
  // stored twice (the value's share, then read back and added to) made this phase ~47k cycles of
  // the kernel's ~359k on benzene (clock64 marks, H200, 2026-11-30): what a block stores, then
  // loads, comes back from L2.
  extern __shared__ float4 basis_quads[];
  float* basis_rows = reinterpret_cast<float*>(basis_quads);
  const float bessel_scale = sqrtf(2.0f / p.cutoff);
  static_assert(kRowTile % 2 == 0, "product's row tiles hold whole pairs (a value's row, then its slope's)");
  const int chunk = dynamic_shared_floats() / (2 * static_cast<int>(R4));
  for (int c0 = 0; c0 < np; c0 += chunk) {
    const int n = min(chunk, np - c0);
    for (int e = tid; e < n * R; e += threads) {
      const int q = e / R, k = e % R;
      const float frequency = (k + 1) * kPi / p.cutoff;
      float value, slope;
      sinc_and_derivative(frequency * geometry[c0 + q].distance, value, slope);
      basis_rows[2 * q * R4 + k] = bessel_scale * frequency * value;
      basis_rows[(2 * q + 1) * R4 + k] = bessel_scale * frequency * frequency * slope;
    }
    __syncthreads();
    for (int t = 0; t < T; ++t) {
      float *out = filter(t), *slope = filter_slope(t);
      float value = 0.0f;
      product(2 * n, [](int r) -> int64_t { return r; }, basis_rows, R4, R, p.interactions[t].filter_w,
              p.interactions[t].filter_b, M, [&](int r, int o, float v, float b) {
        const PairGeometry& g = geometry[c0 + r / 2];
        const int64_t at = own[c0 + r / 2].pair * M4 + o;
        if (r % 2 == 0) {
          value = v + b;
          out[at] = g.cutoff_value * value;
        } else {
          slope[at] = fmaf(g.cutoff_slope, value, g.cutoff_value * v);
        }
      }, partial);
    }
    __syncthreads();  // basis_rows free for the next pairs
  }

  // Forward over the atoms.
  const auto phi_of_s = [&](int t) {
    const PainnInteraction& layer = p.interactions[t];
    AtomStore to_h1 = to(h1, H4);
    to_h1.activation = layer.phi_activation;
    to_h1.pre = pre1(t);
    linear_product(na, atom_row, s, F4, F, layer.phi1_w, layer.phi1_b, H, to_h1);
    linear_product(na, atom_row, h1, H4, H, layer.phi2_w, layer.phi2_b, M, to(phi(t), M4));
  };
  for (int t = 0; t < T; ++t) {
    const PainnInteraction& layer = p.interactions[t];
    phi_of_s(t);
    // The messages add to copies of s and v.
    float *zt = z(t), *vt = v_in(t);
    for (int e = tid; e < na * F; e += threads) zt[(a0 + e / F) * Z4 + e % F] = s[(a0 + e / F) * F4 + e % F];
    for (int e = tid; e < 3 * na * F; e += threads) {
      const int64_t at = (3 * a0 + e / F) * F4 + e % F;
      vm[at] = vt[at];
    }
    cluster_sync();  // phi(t) and v_in(t) of every atom
    // Per pair (i <- j) and feature f: x = phi[j] * filter, split into (x_s, x_vv, x_vs);
    // s_i += x_s, v_i += v_j x_vv + x_vs direction.
    const float *phit = phi(t), *ft = filter(t);
    for (int e = tid; e < np * F; e += threads) {
      const int r = e / F, f = e % F;
      const OwnPair pair = own[r];
      const float* phi_j = phit + pair.sender * M4;
      const float* w = ft + pair.pair * M4;
      const float x_vv = __ldcg(phi_j + F + f) * w[F + f], x_vs = __ldcg(phi_j + 2 * F + f) * w[2 * F + f];
      atomicAdd(&zt[pair.receiver * Z4 + f], __ldcg(phi_j + f) * w[f]);
      for (int c = 0; c < 3; ++c)
        atomicAdd(&vm[(3 * pair.receiver + c) * F4 + f],
                  __ldcg(&vt[(3 * pair.sender + c) * F4 + f]) * x_vv + x_vs * geometry[r].direction[c]);
    }
    __syncthreads();
    float* uvt = uvv(t);
    // [U; V] and, later, the transposed weights come from the transposes kernel, which may still
    // be running beside this one: from here on this kernel reads what that kernel writes (the
    // first interaction waits; later calls return at once). Until that kernel rewrites it, the
    // workspace holds whatever its memory last held: under a CUDA graph, another tensor's values.
    wait_for_prior_grid();
    linear_product(3 * na, vector_row, vm, F4, F, ws + L.uv_cat + t * padded_matrix(Z, F), nullptr, Z,
                   to_vectors(uvt, Z4));
    for (int e = tid; e < na * F; e += threads) {
      const int64_t a = a0 + e / F;
      const int f = e % F;
      float sum = p.norm_eps;
      for (int c = 0; c < 3; ++c) {
        const float x = uvt[(3 * a + c) * Z4 + F + f];
        sum = fmaf(x, x, sum);
      }
      zt[a * Z4 + F + f] = sqrtf(sum);
    }
    __syncthreads();
    AtomStore to_h2 = to(h2, K4);
    to_h2.activation = layer.update_activation;
    to_h2.pre = pre2(t);
    linear_product(na, atom_row, zt, Z4, Z, layer.mlp1_w, layer.mlp1_b, K, to_h2);
    linear_product(na, atom_row, h2, K4, K, layer.mlp2_w, layer.mlp2_b, M, to(a_out(t), M4));
    // v = v_m + a_vv U v; s = s_m + a_sv <U v, V v> + a_ss.
    const float* gates = a_out(t);
    for (int e = tid; e < na * F; e += threads) {
      const int64_t a = a0 + e / F;
      const int f = e % F;
      const float a_vv = gates[a * M4 + f], a_sv = gates[a * M4 + F + f], a_ss = gates[a * M4 + 2 * F + f];
      float dot = 0.0f;
      for (int c = 0; c < 3; ++c) {
        const int64_t row = (3 * a + c) * F4 + f, uv_at = (3 * a + c) * Z4 + f;
        dot = fmaf(uvt[uv_at], uvt[uv_at + F], dot);
        if (t + 1 < T) v_in(t + 1)[row] = fmaf(a_vv, uvt[uv_at], vm[row]);
      }
      s[a * F4 + f] = zt[a * Z4 + f] + fmaf(a_sv, dot, a_ss);
    }
    __syncthreads();
  }
  // The readout and its gradient; then gs = d energy / d s and gv = d energy / d v, interaction
  // by interaction from the last.
  readout_and_gradient(p, a0, na, s, F4, readout, Kr4, ws + L.readout1_t, ws + L.parts, gs, F4, scratch);
  AtomStore add_to_gs = to(gs, F4), add_to_gv = to_vectors(gv, F4);
  add_to_gs.accumulate = add_to_gv.accumulate = true;
  for (int t = T - 1; t >= 0; --t) {
    const PainnInteraction& layer = p.interactions[t];
    const float *gates = a_out(t), *uvt = uvv(t), *zt = z(t);
    // The gated update's gradient: d a = (sum_xyz gv U v, gs <U v, V v>, gs); d (U v) and the
    // part of d (V v) that does not pass through |V v|.
    for (int e = tid; e < na * F; e += threads) {
      const int64_t a = a0 + e / F;
      const int f = e % F;
      const int64_t uv_at = 3 * a * Z4 + f;
      gated_update_backward(gs[a * F4 + f], gates[a * M4 + f], gates[a * M4 + F + f], uvt + uv_at, Z4, F,
                            gv + 3 * a * F4 + f, F4, guvv + uv_at, ga + a * M4 + f);
    }
    __syncthreads();
    AtomStore to_grad_pre2 = to(h2, K4);
    to_grad_pre2.activation = layer.update_activation;
    to_grad_pre2.gate = pre2(t);
    linear_product(na, atom_row, ga, M4, M, ws + L.mlp2_t + t * padded_matrix(K, M), nullptr, K, to_grad_pre2);
    linear_product(na, atom_row, h2, K4, K, ws + L.mlp1_t + t * padded_matrix(Z, K), nullptr, Z, to(gz, Z4));
    // |V v|'s share of d (V v); gs += d s_m through the MLP's input.
    for (int e = tid; e < na * F; e += threads) {
      const int64_t a = a0 + e / F;
      const int f = e % F;
      const float grad_norm = gz[a * Z4 + F + f] / zt[a * Z4 + F + f];
      for (int c = 0; c < 3; ++c) guvv[(3 * a + c) * Z4 + F + f] += grad_norm * uvt[(3 * a + c) * Z4 + F + f];
      gs[a * F4 + f] += gz[a * Z4 + f];
    }
    __syncthreads();
    linear_product(3 * na, vector_row, guvv, Z4, Z, ws + L.uv_t + t * padded_matrix(F, Z), nullptr, F, add_to_gv);
    // gs, gv are now the gradients after the messages. Per pair (i <- j), a warp a pair: with
    // d x = (gs_i, sum_xyz gv_i v_j, sum_xyz gv_i direction), the senders' d phi_j += d x * filter
    // and d v_j += gv_i x_vv; d energy / d distance += sum d x phi_j filter', and / d direction
    // += sum over features of gv_i x_vs.
    const float *phit = phi(t), *ft = filter(t), *slopes = filter_slope(t), *vt = v_in(t);
    float *gphit = gphi(t), *gvst = gvs(t);
    const int lane = tid % 32;
    for (int r = tid / 32; r < np; r += threads / 32) {
      const OwnPair pair = own[r];
      const float* phi_j = phit + pair.sender * M4;
      const float *w = ft + pair.pair * M4, *w_slope = slopes + pair.pair * M4;
      float direction[3], grad_distance = 0.0f, grad_direction[3] = {0.0f, 0.0f, 0.0f};
      for (int c = 0; c < 3; ++c) direction[c] = geometry[r].direction[c];
      for (int f = lane; f < F; f += 32) {
        float g_v[3], grad_x_vv = 0.0f, grad_x_vs = 0.0f;
        for (int c = 0; c < 3; ++c) {
          g_v[c] = gv[(3 * pair.receiver + c) * F4 + f];
          grad_x_vv = fmaf(g_v[c], __ldcg(&vt[(3 * pair.sender + c) * F4 + f]), grad_x_vv);
          grad_x_vs = fmaf(g_v[c], direction[c], grad_x_vs);
        }
        const float grad_x_s = gs[pair.receiver * F4 + f];
        const float phi_s = __ldcg(phi_j + f), phi_vv = __ldcg(phi_j + F + f), phi_vs = __ldcg(phi_j + 2 * F + f);
        atomicAdd(&gphit[pair.sender * M4 + f], grad_x_s * w[f]);
        atomicAdd(&gphit[pair.sender * M4 + F + f], grad_x_vv * w[F + f]);
        atomicAdd(&gphit[pair.sender * M4 + 2 * F + f], grad_x_vs * w[2 * F + f]);
        const float x_vv = phi_vv * w[F + f], x_vs = phi_vs * w[2 * F + f];
        for (int c = 0; c < 3; ++c) {
          atomicAdd(&gvst[(3 * pair.sender + c) * F4 + f], g_v[c] * x_vv);
          grad_direction[c] = fmaf(g_v[c], x_vs, grad_direction[c]);
        }
        grad_distance += grad_x_s * phi_s * w_slope[f] + grad_x_vv * phi_vv * w_slope[F + f] +
                         grad_x_vs * phi_vs * w_slope[2 * F + f];
      }
      grad_distance = warp_sum(grad_distance);
      for (int c = 0; c < 3; ++c) grad_direction[c] = warp_sum(grad_direction[c]);
      if (lane == 0) {
        geometry[r].grad_distance += grad_distance;
        for (int c = 0; c < 3; ++c) geometry[r].grad_direction[c] += grad_direction[c];
      }
    }
    cluster_sync();  // gphi(t) and gvs(t) complete; every block's energy share written
    if (t == T - 1) total_energy_in_a_loop(p.energy, ws + L.parts);
    for (int e = tid; e < 3 * na * F; e += threads) {
      const int64_t at = (3 * a0 + e / F) * F4 + e % F;
      gv[at] += __ldcg(&gvst[at]);
    }
    for (int e = tid; e < na * M; e += threads) {
      const int64_t a = a0 + e / M;
      ga[a * M4 + e % M] = __ldcg(&gphit[a * M4 + e % M]);
    }
    __syncthreads();
    AtomStore to_grad_pre1 = to(h1, H4);
    to_grad_pre1.activation = layer.phi_activation;
    to_grad_pre1.gate = pre1(t);
    linear_product(na, atom_row, ga, M4, M, ws + L.phi2_t + t * padded_matrix(H, M), nullptr, H, to_grad_pre1);
    linear_product(na, atom_row, h1, H4, H, ws + L.phi1_t + t * padded_matrix(F, H), nullptr, F, add_to_gs);
  }

  // d energy / d vectors: through the distance (direction) and the direction ((I - u u^T) / d).
  for (int r = tid; r < np; r += threads) {
    const PairGeometry& g = geometry[r];
    float along = 0.0f, grad[3];
    for (int c = 0; c < 3; ++c) along = fmaf(g.grad_direction[c], g.direction[c], along);
    for (int c = 0; c < 3; ++c)
      grad[c] = g.grad_distance * g.direction[c] + (g.grad_direction[c] - along * g.direction[c]) / g.distance;
    store_pair_gradient(p, own[r], grad);
  }
}

}  // namespace

size_t painn_energy_workspace_bytes(const PainnEnergyParams& params) {
  return static_cast<size_t>(layout_of(params).total) * sizeof(float);
}

// Blocks of painn_transpose_kernel (~540 tiles on benzene's sizes). It runs beside the cluster's
// forward (programmatic dependent launch; the cluster waits for it before its first U v, V v
// product, which reads [U; V] from it), so it is sized to leave a GPC's worth of
// multiprocessors free for the cluster, not to finish first: with 32 blocks it
// takes 22 us but energy+forces on benzene 198-200 us, against 12 us and 208-211 us with 132
// blocks in sequence (H200, 2026-11-24 17:43-17:48 UTC, A/B in one call).
constexpr int kTransposeBlocks = 32;

// The filters' basis rows a block keeps in dynamic shared memory: every pair's, up to this many
// floats (more pairs go a share at a time); num_rbf <= kPainnMaxRbf keeps a pair's two rows in it.
constexpr int64_t kMaxBasisFloats = 2 * kPainnMaxRbf;

cudaError_t launch_painn_energy(const PainnEnergyParams& params, cudaStream_t stream) {
  const int64_t row = 2 * pad4(params.num_rbf);  // a pair's two rows
  if (row > kMaxBasisFloats) return cudaErrorInvalidValue;  // the op refuses num_rbf > kPainnMaxRbf first
  if (const std::optional<cudaError_t> status = try_launch_painn_split(params, stream)) return *status;
  const int64_t floats = std::max(row, std::min(params.num_pairs * row, kMaxBasisFloats / row * row));
  const size_t shared_bytes = static_cast<size_t>(floats) * sizeof(float);
  // The kernel's limit is one size for every call, the most any call takes: set to each call's own
  // size, a smaller one could land between another host thread's setting and its launch.
  cudaError_t error = cudaFuncSetAttribute(painn_energy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kMaxBasisFloats * sizeof(float)));
  if (error != cudaSuccess) return error;
  painn_transpose_kernel<<<kTransposeBlocks, kThreads, 0, stream>>>(params);
  error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  const int limit = cluster_limit<painn_energy_kernel>();
  const int blocks = static_cast<int>(std::min<int64_t>(limit, std::max<int64_t>(params.num_atoms, 1)));
  return launch_cluster<painn_energy_kernel>(blocks, params, stream, true, shared_bytes);
}

}  // namespace mirage::cuda
