// mirage::painn_energy for small molecules on sm_90: PaiNN's features split over a cluster of 16
// blocks, every weight resident in shared memory (launch_painn_energy picks it where it fits).
//
// painn_energy.cu splits the atoms over the blocks, so every block reads every weight for its one
// atom on benzene, from L2, twice a call (forward, and the backward's transposed copy): ~4 MB a
// block, 57% of its cycles (docs/perf/forcefield.md). Here block b owns 1/16 of every feature
// dimension instead: of F its features [b F/16, (b + 1) F/16), of each third of 3F (phi, the
// gates a, the filters) and each half of 2F ([U v; V v], the update MLP's input) the same
// features, of H, K and Kr a contiguous 16th. So the messages, the gated update, |V v| and their
// backward stay inside a block (each is per feature), and a block keeps only its own output rows
// of each weight: ~139 KB of shared memory for benzene's PaiNN student, copied in once a call.
// A product's inputs are every block's slices:
// - forward (y = W x + b, the block's rows of W): each block writes its slices of the input rows
//   into every block's shared memory (distributed shared memory: push) before the barrier, then
//   each forms its own outputs from its own copy of the full rows;
// - backward (dx = W^T dy): each block multiplies its own rows of W by its own slice of dy, over
//   every input, into a room of its shared memory; after a cluster barrier each block adds the
//   16 blocks' parts of its own slice of dx (sum_partials). Pushing those parts to their owners
//   before the barrier instead was slower (137.5 against 135.1 us, H200, 2026-12-02).
// A cluster barrier follows each product whose output another block reads: 10 an interaction.
// The messages and their backward walk each atom's run of pairs (group_pairs), summing in
// registers: where f divides 32 no float atomics, so their sums come in one order every call.
// Benzene's sizes just fit (225 KB of the 227 a block may have); 13 atoms or 137 pairs of
// capacity do not, nor widths that 16 does not divide: those take painn_energy.cu's kernel.
// Measured (H200, docs/perf/forcefield.md "PaiNN's features split over a cluster" and "The
// split kernel's weights by bulk copies"): 150 us a call against that kernel's 172 on benzene
// (2026-12-01); 148 us against 162 for the version before the runs and the bulk copies
// (2026-12-02, a standalone A/B of other inputs); 142.3 us against 148.2 with the biases spread
// over the threads and the basis by turns (bessel_rows; 2026-12-02, the same A/B); 135.1 with the
// forward's inputs pushed (push). Not inlining the products (one copy of their code for the
// instruction cache) made it slower: 157 us. The first version, with remote float atomics for the
// backward's sums (each a compare-and-swap loop over distributed shared memory) and an integer
// division per element in every gather, took 293 us.
#include <cooperative_groups.h>

#include "atom_products.cuh"
#include "painn_energy.cuh"
#include "radial_functions.cuh"

namespace mirage::cuda {
namespace {

using namespace atomwise;
namespace cg = cooperative_groups;

constexpr int kSplit = 16;  // blocks of the cluster, each 1/16 of every feature dimension

// A feature dimension of `width` features in `chunks` equal parts (3F: phi's s, vv, vs thirds),
// each part split evenly over the blocks. A block's slice holds, part after part, its share of
// each: `slice()` features, in the block's arrays a row of that many floats.
struct Dim {
  int width, chunks;
  __host__ __device__ int chunk() const { return width / chunks; }
  __host__ __device__ int share() const { return chunk() / kSplit; }
  __host__ __device__ int slice() const { return width / kSplit; }
  // The feature at place l of block `rank`'s slice.
  __device__ int global(int rank, int l) const { return l / share() * chunk() + rank * share() + l % share(); }
};

// Offsets (in floats) of one interaction's weights in shared memory: the block's rows, each
// `ins` floats (the filter's R4), and their biases (0 where absent).
struct SplitWeights {
  int64_t phi1_w, phi1_b, phi2_w, phi2_b, filter_w, filter_b, uv_w, mlp1_w, mlp1_b, mlp2_w, mlp2_b, total;
};

// The block's arrays in dynamic shared memory, in floats; [T] = one per interaction; rows of a
// slice are its width (Dim::slice) apart.
struct SplitLayout {
  int f, h, k, r;  // slices of F, H, K, Kr
  int R4;
  SplitWeights w;       // offsets within an interaction's weights
  int64_t weights;      // [T] interactions' weights, w.total each
  int64_t readout1_w, readout1_b, readout2_w;
  int64_t pre1, phi, v, z, uvv, pre2, gates;  // [T] forward values the backward reads
  int64_t s, vm, h1, h2, readout, gs, gv;     // [N][f] s, [3N][f] vm, ...
  int64_t ga, gh2, gz, guvv, gvs, gh1;        // [N][3f] the forward's gates, then d a and d phi; ...
  // Two rooms of rows: the forward's products read their input rows from each in turn (push), the
  // backward's products leave their parts in each in turn (sum_partials), and the basis' slopes
  // in the one its next product fills.
  int64_t rows[2];
  int64_t pair_ints, geometry, basis, pair_grads;  // [P][3], [P][6], [P][R4], [P][4]
  // The kept pairs grouped by atom, as ints: [2][N] the ends of each atom's run (receivers', then
  // senders'), [2][P] the runs' pairs (by receiver, then by sender), each run in pair order.
  int64_t run_ends, runs;
  int64_t energy_part;
  int64_t total;
};

__host__ __device__ inline SplitLayout split_layout_of(const PainnEnergyParams& p) {
  const int64_t N = p.num_atoms, P = p.num_pairs, T = p.num_interactions;
  const int F = p.features, H = p.phi_hidden, K = p.update_hidden;
  SplitLayout l{};
  l.f = F / kSplit;
  l.h = H / kSplit;
  l.k = K / kSplit;
  l.r = p.readout_hidden / kSplit;
  l.R4 = static_cast<int>(pad4(p.num_rbf));
  const int m = 3 * l.f, z = 2 * l.f;
  FloatArena w;
  l.w.phi1_w = w.take(l.h * F);
  l.w.phi1_b = w.take(l.h);
  l.w.phi2_w = w.take(m * H);
  l.w.phi2_b = w.take(m);
  l.w.filter_w = w.take(m * l.R4);
  l.w.filter_b = w.take(m);
  l.w.uv_w = w.take(z * F);
  l.w.mlp1_w = w.take(l.k * 2 * F);
  l.w.mlp1_b = w.take(l.k);
  l.w.mlp2_w = w.take(m * K);
  l.w.mlp2_b = w.take(m);
  l.w.total = w.size;
  FloatArena a;
  l.weights = a.take(T * l.w.total);
  l.readout1_w = a.take(l.r * F);
  l.readout1_b = a.take(l.r);
  l.readout2_w = a.take(l.r);
  l.pre1 = a.take(T * N * l.h);
  l.phi = a.take(T * N * m);
  l.v = a.take(T * 3 * N * l.f);
  l.z = a.take(T * N * z);
  l.uvv = a.take(T * 3 * N * z);
  l.pre2 = a.take(T * N * l.k);
  l.gates = a.take(T * N * z);
  l.s = a.take(N * l.f);
  l.vm = a.take(3 * N * l.f);
  l.h1 = a.take(N * l.h);
  l.h2 = a.take(N * l.k);
  l.readout = a.take(N * l.r);
  l.gs = a.take(N * l.f);
  l.gv = a.take(3 * N * l.f);
  l.ga = a.take(N * m);
  l.gh2 = a.take(N * l.k);
  l.gz = a.take(N * z);
  l.guvv = a.take(3 * N * z);
  l.gvs = a.take(3 * N * l.f);
  l.gh1 = a.take(N * l.h);
  // The most rows: vm's 3N rows of F (N of 2F, H or K for the others), or the pairs' slopes.
  const int64_t widest = std::max<int64_t>(std::max(3 * F, 2 * F), std::max(H, K));
  for (int64_t& room : l.rows) room = a.take(std::max(N * widest, P * l.R4));
  l.pair_ints = a.take(3 * P);
  l.run_ends = a.take(2 * N);
  l.runs = a.take(2 * P);
  l.geometry = a.take(6 * P);
  l.basis = a.take(P * l.R4);
  l.pair_grads = a.take(4 * P);
  l.energy_part = a.take(1);
  l.total = a.size;
  return l;
}

__device__ __forceinline__ bool aligned16(const float* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The weights' copies into shared memory, started at the kernel's start and waited for before its
// first product. Where a block's rows of a weight are whole 16-byte runs, one thread hands them to
// the copy engine (cp.async.bulk, a few copies of kilobytes each, completing on one mbarrier);
// the other weights go 4 or 16 bytes a thread (cp.async). Bulk copies were chosen because
// cp.async from every thread took ~15 us for benzene's ~139 KB a block (H200, 2026-12-02):
// the block's loads in flight at once, not the bytes, bound it.
struct WeightCopies {
  uint64_t* barrier;  // in shared memory; one phase: every bulk copy's bytes, and one arrival
  __device__ unsigned barrier_address() const { return static_cast<unsigned>(__cvta_generic_to_shared(barrier)); }
  // Thread 0, before any copy.
  __device__ void init() const {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(barrier_address()) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::: "memory");
  }
  // Thread 0: `bytes` (a multiple of 16; both addresses 16-byte aligned) from `from` to `to`.
  __device__ void bulk(float* to, const float* from, unsigned bytes) const {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(barrier_address()), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     static_cast<unsigned>(__cvta_generic_to_shared(to))),
                 "l"(from), "r"(bytes), "r"(barrier_address())
                 : "memory");
  }
  // Thread 0, after its last bulk copy.
  __device__ void all_started() const {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(barrier_address()) : "memory");
  }
  // Every thread: the copies have landed.
  __device__ void wait() const {
    wait_copies();
    asm volatile(
        "{\n\t.reg .pred done;\n\tWAIT_COPIES:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n\t@!done bra WAIT_COPIES;\n\t}" ::"r"(
            barrier_address())
        : "memory");
  }
};

// The block's rows of a weight [dim.width][ins] (nn.Linear layout) into `out`, `stride` floats
// apart, without waiting for them: the rows of each of dim's chunks, from chunk_rows(c) on (where
// chunk c's first row is), are one run in global memory.
template <class ChunkRows>
__device__ void stage_rows(float* out, Dim dim, int ins, int stride, int rank, ChunkRows chunk_rows,
                           const WeightCopies& copies) {
  const int share = dim.share();
  bool aligned = ins % 4 == 0 && stride % 4 == 0;
  for (int c = 0; c < dim.chunks; ++c) aligned = aligned && aligned16(chunk_rows(c));
  if (aligned && stride == ins) {
    if (threadIdx.x == 0)
      for (int c = 0; c < dim.chunks; ++c)
        copies.bulk(out + c * share * stride, chunk_rows(c) + static_cast<int64_t>(rank) * share * ins,
                    static_cast<unsigned>(share * ins * sizeof(float)));
    return;
  }
  const int step = aligned ? 4 : 1, per_row = ins / step, rows = dim.slice();
  // A thread keeps one place in the rows (its loads of successive rows independent). The row's
  // address takes a division a copy: this path is only for rows the bulk copies cannot take.
  const int lanes = min(per_row, static_cast<int>(blockDim.x)), passes = blockDim.x / lanes;
  if (threadIdx.x < lanes * passes)
    for (int k = threadIdx.x % lanes * step; k < ins; k += lanes * step)
      for (int l = threadIdx.x / lanes; l < rows; l += passes)
        copy_async(out + l * stride + k,
                   chunk_rows(l / share) + static_cast<int64_t>(rank * share + l % share) * ins + k, 4 * step);
}

// A weight [dim.width][ins] (its bias: BiasLoads).
__device__ void stage_linear(float* out, const float* w, Dim dim, int ins, int stride, int rank,
                             const WeightCopies& copies) {
  stage_rows(out, dim, ins, stride, rank, [&](int c) { return w + static_cast<int64_t>(c) * dim.chunk() * ins; },
             copies);
}

// The block's slices of the biases (0 where absent), loaded after every weight's copy has started,
// their elements dealt out over the block's threads one after another across the biases: a
// thread's loads are then one or two, not one of each bias. Loaded a bias at a time, slice
// element l by thread l, thread 0's loads sat between its bulk copies and came one after another:
// 146.5 us a call on benzene spread, 148.2 before (H200, 2026-12-02, painn_split_phases.py's A/B).
struct BiasLoads {
  int rank, next = 0;  // the thread the next element goes to
  __device__ void operator()(float* out, const float* bias, Dim dim) {
    const int n = dim.slice(), threads = blockDim.x;
    for (int l = (static_cast<int>(threadIdx.x) - next % threads + threads) % threads; l < n; l += threads)
      out[l] = bias_at(bias, dim.global(rank, l));
    next += n;
  }
};

// Forward product stores: out[r][o] = activate(v + b), v + b kept in `pre` where given. The
// part of atom_products' AtomStore this kernel uses: AtomStore itself (64-bit index, the gate and
// accumulate branches) took the kernel's register spills from 4 to 28-60 bytes (ptxas, sm_90a).
struct SliceStore {
  float* out;
  int stride;
  Activation activation = Activation::kNone;
  float* pre = nullptr;
  float* next = nullptr;  // where given, the next product's rooms: out also goes there (push), as `dim`
  Dim dim{};              // the outputs' dimension: given with `next` (its default has no chunks)
  __device__ void operator()(int r, int o, float v, float b) const;
};

// Element (r, l) of the block's slice of `dim`, v, into every block's copy of the whole rows
// ([rows][dim.width] at `rows`) that the cluster's next product reads: each block writes its
// slices' elements to all 16 blocks ahead of the barrier before that product, which then reads
// its own shared memory only. Pulled after the barrier instead (each block gathering every
// element from its owner), every product waited for a round trip to the other blocks.
__device__ __forceinline__ void push(float* rows, Dim dim, int r, int l, float v) {
  cg::cluster_group cluster = cg::this_cluster();
  float* at = rows + r * dim.width + dim.global(static_cast<int>(cluster.block_rank()), l);
#pragma unroll
  for (int b = 0; b < kSplit; ++b) *cluster.map_shared_rank(at, b) = v;
}

__device__ __forceinline__ void SliceStore::operator()(int r, int o, float v, float b) const {
  const int at = r * stride + o;
  v += b;
  if (pre != nullptr) pre[at] = v;
  const float y = activate(v, activation);
  out[at] = y;
  if (next != nullptr) push(next, dim, r, o, y);
}

// y = W x + b over the cluster: x's whole rows ([rows][width] at `x`, pushed there by every block
// before a cluster barrier), times the block's `outs` rows of W ([outs][width] at w), stored as
// store(r, o, v, b). The 8-lane groups of linear_tile take (4 rows, 2 outputs) items in turn.
// Every thread of the block calls it; it ends with a barrier of the block.
template <class Store>
__device__ void rows_product(const float* x, int width, int rows, const float* w, const float* bias, int outs,
                             Store store) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int tiles = (rows + 3) / 4, pairs = (outs + 1) / 2, items = tiles * pairs;
  const auto row_of = [](int r) -> int64_t { return r; };
  for (int first = warp * 4; first < items; first += warps * 4) {  // a warp's four items at a time
    const int item = first + lane / 8;
    const bool real = item < items;
    linear_tile<4, true>(real ? 4 * (item / pairs) : 0, rows, row_of, x, width, width, w, bias,
                         real ? 2 * (item % pairs) : outs, outs, store);
  }
  __syncthreads();
}

// dx = W^T dy over the cluster, in two halves. The block's part: with its `outs` rows of W
// ([outs][width] at w) and its slice of dy ([rows][outs] at dy), each row's sum over those
// outputs for every input, into `parts` ([rows][width]). A thread takes one input and four rows.
// Every thread of the block calls it.
__device__ void partial_product(const float* dy, int rows, const float* w, int outs, int width, float* parts) {
  const int tiles = (rows + 3) / 4;
  for (int e = threadIdx.x; e < tiles * width; e += blockDim.x) {
    const int g = e % width, first = e / width * 4, n = min(4, rows - first);
    const float* dy_first = dy + first * outs;
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int o = 0; o < outs; ++o) {
      const float w_og = w[o * width + g];
#pragma unroll
      for (int t = 0; t < 4; ++t) sum[t] = fmaf(dy_first[min(t, n - 1) * outs + o], w_og, sum[t]);
    }
    for (int t = 0; t < n; ++t) parts[(first + t) * width + g] = sum[t];
  }
}

// ... then, after a cluster barrier, the block's slice of dx: the blocks' parts (at `parts` in
// each block's shared memory) added in block order (so the sum does not vary from call to call),
// given as store(e, sum), e = r * slice + l, to the slice's [rows][slice] arrays. Remote adds
// into the owners' slices instead were slower: a float add to shared memory is a compare-and-swap
// loop on sm_90, each try two round trips to the other block.
template <class Store>
__device__ void sum_partials(const float* parts, Dim dim, int rows, Store store) {
  cg::cluster_group cluster = cg::this_cluster();
  const int width = dim.width, slice = dim.slice(), rank = static_cast<int>(cluster.block_rank());
  for (int e = threadIdx.x; e < rows * slice; e += blockDim.x) {
    const float* at = parts + e / slice * width + dim.global(rank, e % slice);
    float part[kSplit];
#pragma unroll
    for (int b = 0; b < kSplit; ++b) part[b] = *cluster.map_shared_rank(at, b);
    float sum = 0.0f;
#pragma unroll
    for (int b = 0; b < kSplit; ++b) sum += part[b];
    store(e, sum);
  }
  __syncthreads();
}

// In place, the exclusive prefix sums of counts[0, n): by one warp, every lane of which calls it.
__device__ void warp_exclusive_scan(int* counts, int n) {
  const int lane = threadIdx.x % 32;
  int carry = 0;
  for (int base = 0; base < n; base += 32) {
    const int count = base + lane < n ? counts[base + lane] : 0;
    int sum = count;
    for (int d = 1; d < 32; d *= 2) {
      const int below = __shfl_up_sync(0xffffffffu, sum, d);
      if (lane >= d) sum += below;
    }
    if (base + lane < n) counts[base + lane] = carry + sum - count;
    carry += __shfl_sync(0xffffffffu, sum, 31);
  }
}

// Pairs 0 .. np - 1 grouped by their atom atom_of[3 q] < atoms, each group in pair order, into
// `runs`; `ends` holds each atom's count, then (the start of its run, then) the end of its run. By
// one warp, every lane of which calls it; `ends` must have been counted by the block before.
__device__ void group_pairs(int np, int atoms, const int* atom_of, int* ends, int* runs) {
  const int lane = threadIdx.x % 32;
  warp_exclusive_scan(ends, atoms);
  __syncwarp();
  for (int base = 0; base < np; base += 32) {
    const int q = base + lane, atom = q < np ? atom_of[3 * q] : -1;
    const unsigned same = __match_any_sync(0xffffffffu, atom);
    const int rank = __popc(same & ((1u << lane) - 1u));
    if (atom >= 0) runs[ends[atom] + rank] = q;
    __syncwarp();
    if (atom >= 0 && rank == __popc(same) - 1) ends[atom] += __popc(same);  // the group's last lane
    __syncwarp();
  }
}

// The filters of kept pair q at the block's feature fl: for each third c (s, vv, vs) of its 3f
// outputs, o = c f + fl, the value fcut (W basis + b) and, where `basis_slope` is given, the slope
// fcut' (W basis + b) + fcut W basis'. The rows of W and the basis are R4 floats, zero past R.
struct Filters {
  const float *w, *b, *basis, *basis_slope, *geometry;
  int R4, f;
  __device__ void operator()(int q, int fl, float (&value)[3], float (&slope)[3]) const {
    const float4 *bq = reinterpret_cast<const float4*>(basis + q * R4);
    const float4* sq = reinterpret_cast<const float4*>(basis_slope + q * R4);
    float lin[3], lin_slope[3] = {0.0f, 0.0f, 0.0f};
    for (int c = 0; c < 3; ++c) lin[c] = b[c * f + fl];
    for (int k = 0; k < R4 / 4; ++k) {
      const float4 x = bq[k], x_slope = basis_slope != nullptr ? sq[k] : x;
#pragma unroll
      for (int c = 0; c < 3; ++c) {
        const float4 wk = reinterpret_cast<const float4*>(w + (c * f + fl) * R4)[k];
        lin[c] = dot4(lin[c], x, wk);
        if (basis_slope != nullptr) lin_slope[c] = dot4(lin_slope[c], x_slope, wk);
      }
    }
    const float fcut = geometry[6 * q + 1];
    for (int c = 0; c < 3; ++c) {
      value[c] = fcut * lin[c];
      slope[c] = fmaf(geometry[6 * q + 2], lin[c], fcut * lin_slope[c]);
    }
  }
};

__global__ void __launch_bounds__(kThreads) painn_split_kernel(const __grid_constant__ PainnEnergyParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ float4 shared_quads[];
  float* sm = reinterpret_cast<float*>(shared_quads);
  __shared__ SplitLayout L;  // in shared memory: its offsets held in registers would spill
  __shared__ int counters[2 + kThreads / 32];
  __shared__ float scratch[32];
  __shared__ uint64_t copies_barrier;
  const WeightCopies copies{&copies_barrier};
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = threadIdx.x, threads = blockDim.x;
  const int N = static_cast<int>(p.num_atoms), P = static_cast<int>(p.num_pairs), T = p.num_interactions;
  const int F = p.features, H = p.phi_hidden, K = p.update_hidden, R = p.num_rbf;
  if (tid == 0) L = split_layout_of(p);
  start_after_prior_grid();  // launched overlapped: the kernel ahead may be writing the weights, the vectors
  __syncthreads();
  cluster_arrive();  // this block has started (cluster_wait before the first push)
  const int f = L.f, h = L.h, k = L.k, r = L.r, m = 3 * f, z = 2 * f, R4 = L.R4;
  const Dim dF{F, 1}, dH{H, 1}, dK{K, 1}, dKr{p.readout_hidden, 1}, dM{3 * F, 3}, dZ{2 * F, 2};
  const auto at_t = [&](int64_t offset, int t, int64_t size) { return sm + offset + t * size; };
  const auto weights = [&](int t) { return sm + L.weights + t * L.w.total; };
  const auto pre1 = [&](int t) { return at_t(L.pre1, t, N * h); };
  const auto phi = [&](int t) { return at_t(L.phi, t, N * m); };
  const auto v_in = [&](int t) { return at_t(L.v, t, 3 * N * f); };
  const auto zt = [&](int t) { return at_t(L.z, t, N * z); };
  const auto uvv = [&](int t) { return at_t(L.uvv, t, 3 * N * z); };
  const auto pre2 = [&](int t) { return at_t(L.pre2, t, N * k); };
  const auto gates = [&](int t) { return at_t(L.gates, t, N * z); };
  float *s = sm + L.s, *vm = sm + L.vm, *h1 = sm + L.h1, *h2 = sm + L.h2, *readout = sm + L.readout;
  float *gs = sm + L.gs, *gv = sm + L.gv;
  float *ga = sm + L.ga, *gh2 = sm + L.gh2, *gz = sm + L.gz, *guvv = sm + L.guvv, *gvs = sm + L.gvs;
  float* gh1 = sm + L.gh1;
  int* pair_ints = reinterpret_cast<int*>(sm + L.pair_ints);  // [P]: pair, receiver, sender
  float *geometry = sm + L.geometry, *basis = sm + L.basis, *pair_grads = sm + L.pair_grads;
  // The backward's products, in turn: the room its parts go to (sum_partials).
  int products = 0;
  const auto parts_of = [&](int product) { return sm + L.rows[product % 2]; };

  // The block's weights, copied while the pairs are listed.
  if (tid == 0) copies.init();
  for (int t = 0; t < T; ++t) {
    const PainnInteraction& layer = p.interactions[t];
    float* w = weights(t);
    stage_linear(w + L.w.phi1_w, layer.phi1_w, dH, F, F, rank, copies);
    stage_linear(w + L.w.phi2_w, layer.phi2_w, dM, H, H, rank, copies);
    stage_linear(w + L.w.filter_w, layer.filter_w, dM, R, R4, rank, copies);
    for (int e = tid; e < m * (R4 - R); e += threads) w[L.w.filter_w + e / (R4 - R) * R4 + R + e % (R4 - R)] = 0.0f;
    // [U; V]: the block's rows of U, then of V.
    stage_rows(w + L.w.uv_w, dZ, F, F, rank, [&](int c) { return c == 0 ? layer.u_w : layer.v_w; }, copies);
    stage_linear(w + L.w.mlp1_w, layer.mlp1_w, dK, 2 * F, 2 * F, rank, copies);
    stage_linear(w + L.w.mlp2_w, layer.mlp2_w, dM, K, K, rank, copies);
  }
  stage_linear(sm + L.readout1_w, p.readout1_w, dKr, F, F, rank, copies);
  if (tid == 0) copies.all_started();
  BiasLoads load_bias{rank};
  for (int t = 0; t < T; ++t) {
    const PainnInteraction& layer = p.interactions[t];
    float* w = weights(t);
    load_bias(w + L.w.phi1_b, layer.phi1_b, dH);
    load_bias(w + L.w.phi2_b, layer.phi2_b, dM);
    load_bias(w + L.w.filter_b, layer.filter_b, dM);
    load_bias(w + L.w.mlp1_b, layer.mlp1_b, dK);
    load_bias(w + L.w.mlp2_b, layer.mlp2_b, dM);
  }
  load_bias(sm + L.readout1_b, p.readout1_b, dKr);
  load_bias(sm + L.readout2_w, p.readout2_w, dKr);

  // Every block checks every index, so that all of them leave together on a bad one.
  int &kept = counters[0], &invalid = counters[1];
  int* warp_counts = counters + 2;
  if (tid == 0) kept = invalid = 0;
  __syncthreads();
  for (int e = tid; e < P; e += threads) {
    const int64_t i = p.pairs[e], j = p.pairs[P + e];
    if (i < 0 || i >= N || j < 0 || j >= N) invalid = 1;
  }
  for (int a = tid; a < N; a += threads)
    if (p.atomic_numbers[a] < 0 || p.atomic_numbers[a] >= p.num_embeddings) invalid = 1;
  __syncthreads();
  // The block's share of grad_positions: NaN, or 0 for the pairs' gradients added at the end; of
  // the pairs at or beyond the cutoff (which add nothing and are left out): NaN or 0.
  const float nan = __int_as_float(0x7fc00000);
  for (int e = rank + kSplit * tid; e < 3 * N; e += kSplit * threads) p.grad_positions[e] = invalid ? nan : 0.0f;
  for (int e = rank + kSplit * tid; e < P; e += kSplit * threads)
    if (invalid || beyond_cutoff(p, e))
      for (int c = 0; c < 3; ++c) p.grad_vectors[3 * e + c] = invalid ? nan : 0.0f;
  if (invalid) {
    if (rank == 0 && tid == 0) *p.energy = nan;
    copies.wait();  // before the block's shared memory goes
    cluster_wait();
    return;
  }

  // The pairs within the cutoff, in pair order (the same list in every block): a warp's ballot,
  // then the warps' counts before it.
  const int lane = tid % 32, warp = tid / 32;
  for (int base = 0; base < P; base += threads) {
    const int e = base + tid;
    const bool keep = e < P && !beyond_cutoff(p, e);
    const unsigned ballot = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int q = kept + __popc(ballot & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) q += warp_counts[w];
    if (keep) {
      const float3 vec = pair_vector(p, e);
      const float d = length(vec), inverse = 1.0f / d;
      pair_ints[3 * q] = e;
      pair_ints[3 * q + 1] = static_cast<int>(p.pairs[e]);
      pair_ints[3 * q + 2] = static_cast<int>(p.pairs[P + e]);
      float* g = geometry + 6 * q;
      g[0] = d;
      g[1] = envelope(CutoffFn::kCosine, d, p.cutoff);
      g[2] = envelope_derivative(CutoffFn::kCosine, d, p.cutoff);
      g[3] = vec.x * inverse;
      g[4] = vec.y * inverse;
      g[5] = vec.z * inverse;
    }
    __syncthreads();
    if (tid == 0)
      for (int w = 0; w < threads / 32; ++w) kept += warp_counts[w];
    __syncthreads();
  }
  const int np = kept;
  // Each atom's pairs as receiver and as sender, for the message phases: a lane group walks an
  // atom's run and sums into registers. Before, each pair and feature added into shared memory
  // with float atomics, each a compare-and-swap loop on sm_90, retried while another lands (and
  // a list grouped by receiver gives neighbouring pairs one sender): with the bulk copies, the
  // runs took the kernel from 166 to 148 us (H200, 2026-12-02, standalone A/B).
  int *run_ends = reinterpret_cast<int*>(sm + L.run_ends), *runs = reinterpret_cast<int*>(sm + L.runs);
  int *receiver_ends = run_ends, *sender_ends = run_ends + N, *by_receiver = runs, *by_sender = runs + P;
  for (int e = tid; e < 2 * N; e += threads) run_ends[e] = 0;
  __syncthreads();
  for (int q = tid; q < np; q += threads) {
    atomicAdd(&receiver_ends[pair_ints[3 * q + 1]], 1);
    atomicAdd(&sender_ends[pair_ints[3 * q + 2]], 1);
  }
  __syncthreads();
  if (warp < 2)  // warp 0 by receiver, warp 1 by sender
    group_pairs(np, N, pair_ints + 1 + warp, warp == 0 ? receiver_ends : sender_ends, warp == 0 ? by_receiver : by_sender);
  const auto run_begin = [&](const int* ends, int a) { return a > 0 ? ends[a - 1] : 0; };
  // The lanes of the message phases: an atom's run is walked by a group of lanes, one a feature
  // times `subs` over the run. Where f divides 32 a group is a warp, and its sums over the run
  // are added up by shuffles; else it is f lanes, and subs 1.
  const int group = 32 % f == 0 ? 32 : f, subs = group / f;
  // Each pair's basis sqrt(2 / c) sin(w d) / d, w = n pi / c, into `values` or its derivative in
  // d into `slopes` (the backward's, in a room of rows: recomputed, not kept); zero past R. A
  // thread takes a pair and turns the sine and cosine of pi d / c to each w d (one sincosf a pair,
  // not one a value: the slopes, recomputed in each interaction's backward, had ~5% of the
  // kernel's stall samples, Nsight Compute, H200, 2026-12-02). Each turn adds about an ulp, less
  // than the rounding of w d itself in a float32 composite. Below x = w d = 0.1, the series of
  // sinc_and_derivative, as radial_basis (no cancellation in the slope, finite at d = 0).
  const auto bessel_rows = [&](float* values, float* slopes) {
    const float scale = sqrtf(2.0f / p.cutoff), step = kPi / p.cutoff;
    for (int q = tid; q < np; q += threads) {
      const float d = geometry[6 * q], inverse = 1.0f / d;
      float sine_step, cosine_step;
      sincosf(step * d, &sine_step, &cosine_step);
      float sine = sine_step, cosine = cosine_step;  // of w d, w = (n + 1) step
      for (int n = 0; n < R4; ++n) {
        const float frequency = (n + 1) * step, x = frequency * d;
        float value = 0.0f, slope = 0.0f;
        if (n < R && fabsf(x) < kSincSeriesBelow) {
          float sinc_value, sinc_slope;
          sinc_and_derivative(x, sinc_value, sinc_slope);
          value = scale * frequency * sinc_value;
          slope = scale * frequency * frequency * sinc_slope;
        } else if (n < R) {
          value = scale * sine * inverse;
          slope = scale * inverse * fmaf(frequency, cosine, -sine * inverse);
        }
        if (values != nullptr) values[q * R4 + n] = value;
        if (slopes != nullptr) slopes[q * R4 + n] = slope;
        const float turned = fmaf(sine, cosine_step, cosine * sine_step);
        cosine = fmaf(cosine, cosine_step, -sine * sine_step);
        sine = turned;
      }
    }
  };
  bessel_rows(basis, nullptr);
  for (int e = tid; e < 4 * np; e += threads) pair_grads[e] = 0.0f;
  // The first vectors are 0 (and d energy / d the last ones, before the backward adds to it); the
  // scalars are the embedding.
  for (int e = tid; e < N * f; e += threads) s[e] = p.embedding[p.atomic_numbers[e / f] * F + dF.global(rank, e % f)];
  for (int e = tid; e < 3 * N * f; e += threads) gv[e] = v_in(0)[e] = 0.0f;
  // The forward's products read their input rows from two rooms in turn: a phase's product reads
  // one, the phase pushes the next product's input into the other (read by no block since the
  // barrier before the phase).
  float* rooms[2] = {sm + L.rows[0], sm + L.rows[1]};
  int room = 0;  // the room the next product reads
  cluster_wait();  // every block has started: its shared memory may be written
  for (int e = tid; e < N * f; e += threads) push(rooms[room], dF, e / f, e % f, s[e]);
  copies.wait();
  cluster_sync();  // s in every block
  const auto next_phase = [&]() {
    cluster_sync();
    room ^= 1;
  };

  for (int t = 0; t < T; ++t) {
    const PainnInteraction& layer = p.interactions[t];
    const float* w = weights(t);
    const Filters filters{w + L.w.filter_w, w + L.w.filter_b, basis, nullptr, geometry, R4, f};
    rows_product(rooms[room], F, N, w + L.w.phi1_w, w + L.w.phi1_b, h,
                 SliceStore{h1, h, layer.phi_activation, pre1(t), rooms[room ^ 1], dH});
    next_phase();  // h1
    rows_product(rooms[room], H, N, w + L.w.phi2_w, w + L.w.phi2_b, m, SliceStore{phi(t), m});
    // The messages, per receiver i and feature, over its pairs (i <- j): x = phi[j] * filter,
    // split into (x_s, x_vv, x_vs); s_i + sum x_s and v_i + sum (v_j x_vv + x_vs direction), into
    // sm_t and vm.
    float *sm_t = zt(t), *vt = v_in(t);
    const float* phit = phi(t);
    for (int first = tid - lane; first < N * group; first += threads) {  // whole warps: the shuffles
      const int e = first + lane, i = e / group, fl = e % group % f, sub = e % group / f;
      const bool real = e < N * group;
      float x_s = 0.0f, x_v[3] = {0.0f, 0.0f, 0.0f};
      for (int k = real ? run_begin(receiver_ends, i) + sub : 0; real && k < receiver_ends[i]; k += subs) {
        const int q = by_receiver[k], j = pair_ints[3 * q + 2];
        const float* phi_j = phit + j * m;
        float filter[3], unused[3];
        filters(q, fl, filter, unused);
        const float x_vv = phi_j[f + fl] * filter[1], x_vs = phi_j[2 * f + fl] * filter[2];
        x_s = fmaf(phi_j[fl], filter[0], x_s);
        for (int c = 0; c < 3; ++c) x_v[c] += fmaf(vt[(3 * j + c) * f + fl], x_vv, x_vs * geometry[6 * q + 3 + c]);
      }
      for (int other = f; other < group; other *= 2) {  // the sums of the group's subs
        x_s += __shfl_xor_sync(0xffffffffu, x_s, other);
        for (int c = 0; c < 3; ++c) x_v[c] += __shfl_xor_sync(0xffffffffu, x_v[c], other);
      }
      if (real && sub == 0) {
        sm_t[i * z + fl] = s[i * f + fl] + x_s;
        for (int c = 0; c < 3; ++c) {
          vm[(3 * i + c) * f + fl] = vt[(3 * i + c) * f + fl] + x_v[c];
          push(rooms[room ^ 1], dF, 3 * i + c, fl, vm[(3 * i + c) * f + fl]);
        }
      }
    }
    next_phase();  // vm
    float* uvt = uvv(t);
    rows_product(rooms[room], F, 3 * N, w + L.w.uv_w, nullptr, z, SliceStore{uvt, z});
    for (int e = tid; e < N * f; e += threads) {
      const int a = e / f, fl = e % f;
      float sum = p.norm_eps;
      for (int c = 0; c < 3; ++c) {
        const float x = uvt[(3 * a + c) * z + f + fl];
        sum = fmaf(x, x, sum);
      }
      sm_t[a * z + f + fl] = sqrtf(sum);
      push(rooms[room ^ 1], dZ, a, fl, sm_t[a * z + fl]);  // the messages' s: its room was being read then
      push(rooms[room ^ 1], dZ, a, f + fl, sm_t[a * z + f + fl]);
    }
    next_phase();  // z = [s after the messages, |V v|]
    rows_product(rooms[room], 2 * F, N, w + L.w.mlp1_w, w + L.w.mlp1_b, k,
                 SliceStore{h2, k, layer.update_activation, pre2(t), rooms[room ^ 1], dK});
    next_phase();  // h2
    float* a_out = ga;  // the gates (a_vv, a_sv, a_ss), before the backward needs ga
    rows_product(rooms[room], K, N, w + L.w.mlp2_w, w + L.w.mlp2_b, m, SliceStore{a_out, m});
    // v = v_m + a_vv U v; s = s_m + a_sv <U v, V v> + a_ss.
    float* gt = gates(t);
    for (int e = tid; e < N * f; e += threads) {
      const int a = e / f, fl = e % f;
      const float a_vv = a_out[a * m + fl], a_sv = a_out[a * m + f + fl], a_ss = a_out[a * m + 2 * f + fl];
      gt[a * z + fl] = a_vv;
      gt[a * z + f + fl] = a_sv;
      float dot = 0.0f;
      for (int c = 0; c < 3; ++c) {
        const float uv = uvt[(3 * a + c) * z + fl];
        dot = fmaf(uv, uvt[(3 * a + c) * z + f + fl], dot);
        if (t + 1 < T) v_in(t + 1)[(3 * a + c) * f + fl] = fmaf(a_vv, uv, vm[(3 * a + c) * f + fl]);
      }
      s[e] = sm_t[a * z + fl] + fmaf(a_sv, dot, a_ss);
      push(rooms[room ^ 1], dF, a, fl, s[e]);
    }
    next_phase();  // s
  }

  // The readout and the energy; d energy / d s into gs.
  rows_product(rooms[room], F, N, sm + L.readout1_w, sm + L.readout1_b, r, SliceStore{readout, r});
  float energy = 0.0f;
  for (int e = tid; e < N * r; e += threads) {
    const float v = readout[e], w2 = sm[L.readout2_w + e % r];
    energy = fmaf(activate(v, p.readout_activation), w2, energy);
    readout[e] = activation_grad(v, p.readout_activation) * w2;  // its gradient
  }
  energy = block_sum(energy, scratch);  // its barriers also order the gradient's writes
  if (tid == 0) sm[L.energy_part] = energy;
  // d x = W^T dy over the cluster into the block's slice: store(e, sum) for each element.
  const auto backward_product = [&](const float* dy, int rows, const float* w, int outs, Dim dim, auto store) {
    float* parts = parts_of(products++);
    partial_product(dy, rows, w, outs, dim.width, parts);
    cluster_sync();
    sum_partials(parts, dim, rows, store);
  };
  backward_product(readout, N, sm + L.readout1_w, r, dF, [&](int e, float sum) { gs[e] = sum; });
  if (rank == 0 && tid < 32) {  // every block's energy is in after the barrier above
    const float total = warp_sum(tid < kSplit ? *cluster.map_shared_rank(sm + L.energy_part, tid) : 0.0f);
    if (tid == 0) *p.energy = total + N * bias_at(p.readout2_b, 0);
  }

  for (int t = T - 1; t >= 0; --t) {
    const PainnInteraction& layer = p.interactions[t];
    const float* w = weights(t);
    const float *gt = gates(t), *uvt = uvv(t), *z_t = zt(t);
    // The gated update's gradient.
    for (int e = tid; e < N * f; e += threads) {
      const int a = e / f, fl = e % f, uv_at = 3 * a * z + fl;
      gated_update_backward(gs[e], gt[a * z + fl], gt[a * z + f + fl], uvt + uv_at, z, f, gv + 3 * a * f + fl, f,
                            guvv + uv_at, ga + a * m + fl);
    }
    __syncthreads();
    const float *pre1t = pre1(t), *pre2t = pre2(t);
    backward_product(ga, N, w + L.w.mlp2_w, m, dK, [&](int e, float sum) {
      gh2[e] = sum * activation_grad(pre2t[e], layer.update_activation);
    });
    backward_product(gh2, N, w + L.w.mlp1_w, k, dZ, [&](int e, float sum) { gz[e] = sum; });
    // |V v|'s share of d (V v); gs += d s_m through the MLP's input.
    for (int e = tid; e < N * f; e += threads) {
      const int a = e / f, fl = e % f;
      const float grad_norm = gz[a * z + f + fl] / z_t[a * z + f + fl];
      for (int c = 0; c < 3; ++c) guvv[(3 * a + c) * z + f + fl] += grad_norm * uvt[(3 * a + c) * z + f + fl];
      gs[e] += gz[a * z + fl];
    }
    __syncthreads();
    backward_product(guvv, 3 * N, w + L.w.uv_w, z, dF, [&](int e, float sum) { gv[e] += sum; });
    // gs, gv are now the gradients after the messages. Per pair (i <- j) and feature, with
    // d x = (gs_i, sum_xyz gv_i v_j, sum_xyz gv_i direction): the senders' d phi_j += d x * filter
    // and d v_j += gv_i x_vv; d energy / d distance += sum d x phi_j filter', and / d direction
    // += gv_i x_vs (the block's features' share; the blocks' shares are added at the end). The
    // basis' slopes go to the room the next product's parts fill (every block has read from it).
    float* basis_slope = parts_of(products);
    bessel_rows(nullptr, basis_slope);
    float* gphi = ga;
    const float *phit = phi(t), *vt = v_in(t);
    __syncthreads();
    const Filters filters{w + L.w.filter_w, w + L.w.filter_b, basis, basis_slope, geometry, R4, f};
    // A sender's group walks its run: its d phi and d v sums in registers, written once (into
    // gvs: gv is read meanwhile). Where f divides 32, a step's f lanes of a pair add its
    // gradients up with shuffles (a group is a warp: the same steps in every lane); else with atomics.
    const bool lanes_of_a_pair = 32 % f == 0;
    for (int first = tid - lane; first < N * group; first += threads) {
      const int e = first + lane, j = e / group, fl = e % group % f, sub = e % group / f;
      const bool real = e < N * group;
      const int begin = real ? run_begin(sender_ends, j) : 0, end = real ? sender_ends[j] : 0;
      const float* phi_j = phit + j * m;
      float grad_phi[3] = {0.0f, 0.0f, 0.0f}, grad_v[3] = {0.0f, 0.0f, 0.0f};
      for (int step = begin; step < end; step += subs) {
        const int k = step + sub;
        const int q = k < end ? by_sender[k] : -1;
        float grads[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (q >= 0) {
          const int i = pair_ints[3 * q + 1];
          float filter[3], slope[3], g_v[3], grad_x_vv = 0.0f, grad_x_vs = 0.0f;
          filters(q, fl, filter, slope);
          const float* direction = geometry + 6 * q + 3;
          for (int c = 0; c < 3; ++c) {
            g_v[c] = gv[(3 * i + c) * f + fl];
            grad_x_vv = fmaf(g_v[c], vt[(3 * j + c) * f + fl], grad_x_vv);
            grad_x_vs = fmaf(g_v[c], direction[c], grad_x_vs);
          }
          const float grad_x_s = gs[i * f + fl];
          const float phi_s = phi_j[fl], phi_vv = phi_j[f + fl], phi_vs = phi_j[2 * f + fl];
          grad_phi[0] = fmaf(grad_x_s, filter[0], grad_phi[0]);
          grad_phi[1] = fmaf(grad_x_vv, filter[1], grad_phi[1]);
          grad_phi[2] = fmaf(grad_x_vs, filter[2], grad_phi[2]);
          const float x_vv = phi_vv * filter[1], x_vs = phi_vs * filter[2];
          for (int c = 0; c < 3; ++c) {
            grad_v[c] = fmaf(g_v[c], x_vv, grad_v[c]);
            grads[1 + c] = g_v[c] * x_vs;
          }
          grads[0] = grad_x_s * phi_s * slope[0] + grad_x_vv * phi_vv * slope[1] + grad_x_vs * phi_vs * slope[2];
        }
        if (lanes_of_a_pair) {
          for (int other = f / 2; other > 0; other /= 2)
            for (int c = 0; c < 4; ++c) grads[c] += __shfl_xor_sync(0xffffffffu, grads[c], other);
          if (q >= 0 && fl == 0)
            for (int c = 0; c < 4; ++c) pair_grads[4 * q + c] += grads[c];
        } else if (q >= 0) {
          for (int c = 0; c < 4; ++c) atomicAdd(&pair_grads[4 * q + c], grads[c]);
        }
      }
      for (int other = f; other < group; other *= 2)  // the sums of the group's subs
        for (int c = 0; c < 3; ++c) {
          grad_phi[c] += __shfl_xor_sync(0xffffffffu, grad_phi[c], other);
          grad_v[c] += __shfl_xor_sync(0xffffffffu, grad_v[c], other);
        }
      if (real && sub == 0)
        for (int c = 0; c < 3; ++c) {
          gphi[j * m + c * f + fl] = grad_phi[c];
          gvs[(3 * j + c) * f + fl] = grad_v[c];
        }
    }
    __syncthreads();
    for (int e = tid; e < 3 * N * f; e += threads) gv[e] += gvs[e];
    backward_product(gphi, N, w + L.w.phi2_w, m, dH, [&](int e, float sum) {
      gh1[e] = sum * activation_grad(pre1t[e], layer.phi_activation);
    });
    backward_product(gh1, N, w + L.w.phi1_w, h, dF, [&](int e, float sum) { gs[e] += sum; });
  }

  // d energy / d vectors, the block's share of the pairs: the blocks' parts of d energy / d
  // distance and / d direction added, then through the distance (direction) and the direction
  // ((I - u u^T) / d).
  for (int q = rank + kSplit * tid; q < np; q += kSplit * threads) {
    float grads[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int b = 0; b < kSplit; ++b) {
      const float* part = cluster.map_shared_rank(pair_grads + 4 * q, b);
      for (int c = 0; c < 4; ++c) grads[c] += part[c];
    }
    const float* g = geometry + 6 * q;
    float along = 0.0f, grad[3];
    for (int c = 0; c < 3; ++c) along = fmaf(grads[1 + c], g[3 + c], along);
    for (int c = 0; c < 3; ++c) grad[c] = grads[0] * g[3 + c] + (grads[1 + c] - along * g[3 + c]) / g[0];
    store_pair_gradient(p, OwnPair{pair_ints[3 * q], pair_ints[3 * q + 1], pair_ints[3 * q + 2], g[0]}, grad);
  }
  cluster_sync();  // no block leaves while another reads its shared memory
#endif
}

// A launch of painn_split_kernel as one cluster of kSplit blocks, `bytes` of shared memory each,
// its start-up overlapped with the kernel ahead where `overlap` (start_after_prior_grid).
LaunchConfig split_launch(size_t bytes, cudaStream_t stream, bool overlap) {
  LaunchConfig config(dim3(kSplit), dim3(kThreads), bytes, stream);
  config.one_cluster();
  if (overlap) config.overlapped();
  return config;
}

// The most shared memory a block of the split kernel may take on the current device (the kernel
// opted in to it), or 0 where its cluster of kSplit blocks does not run; cached per device.
size_t split_shared_limit() {
  static std::atomic<int64_t> cached[64] = {};  // 0 unknown, -1 no cluster, else the bytes
  int device = 0;
  cudaGetDevice(&device);
  const int64_t known = device < 64 ? cached[device].load(std::memory_order_relaxed) : 0;
  if (known != 0) return known > 0 ? static_cast<size_t>(known) : 0;
  const size_t most = max_shared_bytes_per_block() - sizeof(SplitLayout) - 1024;
  bool runs = false;
  if (whole_model_clusters() && cluster_limit_from_env() == 0 &&
      cudaFuncSetAttribute(painn_split_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess &&
      cudaFuncSetAttribute(painn_split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(most)) == cudaSuccess) {
    int clusters = 0;
    runs = cudaOccupancyMaxActiveClusters(&clusters, painn_split_kernel, split_launch(most, nullptr, false).get()) ==
               cudaSuccess &&
           clusters > 0;
  }
  cudaGetLastError();  // a refused query or attribute: clear its error
  if (device < 64) cached[device].store(runs ? static_cast<int64_t>(most) : -1, std::memory_order_relaxed);
  return runs ? most : 0;
}

}  // namespace

std::optional<cudaError_t> try_launch_painn_split(const PainnEnergyParams& p, cudaStream_t stream) {
  const bool sizes = p.features % kSplit == 0 && p.phi_hidden % kSplit == 0 && p.update_hidden % kSplit == 0 &&
                     p.readout_hidden % kSplit == 0 && p.features > 0 && p.phi_hidden > 0 &&
                     p.update_hidden > 0 && p.readout_hidden > 0 && p.num_atoms <= (1 << 20) &&
                     p.num_pairs <= (1 << 20);
  if (!sizes) return std::nullopt;
  const size_t bytes = static_cast<size_t>(split_layout_of(p).total) * sizeof(float);
  if (bytes > split_shared_limit()) return std::nullopt;
  return split_launch(bytes, stream, overlapped_launches()).launch(painn_split_kernel, p);
}

}  // namespace mirage::cuda
