// mirage::cfconv and its backward: the filter network, the envelope and the message scatter of
// one SchNet interaction in one pass over the pairs.
//
// Layer by layer, a 3,000-atom box (139k pairs, 128 features) writes and reads [P, 128] float32
// tensors about a dozen times per interaction (the hidden layer, its activation, the filters, the
// enveloped filters, their gradients) and runs the filter products on CUDA cores
// (docs/perf/forcefield.md). Here each block keeps the filter network in shared memory, its two
// teams of warps take 64 pairs at a time each and run the products on tensor cores (TF32
// mma.sync, operands by ldmatrix; by default each float32 operand is split into a TF32 high
// part and a TF32 remainder and three products are added, which keeps float32 accuracy): the
// hidden layer goes to shared memory, the filters come out in registers, and the messages are
// scattered with vector atomics, one per run of equal receivers. Only the filters [P, M] go to
// memory, for the backward, which recomputes the hidden layer's pre-activation from the basis
// (a product with K = R) instead of storing it.
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "cfconv.cuh"
#include "filter_table.h"
#include "kernel_utils.cuh"
#include "pair_order.cuh"
#include "radial_functions.cuh"
#include "tf32.cuh"

namespace mirage::cuda {
namespace {

// A block is two teams of 8 warps that share the filter network in shared memory and each
// work through their own tiles, synchronising only within the team: one team's memory-bound
// passes overlap the other's products.
constexpr int kThreads = 512;
constexpr int kTeams = 2;
constexpr int kTeamThreads = kThreads / kTeams;
constexpr int kTeamWarps = kTeamThreads / 32;
constexpr int kTile = 64;                         // pairs per tile
constexpr int kWarpsAlongColumns = 4;             // the [kTile, D] products: 2 x 4 warps of 32 x D/4
constexpr int kMaxRbf = 64;
static_assert((kTeamWarps / kWarpsAlongColumns) * 32 == kTile, "the product's warps cover the tile's rows");

// Teams of kSize threads (the Hopper kernels' are warpgroups of 128).
template <int kSize = kTeamThreads>
__device__ __forceinline__ int team() { return threadIdx.x / kSize; }
template <int kSize = kTeamThreads>
__device__ __forceinline__ int team_thread() { return threadIdx.x % kSize; }
// __syncthreads for one team (named barriers 1, 2, ...; 0 is __syncthreads').
template <int kSize = kTeamThreads>
__device__ __forceinline__ void team_sync() {
  asm volatile("bar.sync %0, %1;" ::"r"(1 + team<kSize>()), "n"(kSize) : "memory");
}

// Four 8 x 4 float32 blocks of shared memory, one per register (ldmatrix's 8 x 8 16-bit
// matrices are 8 x 4 32-bit ones): lane l reads row l / 4, column l % 4 of each block, which is
// the TF32 fragment layout of mma.sync. Lanes 8 q .. 8 q + 7 give the row addresses of block q.
__device__ __forceinline__ void load_blocks(const float* row, float (&v)[4]) {
  uint32_t r[4];
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(row))));
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(r[i]);
}

// The products' operands in shared memory. KRows: element (r, k) at p[r * ld + k], r a row of
// the left operand or a column of the right one; fragments by ldmatrix, so p is 16-byte aligned
// and ld % 8 == 4 (the 8 rows of a block fall in distinct banks). KColumns: a right operand
// with element (k, c) at p[k * ld + c]; fragments by single loads.
struct KRows {
  const float* p;
  int ld;
};
struct KColumns {
  const float* p;
  int ld;
};

// The left operand's fragment of rows row0 .. row0 + 15, columns k0 .. k0 + 7.
__device__ __forceinline__ void left_fragment(const KRows& a, int row0, int k0, float (&v)[4]) {
  const int lane = threadIdx.x % 32;
  load_blocks(a.p + (row0 + lane % 8 + 8 * (lane / 8 % 2)) * a.ld + k0 + 4 * (lane / 16), v);
}

// The right operand's fragments of columns col0 .. col0 + 15 (two n8 tiles), rows k0 .. k0 + 7:
// v[0], v[1] the first tile's, v[2], v[3] the second's.
__device__ __forceinline__ void right_fragments(const KRows& b, int col0, int k0, float (&v)[4]) {
  const int lane = threadIdx.x % 32;
  load_blocks(b.p + (col0 + lane % 8 + 8 * (lane / 16)) * b.ld + k0 + 4 * (lane / 8 % 2), v);
}
// One n8 tile's fragment (KColumns only: the products with an odd number of tiles).
__device__ __forceinline__ void right_fragment(const KColumns& b, int col0, int k0, float (&v)[2]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  v[0] = b.p[(k0 + t) * b.ld + col0 + g];
  v[1] = b.p[(k0 + t + 4) * b.ld + col0 + g];
}
__device__ __forceinline__ void right_fragments(const KColumns& b, int col0, int k0, float (&v)[4]) {
  right_fragment(b, col0, k0, reinterpret_cast<float(&)[2]>(v[0]));
  right_fragment(b, col0 + 8, k0, reinterpret_cast<float(&)[2]>(v[2]));
}

// acc[m][n] += sum over k < K of a(row, k) b(k, col) for this warp's M x N m16n8 tiles at rows
// row0 + 16 m and columns col0 + 8 n (the accumulator layout of the PTX ISA: element e of a
// tile is row g + 8 (e / 2), column 2 t + e % 2 with g = lane / 4, t = lane % 4). K is a
// multiple of 8.
template <int M, int N, bool kSplit, typename B>
__device__ __forceinline__ void mma_tiles(int K, int row0, int col0, const KRows& a, const B& b,
                                          float (&acc)[M][N][4]) {
#pragma unroll 2
  for (int k0 = 0; k0 < K; k0 += 8) {
    uint32_t a_hi[M][4], a_lo[M][4], b_hi[N][2], b_lo[N][2];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float v[4];
      left_fragment(a, row0 + 16 * m, k0, v);
#pragma unroll
      for (int i = 0; i < 4; ++i) split<kSplit>(v[i], a_hi[m][i], a_lo[m][i]);
    }
#pragma unroll
    for (int n = 0; n + 1 < N; n += 2) {
      float v[4];
      right_fragments(b, col0 + 8 * n, k0, v);
#pragma unroll
      for (int i = 0; i < 4; ++i) split<kSplit>(v[i], b_hi[n + i / 2][i % 2], b_lo[n + i / 2][i % 2]);
    }
    if constexpr (N % 2 == 1) {
      float v[2];
      right_fragment(b, col0 + 8 * (N - 1), k0, v);
#pragma unroll
      for (int i = 0; i < 2; ++i) split<kSplit>(v[i], b_hi[N - 1][i], b_lo[N - 1][i]);
    }
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if constexpr (kSplit) {  // the small terms first
          mma_tf32(acc[m][n], a_lo[m], b_hi[n]);
          mma_tf32(acc[m][n], a_hi[m], b_lo[n]);
        }
        mma_tf32(acc[m][n], a_hi[m], b_hi[n]);
      }
  }
}

// This warp's part of a [kTile, D] product: rows row0() .. +32, columns col0() .. + D/4.
template <int D>
struct WarpTile {
  static constexpr int kM = 2, kN = D / 32;
  using Acc = float[kM][kN][4];
  __device__ static int row0() { return (team_thread() / 32 / kWarpsAlongColumns) * 32; }
  __device__ static int col0() { return (team_thread() / 32 % kWarpsAlongColumns) * (D / kWarpsAlongColumns); }
  // f(m, n, e, row, col) for each accumulator element.
  template <typename F>
  __device__ static void for_each(F&& f) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int m = 0; m < kM; ++m)
#pragma unroll
      for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          f(m, n, e, row0() + m * 16 + g + (e >= 2 ? 8 : 0), col0() + n * 8 + 2 * t + (e & 1));
  }
  __device__ static void zero(Acc& acc) {
    for_each([&](int m, int n, int e, int, int) { acc[m][n][e] = 0.0f; });
  }
};

// Shared-memory layout in floats: the block's weights, then each team's tile, basis rows and
// pairs (Layout(num_rbf, team) points at that team's). Every product reads its operands as
// KRows, so each row stride is 4 mod 8 and each array starts 16-byte aligned: the tile and W2
// (or its transpose) with rows of D + 4, the basis and W1 with R rounded up to 8 (zero-filled) + 4.
template <int D>
struct Layout {
  static constexpr int kLd = D + 4;
  int rbf8;      // R rounded up to a multiple of 8: the products' K (or N) over the basis
  int ld_basis;  // rbf8 + 4
  int w2, w1, b1, b2, tile, basis, envelope, receivers, senders, total;

  __host__ __device__ Layout(int num_rbf, int team) {
    rbf8 = (num_rbf + 7) / 8 * 8;
    ld_basis = rbf8 + 4;
    w2 = 0;
    w1 = w2 + D * kLd;
    b1 = w1 + D * ld_basis;
    b2 = b1 + D;
    const int weights = b2 + D, per_team = kTile * (kLd + ld_basis + 3);
    tile = weights + team * per_team;
    basis = tile + kTile * kLd;
    envelope = basis + kTile * ld_basis;
    receivers = envelope + kTile;  // ints from here on
    senders = receivers + kTile;
    total = weights + kTeams * per_team;
  }
  __host__ __device__ size_t bytes() const { return static_cast<size_t>(total) * 4; }
};

// The block's constant operands: W2 ([M, H]; transposed for the backward, whose product takes
// it as [H, M] rows), W1 ([H, R], rows padded with zeros), b1, b2.
template <int D, bool kTransposeW2>
__device__ void load_weights(const CfconvWeights& w, const Layout<D>& l, float* smem) {
  constexpr int kVecs = D / 4, kPerThread = D * kVecs / kThreads;
  static_assert(D * kVecs % kThreads == 0, "W2 loads evenly over the threads");
  float v[kPerThread][4];  // every load in flight before the first store
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    // Transposing, consecutive threads take consecutive rows: their stores to the columns of
    // the transpose then fall in consecutive banks.
    const int e = threadIdx.x + k * kThreads, row = kTransposeW2 ? e % D : e / kVecs,
              col = (kTransposeW2 ? e / D : e % kVecs) * 4;
    load_packed<float, 4>(w.w2 + row * D + col, v[k]);
    if constexpr (kTransposeW2) {
#pragma unroll
      for (int c = 0; c < 4; ++c) smem[l.w2 + (col + c) * Layout<D>::kLd + row] = v[k][c];
    }
  }
  if constexpr (!kTransposeW2) {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int e = threadIdx.x + k * kThreads, row = e / kVecs, col = (e % kVecs) * 4;
      store_packed<float, 4>(smem + l.w2 + row * Layout<D>::kLd + col, v[k]);
    }
  }
  for (int e = threadIdx.x; e < D * l.rbf8; e += kThreads) {
    const int h = e / l.rbf8, r = e - h * l.rbf8;
    smem[l.w1 + h * l.ld_basis + r] = r < w.num_rbf ? w.w1[h * w.num_rbf + r] : 0.0f;
  }
  for (int e = threadIdx.x; e < D; e += kThreads) {
    smem[l.b1 + e] = w.b1 != nullptr ? w.b1[e] : 0.0f;
    smem[l.b2 + e] = w.b2 != nullptr ? w.b2[e] : 0.0f;
  }
}

// The pair at position k of a walk over the pairs: k in list order, order[k] in sender order
// (pair_order.cuh: the backward's messages onto senders then come in runs, one atomic a run).
__device__ __forceinline__ int64_t pair_at(const int* order, int64_t k) { return order == nullptr ? k : order[k]; }

// A tile's pairs: receivers (-1 for padding rows and pairs with an index out of range, which
// also raise *invalid), senders and envelopes (0 for padding), one row a thread. fetch() puts the
// loads in flight into registers; stash() checks them and stores them to shared memory.
struct PairFetch {
  int64_t pair, receiver, sender;  // checked in stash(): a check here would wait for the loads
  float envelope;
  bool real;  // a pair, not padding

  // Row `row` of the tile of walk positions base, base + 1, ... (pair_at); positions from
  // `walked` on (pairs_to_walk) are padding.
  template <typename Params>
  __device__ void fetch(const Params& p, int64_t walked, int64_t base, int row, const int* order = nullptr) {
    envelope = 0.0f;
    real = row < kTile && base + row < walked;
    if (real) {
      pair = pair_at(order, base + row);
      receiver = p.pairs[pair];
      sender = p.pairs[p.num_pairs + pair];
      envelope = p.envelope[pair];
    }
  }

  // Asks L2 for the pair's row of a [P, D] float32 array (the backward's filters: its pass reads
  // them from memory; a prefetch issued during the previous tile's products finds them in L2).
  template <int D>
  __device__ void prefetch_row(const float* rows) const {
    if (!real) return;
    const float* row = rows + pair * D;
#pragma unroll
    for (int b = 0; b < D * 4; b += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + b / 4));
  }

  // ids (optional): the rows' pair indices (-1 for padding), so that later passes need not read
  // the walk's order again.
  template <typename Params>
  __device__ void stash(const Params& p, int row, int* receivers, int* senders, float* envelopes,
                        int64_t* ids = nullptr) const {
    if (row >= kTile) return;
    if (ids != nullptr) ids[row] = real ? pair : -1;
    int i = -1, j = 0;
    if (real) {
      if (receiver >= 0 && receiver < p.num_nodes && sender >= 0 && sender < p.num_nodes) {
        i = static_cast<int>(receiver);
        j = static_cast<int>(sender);
      } else {
        *p.invalid = 1;  // every writer stores the same value
      }
    }
    receivers[row] = i;
    senders[row] = j;
    envelopes[row] = envelope;
  }
};

// A tile's pairs and basis rows (zero-filled): the basis goes straight into shared memory by
// cp.async. The kernels fetch the next tile once the current one is done with the basis, before
// its last pass (which still reads the current pairs), and stash it after: the loads overlap
// that pass.
template <int D>
struct TileFetch {
  static_assert(kTile <= kTeamThreads, "one pair a thread");
  PairFetch pair;

  template <typename Params>
  __device__ void fetch(const Params& p, const Layout<D>& l, float* smem, int64_t walked, int64_t base,
                        const int* order = nullptr) {
    pair.fetch(p, walked, base, team_thread(), order);
    const int num_rbf = p.weights.num_rbf;
    for (int e = team_thread(); e < kTile * l.rbf8; e += kTeamThreads) {
      const int r = e % l.rbf8;
      const int64_t k = base + e / l.rbf8;
      const bool value = r < num_rbf && k < walked;
      const float* source = value ? p.basis + pair_at(order, k) * num_rbf + r : p.basis;
      copy_async(smem + l.basis + e / l.rbf8 * l.ld_basis + r, source, 4, value);  // or four zero bytes
    }
    commit_copies();
  }

  template <typename Params>
  __device__ void stash(const Params& p, const Layout<D>& l, float* smem) const {
    pair.stash(p, team_thread(), reinterpret_cast<int*>(smem + l.receivers), reinterpret_cast<int*>(smem + l.senders),
               smem + l.envelope);
    wait_copies();
  }
};

// The per-pair passes: a warp walks kTile / kWarps consecutive rows of the tile, D/4 lanes per row
// (each a float4 of columns), 32/(D/4) groups of lanes splitting the rows between them. Rows are
// read a few at a time before any atomic, so their loads overlap.
template <int D, int kWarps = kTeamWarps>
struct RowWalk {
  static constexpr int kLanesPerRow = D / 4;
  static constexpr int kGroups = 32 / kLanesPerRow;
  static constexpr int kWarpRows = kTile / kWarps;
  static constexpr int kRows = kWarpRows / kGroups;
  static_assert(kRows % 4 == 0, "the per-pair passes take their rows in batches of 4 and 2");
  int first, col;
  __device__ RowWalk() {
    const int lane = threadIdx.x % 32;
    first = (team_thread<kWarps * 32>() / 32) * kWarpRows + (lane / kLanesPerRow) * kRows;
    col = (lane % kLanesPerRow) * 4;
  }
};

// Float4 rows bound for nodes (this thread's columns of them), summed in registers while the
// node stays the same: one vector atomic per run of equal nodes.
struct RunSum {
  float* column;   // the output's first row at this thread's columns
  int64_t stride;  // the output's row length
  int64_t node = -1;
  float sum[4] = {};

  __device__ RunSum(float* column, int64_t stride) : column(column), stride(stride) {}
  // Adds a * b to node `to`'s row, first flushing the run of another node.
  __device__ void fma(int64_t to, const float (&a)[4], const float (&b)[4]) {
    if (to != node) {
      flush();
      node = to;
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) sum[c] = fmaf(a[c], b[c], sum[c]);
  }
  __device__ void flush() {
    if (node >= 0) atomic_add<4>(column + node * stride, sum);
    node = -1;
#pragma unroll
    for (int c = 0; c < 4; ++c) sum[c] = 0.0f;
  }
};

// The filter network's activation and its slope. SchNet's shifted softplus (kSsp) is inlined
// with the hardware's exp and log (absolute error ~4e-7, against float32 rounding of the
// filters' ~1e-7 relative; measured equal to PyTorch's float32 error within the tests' factor);
// the other activations take one out-of-line call, which keeps the unrolled loops that use
// them small (instruction-cache misses stalled the kernel when all six were inlined there).
__device__ __noinline__ float any_activation(float v, Activation activation) { return activate(v, activation); }
__device__ __noinline__ float any_activation_grad(float v, Activation activation) {
  return activation_grad(v, activation);
}

// The hardware's approximate exp (as 2^(x log2 e)), log2 and 1/x without the denormal fix-ups
// that __expf, __logf and __fdividef add around them (two to three instructions each): the shifted
// softplus' operands never need them (see below). The activation is most of the Hopper forward's
// instructions.
__device__ __forceinline__ float exp_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}
__device__ __forceinline__ float log2_ftz(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float reciprocal_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <bool kSsp>
__device__ __forceinline__ float filter_activation(float v, Activation activation) {
  if constexpr (kSsp) {
    // softplus(v) - log 2 = max(v, 0) - log 2 + log(1 + exp(-|v|)). exp(-|v|) flushed to zero
    // below 2^-126 changes the sum by less than that; above v = 20, where F.softplus returns v,
    // the last term (< 2.1e-9) is below half an ulp of the rest (v - log 2 > 19.3), so the sum
    // rounds to F.softplus' value without a branch. A NaN stays NaN through exp.
    constexpr float kLn2 = 0.6931471805599453f;
    const float tail = log2_ftz(1.0f + exp_ftz(-fabsf(v)));
    return fmaf(tail, kLn2, fmaxf(v, 0.0f) - kLn2);
  } else {
    return any_activation(v, activation);
  }
}

template <bool kSsp>
__device__ __forceinline__ float filter_activation_grad(float v, Activation activation) {
  if constexpr (kSsp) {
    // sigmoid(v) = 1 / (1 + exp(-v)): above v = 20, where F.softplus' backward returns 1, the sum
    // rounds to 1 (exp(-20) is below half an ulp of 1); far below 0, exp(-v) is infinite and the
    // result 0, as the exact value rounds.
    return reciprocal_ftz(1.0f + exp_ftz(-v));
  } else {
    return any_activation_grad(v, activation);
  }
}

// z = W1 basis + b1 for this warp's M x N tiles of the [kTile, D] hidden layer from row row0 on,
// on tensor cores.
template <int D, bool kSplit, int M>
__device__ __forceinline__ void hidden_pre_activation(const Layout<D>& l, const float* smem, int row0,
                                                      float (&z)[M][D / 32][4]) {
  using W = WarpTile<D>;
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < W::kN; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) z[m][n][e] = smem[l.b1 + W::col0() + n * 8 + 2 * t + (e & 1)];
  mma_tiles<M, W::kN, kSplit>(l.rbf8, row0, W::col0(), KRows{smem + l.basis, l.ld_basis},
                              KRows{smem + l.w1, l.ld_basis}, z);
}

// The filters of a tile (rows of D + 4 in shared memory) to memory, and the messages x[j] *
// filter * envelope scattered onto the receivers, one atomic per run of equal receivers.
template <int D, int kWarps = kTeamWarps, typename Params>
__device__ void scatter_messages(const Params& p, const float* tile, const float* envelopes, const int* receivers,
                                 const int* senders, int64_t base, int rows) {
  const RowWalk<D, kWarps> walk;
  RunSum to_receivers(p.out + walk.col, D);
  constexpr int kBatch = 4;
  for (int k0 = 0; k0 < RowWalk<D, kWarps>::kRows; k0 += kBatch) {
    float f[kBatch][4], x[kBatch][4];
    int receiver[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int row = walk.first + k0 + k;
      receiver[k] = row < rows ? receivers[row] : -1;
      if (row < rows) {
        load_packed<float, 4>(tile + row * (D + 4) + walk.col, f[k]);
        store_packed<float, 4>(p.filters + (base + row) * D + walk.col, f[k]);
        const float e = envelopes[row];
#pragma unroll
        for (int c = 0; c < 4; ++c) f[k][c] *= e;
      }
      if (receiver[k] >= 0) load_packed<float, 4>(p.x + static_cast<int64_t>(senders[row]) * D + walk.col, x[k]);
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k)
      if (receiver[k] >= 0) to_receivers.fma(receiver[k], x[k], f[k]);
  }
  to_receivers.flush();
}

// The backward's pass over a tile's pairs (row r: pair pair_of(r), r < rows): grad_x[j] +=
// grad[i] * filter * envelope, one atomic per run of equal senders; the envelope's gradient, the
// filter's gradient grad[i] * x[j] dotted with the filter;
// and that gradient times the envelope to the tile's rows (kLd floats apart; zero for padding
// and bad pairs), where the products take it on.
template <int D, int kWarps, int kLd, int kBatch, typename PairOf>
__device__ void backward_pair_pass(const CfconvBackwardParams& p, PairOf&& pair_of, float* tile,
                                   const float* envelopes, const int* receivers, const int* senders, int rows) {
  using Walk = RowWalk<D, kWarps>;
  const Walk walk;
  RunSum to_senders(p.grad_x + walk.col, D);
  for (int k0 = 0; k0 < Walk::kRows; k0 += kBatch) {
    float f[kBatch][4], g[kBatch][4], x[kBatch][4];
    int64_t pair[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int row = walk.first + k0 + k, i = receivers[row];
      pair[k] = row < rows ? pair_of(row) : -1;
      if (i >= 0) {
        load_packed<float, 4>(p.filters + pair[k] * D + walk.col, f[k]);
        load_packed<float, 4>(p.grad + static_cast<int64_t>(i) * D + walk.col, g[k]);
        load_packed<float, 4>(p.x + static_cast<int64_t>(senders[row]) * D + walk.col, x[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int row = walk.first + k0 + k;
      float grad_pre[4] = {};
      float dot = 0.0f;
      if (receivers[row] >= 0) {
        const float e = envelopes[row];
        float enveloped[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          enveloped[c] = f[k][c] * e;
          const float grad_filter = g[k][c] * x[k][c];
          dot = fmaf(grad_filter, f[k][c], dot);
          grad_pre[c] = grad_filter * e;
        }
        to_senders.fma(senders[row], g[k], enveloped);
      }
      store_packed<float, 4>(tile + row * kLd + walk.col, grad_pre);
#pragma unroll
      for (int offset = Walk::kLanesPerRow / 2; offset > 0; offset >>= 1)
        dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      if (walk.col == 0 && pair[k] >= 0) p.grad_envelope[pair[k]] = dot;
    }
  }
  to_senders.flush();
}

template <int D, bool kSplit, bool kSsp>
__global__ void __launch_bounds__(kThreads, 1) cfconv_kernel(CfconvParams p) {
  start_after_prior_grid();
  using W = WarpTile<D>;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const Layout<D> l(p.weights.num_rbf, team());
  constexpr int kLd = Layout<D>::kLd;
  const int* receivers = reinterpret_cast<const int*>(smem + l.receivers);
  const int* senders = reinterpret_cast<const int*>(smem + l.senders);
  float* tile = smem + l.tile;
  load_weights<D, false>(p.weights, l, smem);
  const int64_t walked = pairs_to_walk(p.live_pairs, p.num_pairs);
  const int64_t tiles = ceil_div(walked, kTile);
  __syncthreads();  // the weights are in
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kTeams;
  TileFetch<D> next;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kTeams + team();
  if (first < tiles) next.fetch(p, l, smem, walked, first * kTile);
  zero_padding(p.filters, walked, p.num_pairs, D);
  for (int64_t t = first; t < tiles; t += stride) {
    const int64_t base = t * kTile;
    const int rows = static_cast<int>(std::min<int64_t>(kTile, walked - base));
    team_sync();  // the previous tile's readers are done with the shared arrays
    next.stash(p, l, smem);
    team_sync();
    typename W::Acc acc;
    hidden_pre_activation<D, kSplit>(l, smem, W::row0(), acc);
    W::for_each([&](int m, int n, int e, int row, int col) {
      tile[row * kLd + col] = filter_activation<kSsp>(acc[m][n][e], p.weights.activation);
    });
    team_sync();
    W::for_each([&](int m, int n, int e, int, int col) { acc[m][n][e] = smem[l.b2 + col]; });
    mma_tiles<W::kM, W::kN, kSplit>(D, W::row0(), W::col0(), KRows{tile, kLd}, KRows{smem + l.w2, kLd}, acc);
    team_sync();  // every warp has read the hidden layer: the tile takes the filters
    W::for_each([&](int m, int n, int e, int row, int col) { tile[row * kLd + col] = acc[m][n][e]; });
    team_sync();
    if (t + stride < tiles) next.fetch(p, l, smem, walked, base + stride * kTile);
    scatter_messages<D>(p, tile, smem + l.envelope, receivers, senders, base, rows);
  }
}

// The backward walks the pairs in `order` (sender order for long lists, pair_order.cuh; null: list
// order): tile rows are walk positions, and the messages onto the senders come in runs.
template <int D, bool kSplit, bool kSsp>
__global__ void __launch_bounds__(kThreads, 1) cfconv_backward_kernel(CfconvBackwardParams p, const int* order) {
  start_after_prior_grid();
  using W = WarpTile<D>;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const Layout<D> l(p.weights.num_rbf, team());
  constexpr int kLd = Layout<D>::kLd;
  const int* receivers = reinterpret_cast<const int*>(smem + l.receivers);
  const int* senders = reinterpret_cast<const int*>(smem + l.senders);
  float* tile = smem + l.tile;
  load_weights<D, true>(p.weights, l, smem);
  const int R = p.weights.num_rbf;
  const int64_t walked = pairs_to_walk(p.live_pairs, p.num_pairs);
  const int64_t tiles = ceil_div(walked, kTile);
  __syncthreads();  // the weights are in
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kTeams;
  TileFetch<D> next;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kTeams + team();
  if (first < tiles) next.fetch(p, l, smem, walked, first * kTile, order);
  zero_padding(p.grad_basis, walked, p.num_pairs, R);
  zero_padding(p.grad_envelope, walked, p.num_pairs, 1);
  for (int64_t t = first; t < tiles; t += stride) {
    const int64_t base = t * kTile;
    const int rows = static_cast<int>(std::min<int64_t>(kTile, walked - base));
    team_sync();
    next.stash(p, l, smem);
    team_sync();
    // Two rows at a time (three operand rows each): more spills registers.
    backward_pair_pass<D, kTeamWarps, kLd, 2>(p, [&](int row) { return pair_at(order, base + row); }, tile,
                                              smem + l.envelope, receivers, senders, rows);
    team_sync();
    // The hidden layer's gradient: (tile W2) * act'(z), z recomputed on tensor cores 16 rows at a
    // time (fewer live registers).
    typename W::Acc acc;
    W::zero(acc);
    mma_tiles<W::kM, W::kN, kSplit>(D, W::row0(), W::col0(), KRows{tile, kLd}, KRows{smem + l.w2, kLd}, acc);
#pragma unroll
    for (int m = 0; m < W::kM; ++m) {
      float z[1][W::kN][4];
      hidden_pre_activation<D, kSplit>(l, smem, W::row0() + 16 * m, z);
#pragma unroll
      for (int n = 0; n < W::kN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][n][e] *= filter_activation_grad<kSsp>(z[0][n][e], p.weights.activation);
    }
    team_sync();  // every warp has read the tile: it takes the hidden layer's gradient
    W::for_each([&](int m, int n, int e, int row, int col) { tile[row * kLd + col] = acc[m][n][e]; });
    team_sync();
    if (t + stride < tiles) next.fetch(p, l, smem, walked, base + stride * kTile, order);
    // grad_basis = that gradient times W1: [kTile, R] in tasks of 32 x 8 (two accumulator
    // chains a warp), spread over the warps.
    const int col_tiles = l.rbf8 / 8;
    for (int task = team_thread() / 32; task < (kTile / 32) * col_tiles; task += kTeamWarps) {
      const int row0 = (task / col_tiles) * 32, col0 = (task % col_tiles) * 8;
      float out[2][1][4] = {};
      mma_tiles<2, 1, kSplit>(D, row0, col0, KRows{tile, kLd}, KColumns{smem + l.w1, l.ld_basis}, out);
      const int lane = threadIdx.x % 32;
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = row0 + m * 16 + lane / 4 + (e >= 2 ? 8 : 0), r = col0 + 2 * (lane % 4) + (e & 1);
          if (row < rows && r < R) p.grad_basis[pair_at(order, base + row) * R + r] = out[m][0][e];
        }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Hopper (sm_90a): the products as warpgroup MMAs (wgmma), for the SchNet-sized network
// (H == M == 128, R <= 23). Nsight Compute on the forward kernel above (H200, 3,000-atom box): 69M
// instructions issued, ~7 per tensor-core instruction, most of them fragment loads and the TF32
// split of operands that every warp reading them repeats. Here each warpgroup (a team of 128
// threads) takes a 64-pair tile through both products on its own: the weights sit in shared
// memory already split into their TF32 parts (the tensor cores read them through descriptors, no
// per-warp loads), and the hidden layer stays in registers from one product to the next, split
// once: 28M instructions, 126 µs against 180 (docs/perf/forcefield.md). The backward
// (cfconv_backward_kernel below) keeps the portable kernel's pass over the pairs and its shared
// tile, and runs its products the same way: 223 against 273 µs. (A first wgmma backward, the
// per-pair pass loading each thread's fragments straight from memory, no shared tile, took 448
// µs against 337, its loads exposed with 8 warps a multiprocessor and registers spilling.)
namespace sm90 {

constexpr int kWidth = 128;                    // H == M
constexpr int kBasisK = 24;                    // R basis columns + a column of ones for b1, padded
constexpr int kChunks = kWidth / 8;            // K chunks of a product over the hidden layer
constexpr int kBasisChunks = kBasisK / 8;
constexpr int kTeamThreads = 128;              // a warpgroup
constexpr int kTeams = 2;
constexpr int kThreads = kTeams * kTeamThreads;
constexpr int kTileLd = kWidth + 4;            // the team's tile (filters; the backward's filter gradients)

// A B operand in shared memory, N x K floats as the tensor cores read it: K-major without swizzle,
// 8 x 4 "core matrices" of 128 contiguous bytes, the K-adjacent ones next to each other, then the
// next 8 rows. Within each K chunk of 8, slot s holds index 2 s (s < 4) or 2 (s - 4) + 1: the order
// in which a thread holds an accumulator row's columns (2 t and 2 t + 1 of each n8 tile), so that
// one product's result is the next one's A fragment in registers as it is.
__host__ __device__ constexpr int operand_index(int n, int k, int K) {
  const int q = k % 8, slot = 8 * (k / 8) + (q % 2 == 0 ? q / 2 : 4 + q / 2);
  return (n / 8) * (K / 4) * 32 + (slot / 4) * 32 + (n % 8) * 4 + slot % 4;
}

// Stores v as B(n, k) of an operand's TF32 high and low parts (see split()).
__device__ __forceinline__ void store_operand(float* hi, float* lo, int n, int k, int K, float v) {
  uint32_t h, l;
  split<true>(v, h, l);
  hi[operand_index(n, k, K)] = __uint_as_float(h);
  lo[operand_index(n, k, K)] = __uint_as_float(l);
}

// The descriptor of K chunk `chunk` (two core matrices) of an operand with K columns: start
// address, K-direction step (128 bytes) and row-group step (K / 4 * 128 bytes), each / 16.
__device__ __forceinline__ uint64_t descriptor(const float* operand, int chunk, int K) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(operand + chunk * 64));
  return (address >> 4 & 0x3fffu) | uint64_t{128 >> 4} << 16 | uint64_t((K / 4 * 128) >> 4 & 0x3fffu) << 32;
}

// The warpgroup MMA instructions exist on sm_90a alone; this file's code for other GPUs traps
// there (use_sm90() never launches it on them).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
#define MIRAGE_WGMMA(...) asm volatile(__VA_ARGS__)
#else
#define MIRAGE_WGMMA(...) __trap()
#endif

// d += a b for m64n128k8: a in registers (warp w of the warpgroup holds rows 16 w .. 16 w + 15 in
// the m16n8k8 fragment layout), b by descriptor. Asynchronous: see product_chunk.
__device__ __forceinline__ void wgmma(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  MIRAGE_WGMMA(
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, 1, 1, 1;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
// The same for m64n24k8 (the backward's product onto the basis: R + 1 <= 24 columns).
__device__ __forceinline__ void wgmma(float (&d)[12], const uint32_t (&a)[4], uint64_t b) {
  MIRAGE_WGMMA(
      "wgmma.mma_async.sync.aligned.m64n24k8.f32.tf32.tf32 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, %16, 1, 1, 1;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
// Waits until at most kPending committed chunks are still running; then their accumulators may be
// read (after hold()) and the A registers of the others reused. A compiler barrier for memory
// too: loads stay where the code puts them.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  MIRAGE_WGMMA("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Orders the reads of an accumulator after the wait (the asm statements are volatile, these are too).
template <int kAcc>
__device__ __forceinline__ void hold(float (&d)[kAcc]) {
#pragma unroll
  for (int i = 0; i < kAcc; ++i) asm volatile("" : "+f"(d[i]));
}

// d += a B[:, chunk] in float32 accuracy (three TF32 products, the small terms first) or in TF32,
// committed as one group. a holds rows g and g + 8 (g = lane / 4) of the warp's 16, slots t and
// t + 4 of the chunk: {(g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)}.
template <bool kSplit, int kAcc>
__device__ __forceinline__ void product_chunk(float (&d)[kAcc], const float (&a)[4], const float* b_hi,
                                              const float* b_lo, int chunk, int K) {
  uint32_t hi[4], lo[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) split<kSplit>(a[i], hi[i], lo[i]);
  MIRAGE_WGMMA("wgmma.fence.sync.aligned;");  // the registers above are written before the MMAs read them
  if constexpr (kSplit) {
    wgmma(d, lo, descriptor(b_hi, chunk, K));
    wgmma(d, hi, descriptor(b_lo, chunk, K));
  }
  wgmma(d, hi, descriptor(b_hi, chunk, K));
  MIRAGE_WGMMA("wgmma.commit_group.sync.aligned;");
}

// Accumulator chunk c (n8 tile c: (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)) as the A
// fragment of K chunk c of the next product, f applied.
template <typename F>
__device__ __forceinline__ void as_fragment(const float (&d)[64], int c, F&& f, float (&a)[4]) {
  a[0] = f(d[4 * c]);
  a[1] = f(d[4 * c + 2]);
  a[2] = f(d[4 * c + 1]);
  a[3] = f(d[4 * c + 3]);
}

// The thread's place in its warpgroup's tile: rows `row` and row + 8, accumulator columns 8 j +
// `col` and + 1.
struct Place {
  int row, col;
  __device__ Place() {
    const int lane = threadIdx.x % 32;
    row = team_thread<kTeamThreads>() / 32 * 16 + lane / 4;
    col = 2 * (lane % 4);
  }
};

// The basis rows of the thread's two tile rows as A fragments of z = [basis, 1] [W1, b1]^T, loaded
// ahead into registers: column R is the bias' one, those past it and rows past the pairs zero.
struct BasisFragments {
  float v[kBasisChunks][4];
  // Rows at walk positions base + at.row and + 8 (pair_at), zero from `walked` on.
  __device__ void fetch(const float* basis, int num_rbf, int64_t walked, int64_t base, const Place& at,
                        const int* order = nullptr) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t k = base + at.row + 8 * half;
      const int64_t row = k < walked ? pair_at(order, k) : -1;
#pragma unroll
      for (int c = 0; c < kBasisChunks; ++c)
#pragma unroll
        for (int i = half; i < 4; i += 2) {
          const int r = 8 * c + at.col + i / 2;  // slots t and t + 4 hold columns 2t and 2t + 1
          v[c][i] = row < 0 || r > num_rbf ? 0.0f : r == num_rbf ? 1.0f : basis[row * num_rbf + r];
        }
    }
  }
};

// The B operands in shared memory, split into their TF32 parts: the forward's W2 as B[out][hidden]
// and [W1, b1] as B[hidden][basis] (K = kBasisK, the basis padded with zeros), or with
// `transposed` the backward's W2 as B[hidden][out] and [W1, b1] as B[basis][hidden] (K = kWidth).
__device__ void load_operands(const CfconvWeights& w, float* w2_hi, float* w2_lo, float* w1_hi, float* w1_lo,
                              bool transposed) {
  for (int e = threadIdx.x; e < kWidth * kWidth; e += kThreads) {
    const int m = e / kWidth, h = e % kWidth;
    if (transposed) {
      store_operand(w2_hi, w2_lo, h, m, kWidth, w.w2[e]);
    } else {
      store_operand(w2_hi, w2_lo, m, h, kWidth, w.w2[e]);
    }
  }
  for (int e = threadIdx.x; e < kWidth * kBasisK; e += kThreads) {
    const int h = e / kBasisK, r = e % kBasisK;
    const float v = r < w.num_rbf ? w.w1[h * w.num_rbf + r] : r == w.num_rbf && w.b1 != nullptr ? w.b1[h] : 0.0f;
    if (transposed) {
      store_operand(w1_hi, w1_lo, r, h, kWidth, v);
    } else {
      store_operand(w1_hi, w1_lo, h, r, kBasisK, v);
    }
  }
}

// Shared memory (floats): W2's and [W1, b1]'s operands (high, low parts; load_operands), b2, then
// each team's tile (the forward's filters, the backward's filter gradients) and pairs.
struct SharedLayout {
  static constexpr int kW2 = 0, kW1 = 2 * kWidth * kWidth, kB2 = kW1 + 2 * kWidth * kBasisK;
  // Per team: the tile, the pair indices (int64, the backward's), envelopes, receivers, senders.
  static constexpr int kTeamBase = kB2 + kWidth, kPerTeam = kTile * kTileLd + 5 * kTile;
  static constexpr int kTotal = kTeamBase + kTeams * kPerTeam;
  static_assert(kTotal * 4 <= 227 * 1024, "within the shared memory of a block on every compute capability 9.0 GPU");
  static_assert(kTeamBase % 2 == 0 && kPerTeam % 2 == 0 && kTile * kTileLd % 2 == 0, "ids 8-byte aligned");
  int tile, ids, envelope, receivers, senders;
  __device__ explicit SharedLayout(int team) {
    tile = kTeamBase + team * kPerTeam;
    ids = tile + kTile * kTileLd;
    envelope = ids + 2 * kTile;
    receivers = envelope + kTile;
    senders = receivers + kTile;
  }
};

// The block's network into shared memory: the operands (load_operands), b2.
__device__ void load_network(const CfconvWeights& w, float* smem, bool transposed) {
  using L = SharedLayout;
  load_operands(w, smem + L::kW2, smem + L::kW2 + kWidth * kWidth, smem + L::kW1, smem + L::kW1 + kWidth * kBasisK,
                transposed);
  // The shifted softplus' - log 2 is in the activation, as in the kernels above.
  for (int e = threadIdx.x; e < kWidth; e += kThreads) smem[L::kB2 + e] = w.b2 != nullptr ? w.b2[e] : 0.0f;
  // The warpgroup MMAs read the operands through the async proxy: the generic stores above must
  // be made visible to it before the barrier that releases them.
  MIRAGE_WGMMA("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
}

// d += f(a) W2^T (K = kWidth), a the accumulator of the previous product taken chunk by chunk.
template <bool kSplit, typename F>
__device__ __forceinline__ void second_product(float (&d)[64], const float (&a)[64], const float* smem, F&& f) {
  using L = SharedLayout;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    float fragment[4];
    as_fragment(a, c, f, fragment);
    product_chunk<kSplit>(d, fragment, smem + L::kW2, smem + L::kW2 + kWidth * kWidth, c, kWidth);
    wgmma_wait<1>();  // chunk c - 1 is done: its A registers are free
  }
  wgmma_wait<0>();
  hold(d);
}

// Rows row and row + 8 of an accumulator (columns 8 j + col, + 1) to a row-major [*, kWidth]
// array of ld floats a row; rows from `limit` on are skipped.
__device__ __forceinline__ void store_rows(const float (&d)[64], float* out, int64_t ld, const Place& at,
                                           int64_t row, int64_t limit) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (row + 8 * half >= limit) continue;
    float* out_row = out + (row + 8 * half) * ld + at.col;
#pragma unroll
    for (int j = 0; j < kChunks; ++j)
      *reinterpret_cast<float2*>(out_row + 8 * j) = make_float2(d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
  }
}

// The filters before any envelope, W2 act(z) + b2 (z taken chunk by chunk), to the team's tile.
template <bool kSplit, bool kSsp>
__device__ __forceinline__ void filters_to_tile(const float (&z)[64], const float* smem, float* tile,
                                                const Place& at, Activation activation) {
  float f[64];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const float2 b = *reinterpret_cast<const float2*>(smem + SharedLayout::kB2 + 8 * j + at.col);
    f[4 * j] = f[4 * j + 2] = b.x;
    f[4 * j + 1] = f[4 * j + 3] = b.y;
  }
  second_product<kSplit>(f, z, smem, [&](float v) { return filter_activation<kSsp>(v, activation); });
  store_rows(f, tile, kTileLd, at, at.row, kTile);
}

// What the Hopper kernels set up: the network in shared memory (load_network; the backward's
// transposed), and the team's walk over the tiles (first, first + stride, ...) with its shared
// arrays.
struct TeamTiles {
  SharedLayout l;
  int64_t walked, tiles, stride, first;  // walked: the positions walked (pairs_to_walk)
  int* receivers;
  int* senders;
  __device__ TeamTiles(const CfconvWeights& w, int64_t walked, float* smem, bool transposed = false)
      : l(team<kTeamThreads>()),
        walked(walked),
        tiles(ceil_div(walked, kTile)),
        stride(static_cast<int64_t>(gridDim.x) * kTeams),
        first(static_cast<int64_t>(blockIdx.x) * kTeams + team<kTeamThreads>()),
        receivers(reinterpret_cast<int*>(smem + l.receivers)),
        senders(reinterpret_cast<int*>(smem + l.senders)) {
    load_network(w, smem, transposed);
  }
};

template <bool kSplit, bool kSsp>
__global__ void __launch_bounds__(kThreads, 1) cfconv_kernel(CfconvParams p) {
  start_after_prior_grid();
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const TeamTiles walk(p.weights, pairs_to_walk(p.live_pairs, p.num_pairs), smem);
  const auto& [l, walked, tiles, stride, first, receivers, senders] = walk;
  const float *w1_hi = smem + SharedLayout::kW1, *w1_lo = w1_hi + kWidth * kBasisK;
  const Place at;
  PairFetch pair;
  BasisFragments basis;
  if (first < tiles) {
    pair.fetch(p, walked, first * kTile, team_thread<kTeamThreads>());
    basis.fetch(p.basis, p.weights.num_rbf, walked, first * kTile, at);
  }
  zero_padding(p.filters, walked, p.num_pairs, kWidth);
  for (int64_t tile = first; tile < tiles; tile += stride) {
    const int64_t base = tile * kTile, next = base + stride * kTile;
    const int rows = static_cast<int>(std::min<int64_t>(kTile, walked - base));
    team_sync<kTeamThreads>();  // the previous tile's scatter is done with the shared arrays
    pair.stash(p, team_thread<kTeamThreads>(), receivers, senders, smem + l.envelope);
    float z[64] = {};
#pragma unroll
    for (int c = 0; c < kBasisChunks; ++c) product_chunk<kSplit>(z, basis.v[c], w1_hi, w1_lo, c, kBasisK);
    wgmma_wait<0>();
    hold(z);
    if (tile + stride < tiles) {  // in flight during the second product and the scatter
      pair.fetch(p, walked, next, team_thread<kTeamThreads>());
      basis.fetch(p.basis, p.weights.num_rbf, walked, next, at);
    }
    float* filters = smem + l.tile;
    filters_to_tile<kSplit, kSsp>(z, smem, filters, at, p.weights.activation);
    team_sync<kTeamThreads>();
    scatter_messages<kWidth, kTeamThreads / 32>(p, filters, smem + l.envelope, receivers, senders, base, rows);
  }
}

// cfconv's backward on Hopper (the forward's sizes). Each warpgroup takes 64 positions of the walk
// at a time (`order`, as the portable backward) through the pass over their pairs
// (backward_pair_pass: grad_x, the envelope's gradient, the filters' gradient G to the tile), then
// through three products:
//   A = G W2 (wgmma; G's fragments from the tile)
//   z = [basis, 1] [W1, b1]^T (mma.sync, HiddenTiles), A *= act'(z)
//   grad_basis = A [W1, b1] (wgmma; A from its registers as they are, as the forward's second
//   product takes z)
// Shared memory holds the transposes of the forward's operands (load_operands) and, as the
// forward, each team's tile: with [W1, b1] in the forward's layout as well it would not fit.

// K chunk c of the tile's rows at.row and at.row + 8 as an A fragment (slots t and t + 4: columns
// 2t and 2t + 1, the operands' K order).
__device__ __forceinline__ void tile_fragment(const float* tile, const Place& at, int c, float (&a)[4]) {
  const float2 u = *reinterpret_cast<const float2*>(tile + at.row * kTileLd + 8 * c + at.col);
  const float2 v = *reinterpret_cast<const float2*>(tile + (at.row + 8) * kTileLd + 8 * c + at.col);
  a[0] = u.x;
  a[1] = v.x;
  a[2] = u.y;
  a[3] = v.y;
}

// z = [basis, 1] [W1, b1]^T, n8 tile by n8 tile of the warp's 16 rows, in the accumulator layout
// of the warpgroup's products (that of mma.sync's m16n8 tiles), on mma.sync: its B fragments are
// read from the backward's transposed [W1, b1] (already split: hi, lo), which wgmma could not
// take as z's B. The basis fragments are split once.
template <bool kSplit>
struct HiddenTiles {
  uint32_t a_hi[kBasisChunks][4], a_lo[kBasisChunks][4];
  __device__ explicit HiddenTiles(const BasisFragments& basis) {
#pragma unroll
    for (int c = 0; c < kBasisChunks; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) split<kSplit>(basis.v[c][i], a_hi[c][i], a_lo[c][i]);
  }
  // z's columns 8 j .. 8 j + 7 for j = j0 and j0 + 1, each tile's elements (g, 2t), (g, 2t + 1),
  // (g + 8, 2t), (g + 8, 2t + 1). Two tiles and the small terms apart: four independent chains of
  // MMAs (two without kSplit; one chain waits out each MMA's latency).
  __device__ void tiles(const float* hi, const float* lo, const Place& at, int j0, float (&z)[2][4]) const {
    const int g = threadIdx.x % 32 / 4;
    float small[2][4] = {};
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) z[j][e] = 0.0f;
#pragma unroll
    for (int c = 0; c < kBasisChunks; ++c)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // B(slot t, n g), B(slot t + 4, n g): [W1, b1][8 (j0 + j) + g][8 c + 2t] and [..][8 c + 2t + 1].
        const int i0 = operand_index(8 * c + at.col, 8 * (j0 + j) + g, kWidth);
        const int i1 = operand_index(8 * c + at.col + 1, 8 * (j0 + j) + g, kWidth);
        const uint32_t b_hi[2] = {__float_as_uint(hi[i0]), __float_as_uint(hi[i1])};
        if constexpr (kSplit) {
          const uint32_t b_lo[2] = {__float_as_uint(lo[i0]), __float_as_uint(lo[i1])};
          mma_tf32(small[j], a_lo[c], b_hi);
          mma_tf32(small[j], a_hi[c], b_lo);
        }
        mma_tf32(z[j], a_hi[c], b_hi);
      }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) z[j][e] += small[j][e];
  }
};

template <bool kSplit, bool kSsp>
__global__ void __launch_bounds__(kThreads, 1) cfconv_backward_kernel(CfconvBackwardParams p, const int* order) {
  start_after_prior_grid();
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const TeamTiles walk(p.weights, pairs_to_walk(p.live_pairs, p.num_pairs), smem, /*transposed=*/true);
  const auto& [l, walked, tiles, stride, first, receivers, senders] = walk;
  const float *w2_hi = smem + SharedLayout::kW2, *w2_lo = w2_hi + kWidth * kWidth;
  const float *w1_hi = smem + SharedLayout::kW1, *w1_lo = w1_hi + kWidth * kBasisK;
  const int R = p.weights.num_rbf;
  const Place at;
  PairFetch pair;
  BasisFragments basis;
  if (first < tiles) {
    pair.fetch(p, walked, first * kTile, team_thread<kTeamThreads>(), order);
    basis.fetch(p.basis, R, walked, first * kTile, at, order);
  }
  zero_padding(p.grad_basis, walked, p.num_pairs, R);
  zero_padding(p.grad_envelope, walked, p.num_pairs, 1);
  for (int64_t tile = first; tile < tiles; tile += stride) {
    const int64_t base = tile * kTile, next = base + stride * kTile;
    const int rows = static_cast<int>(std::min<int64_t>(kTile, walked - base));
    float* grads = smem + l.tile;
    int64_t* ids = reinterpret_cast<int64_t*>(smem + l.ids);
    team_sync<kTeamThreads>();  // the previous tile's products are done with the shared arrays
    pair.stash(p, team_thread<kTeamThreads>(), receivers, senders, smem + l.envelope, ids);
    team_sync<kTeamThreads>();
    // Four rows at a time: with 8 warps a multiprocessor the pass waits on its loads (2: 261
    // against 253 µs before HiddenTiles; 8: no faster, H200).
    backward_pair_pass<kWidth, kTeamThreads / 32, kTileLd, 4>(
        p, [&](int row) { return ids[row]; }, grads, smem + l.envelope, receivers, senders, rows);
    const BasisFragments basis_now = basis;  // basis takes the next tile's rows below
    if (tile + stride < tiles) {  // in flight during the products
      pair.fetch(p, walked, next, team_thread<kTeamThreads>(), order);
      basis.fetch(p.basis, R, walked, next, at, order);
    }
    team_sync<kTeamThreads>();  // the tile is complete
    float a[64] = {};
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      float fragment[4];
      tile_fragment(grads, at, c, fragment);
      product_chunk<kSplit>(a, fragment, w2_hi, w2_lo, c, kWidth);
      wgmma_wait<1>();  // chunk c - 1 is done: its A registers are free
    }
    wgmma_wait<0>();
    hold(a);
    // The next tile's, now that its index has arrived (on the team's last tile the current one's
    // again: harmless).
    pair.prefetch_row<kWidth>(p.filters);
    // Chunk c of A * act'(z) (z's tiles formed here two at a time, while the previous chunks'
    // products run) is the A fragment of grad_basis' chunk c.
    const HiddenTiles<kSplit> hidden(basis_now);
    float grad_basis[12] = {};
#pragma unroll
    for (int c0 = 0; c0 < kChunks; c0 += 2) {
      float z[2][4];
      hidden.tiles(w1_hi, w1_lo, at, c0, z);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = c0 + j;
#pragma unroll
        for (int e = 0; e < 4; ++e) a[4 * c + e] *= filter_activation_grad<kSsp>(z[j][e], p.weights.activation);
        float fragment[4];
        as_fragment(a, c, [](float v) { return v; }, fragment);
        product_chunk<kSplit>(grad_basis, fragment, w1_hi, w1_lo, c, kWidth);
        wgmma_wait<1>();
      }
    }
    wgmma_wait<0>();
    hold(grad_basis);
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // element 4 j + 2 half + e: column 8 j + at.col + e
      const int row = at.row + 8 * half;
      if (row >= rows) continue;
      float* out = p.grad_basis + ids[row] * R;
#pragma unroll
      for (int j = 0; j < kBasisChunks; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (8 * j + at.col + e < R) out[8 * j + at.col + e] = grad_basis[4 * j + 2 * half + e];
    }
  }
}

}  // namespace sm90
#undef MIRAGE_WGMMA

template <int D>
size_t shared_bytes(int num_rbf) {
  return Layout<D>(num_rbf, 0).bytes();
}

// Launches a kernel of `teams` teams (threads in all) with its shared memory on one block per SM,
// or fewer where there are fewer tiles than teams.
template <typename Params, typename... Args>
cudaError_t launch(void (*kernel)(Params, Args...), const Params& params, size_t bytes, int threads, int teams,
                   cudaStream_t stream, Args... args) {
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(bytes));
  if (status != cudaSuccess) return status;
  const int64_t tiles = ceil_div(params.num_pairs, kTile);
  const int64_t blocks = std::min<int64_t>(ceil_div(tiles, teams), sm_count());
  return launch_overlapped(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), bytes, stream, false, params,
                           args...);
}

// Whether this library was built for sm_90a and the current device has compute capability 9.0:
// the Hopper kernels' condition.
bool hopper() {
  static const bool built = std::string_view(MIRAGE_CUDA_ARCHS).find("90a") != std::string_view::npos;
  if (!built) return false;
  int device = 0, major = 0, minor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return major == 9 && minor == 0;
}

// Whether the Hopper kernels take a network of these sizes: H == M == 128, R <= 23.
bool hopper_sizes(int64_t num_rbf, int64_t hidden, int64_t width) {
  return hidden == sm90::kWidth && width == sm90::kWidth && num_rbf >= 1 && num_rbf + 1 <= sm90::kBasisK;
}

// Whether cfconv's Hopper kernels (forward and backward) take these weights.
// MIRAGE_CFCONV_PORTABLE=1 in the environment keeps the portable ones (the tests run both on one
// GPU).
bool use_sm90(const CfconvWeights& w) {
  if (!hopper_sizes(w.num_rbf, w.width, w.width)) return false;
  const char* portable = std::getenv("MIRAGE_CFCONV_PORTABLE");
  if (portable != nullptr && std::string_view(portable) == "1") return false;
  return hopper();
}

// f(width, split, ssp) with the weights' runtime choices as compile-time constants.
template <typename F>
cudaError_t dispatch(const CfconvWeights& w, F&& f) {
  using Yes = std::true_type;
  using No = std::false_type;
  const auto by_activation = [&](auto width, auto split) {
    return w.activation == Activation::kShiftedSoftplus ? f(width, split, Yes{}) : f(width, split, No{});
  };
  const auto by_precision = [&](auto width) {
    return w.tf32 ? by_activation(width, No{}) : by_activation(width, Yes{});
  };
  return w.width == 64 ? by_precision(std::integral_constant<int, 64>{})
                       : by_precision(std::integral_constant<int, 128>{});
}

// The launchers' first step: the invalid flag and the float32 accumulator the kernels add onto, zeroed.
cudaError_t zero_flag_and_accumulator(int* invalid, float* accumulator, int64_t floats, cudaStream_t stream) {
  const cudaError_t status = cudaMemsetAsync(invalid, 0, sizeof(int), stream);
  if (status != cudaSuccess) return status;
  return cudaMemsetAsync(accumulator, 0, floats * sizeof(float), stream);
}

// Zeroes the invalid flag and the [N, D] float32 accumulator, runs the kernel (launch_kernel(width,
// split, ssp); none without pairs), then converts the outputs or, after a bad index or a handed-in
// sender order that failed `check`, poisons them.
template <typename Params, typename LaunchKernel>
cudaError_t launch_passes(const Params& params, float* accumulator, const Segments& outputs, cudaStream_t stream,
                          LaunchKernel&& launch_kernel, const OrderCheck& check = {}) {
  cudaError_t status =
      zero_flag_and_accumulator(params.invalid, accumulator, params.num_nodes * params.weights.width, stream);
  if (status != cudaSuccess || params.num_pairs == 0) return status;
  status = dispatch(params.weights, launch_kernel);
  if (status != cudaSuccess) return status;
  return launch_finish<float>(outputs, params.invalid, stream, check);
}

// ------------------------------------------------------------------------------------------------
// radial_cfconv (filter_table.h): the table of the filter network, then one pass over the pairs
// each way, reading every pair's filters (and their slopes) from the table's piece for its
// distance: a quintic in s per column, no products.

// The table, float64 throughout: a block takes kTablePieces pieces, forms the network at their
// kTablePieces + 1 ends (one end shared with the next block's, formed twice) and writes the
// pieces' coefficients. The basis' jets and the hidden layer's (act(z), its first and second
// derivatives in d) go through shared memory; then, kTableColumns outputs at a time, thread
// (group g, column m) sums output m at ends g, g + kTableGroups, ... over the hidden features,
// kTableChunk at a time from a tile of W2 staged in shared memory, and the pieces' coefficients
// come from the ends' jets, also in shared memory. Four warps a scheduler: with one (128 threads,
// a thread per output at every end) the kernel waited on its own latencies, ~7 cycles an
// instruction (Nsight Compute, H200, SchNet's network: 70 µs a call; 32 µs with one W2 tile). The
// tile is double-buffered, the next chunk's loads in flight during a chunk's products, one barrier
// a chunk: with one tile, a fifth of the stall samples waited on its staging behind each chunk's
// global loads and 15% on the two barriers around it (Nsight Compute, 2026-11-28); with two, 30
// µs. 4 pieces a block were slower.
constexpr int kTableColumns = 128;
constexpr int kTableGroups = 4;
constexpr int kTableThreads = kTableColumns * kTableGroups;
constexpr int kTablePieces = 8;
constexpr int kTableEnds = kTablePieces + 1;
constexpr int kTableEndsPerGroup = (kTableEnds + kTableGroups - 1) / kTableGroups;
constexpr int kTableChunk = 16;
constexpr int kTableTileLd = kTableChunk + 1;  // a thread's row of the tile: its own bank each step
constexpr int kTableTileFloats = kTableColumns * kTableTileLd;
constexpr int kTableStaged = kTableColumns * kTableChunk / kTableThreads;  // a thread's share of a tile

// Shared memory, in doubles: the basis' jets [end][r][3], the hidden jets' values and first
// derivatives [end][h] (pairs: one 16-byte load) and second derivatives [end][h], the outputs'
// jets [end][column][3], then the W2 tiles [2][column][k] of floats.
struct TableLayout {
  int64_t basis, values, curvatures, outputs, tile, bytes;
  __host__ __device__ TableLayout(int64_t num_rbf, int64_t hidden)
      : basis(0),
        values((kTableEnds * 3 * num_rbf + 1) / 2 * 2),  // 16-byte aligned: read as double2
        curvatures(values + kTableEnds * 2 * hidden),
        outputs(curvatures + kTableEnds * hidden),
        tile(outputs + kTableEnds * kTableColumns * 3),
        bytes(tile * static_cast<int64_t>(sizeof(double)) + 2 * kTableTileFloats * sizeof(float)) {}
};

size_t filter_table_shared_bytes(int64_t num_rbf, int64_t hidden) {
  return static_cast<size_t>(TableLayout(num_rbf, hidden).bytes);
}

__global__ void __launch_bounds__(kTableThreads) filter_table_kernel(FilterTableParams p) {
  start_after_prior_grid();
  using namespace filter_table;
  using namespace jets;
  extern __shared__ double table_shared[];
  const int R = p.num_rbf, H = p.hidden, M = p.width;
  const TableLayout l(R, H);
  double* basis = table_shared + l.basis;
  double2* values = reinterpret_cast<double2*>(table_shared + l.values);
  double* curvatures = table_shared + l.curvatures;
  double* outputs = table_shared + l.outputs;
  float* tiles = reinterpret_cast<float*>(table_shared + l.tile);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kTablePieces;
  const int ends = static_cast<int>(std::min<int64_t>(kTableEnds, p.intervals - first + 1));
  const double cutoff = p.cutoff, width = cutoff / static_cast<double>(p.intervals);
  for (int e = threadIdx.x; e < ends * R; e += kTableThreads) {
    const Jet b = basis_jet(p.basis, e % R, R, static_cast<double>(first + e / R) * width, cutoff);
    basis[3 * e] = b.v;
    basis[3 * e + 1] = b.d1;
    basis[3 * e + 2] = b.d2;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < ends * H; e += kTableThreads) {
    const int end = e / H, k = e % H;
    double z = p.b1 != nullptr ? p.b1[k] : 0.0, t = 0.0, u = 0.0;  // W1 b + b1 and its derivatives in d
    for (int r = 0; r < R; ++r) {
      const double w = p.w1[static_cast<int64_t>(k) * R + r], *b = basis + 3 * (end * R + r);
      z += w * b[0];
      t += w * b[1];
      u += w * b[2];
    }
    const Jet a = activation_jet(p.activation, z);
    values[e] = make_double2(a.v, a.d1 * t);
    curvatures[e] = a.d2 * t * t + a.d1 * u;
  }
  const int column = threadIdx.x % kTableColumns, group = threadIdx.x / kTableColumns;
  for (int m0 = 0; m0 < M; m0 += kTableColumns) {
    const int m = m0 + column;
    Jet f[kTableEndsPerGroup];  // W2 (the hidden jets) + b2 at ends group, group + kTableGroups, ...
#pragma unroll
    for (int i = 0; i < kTableEndsPerGroup; ++i) f[i] = {m < M && p.b2 != nullptr ? p.b2[m] : 0.0, 0.0, 0.0};
    // This thread's share of W2's chunk of hidden features k0 (columns m0 ..), into registers: a
    // chunk ahead, in flight during the products of the chunk before, then stored into its tile.
    const auto load_chunk = [&](int k0, float (&staged)[kTableStaged]) {
#pragma unroll
      for (int i = 0; i < kTableStaged; ++i) {
        const int e = threadIdx.x + i * kTableThreads, row = e / kTableChunk, k = k0 + e % kTableChunk;
        staged[i] = m0 + row < M && k < H ? p.w2[static_cast<int64_t>(m0 + row) * H + k] : 0.0f;
      }
    };
    float staged[kTableStaged];
    load_chunk(0, staged);
    for (int k0 = 0; k0 < H; k0 += kTableChunk) {
      float* tile = tiles + (k0 / kTableChunk % 2) * kTableTileFloats;
#pragma unroll
      for (int i = 0; i < kTableStaged; ++i) {
        const int e = threadIdx.x + i * kTableThreads;
        tile[e / kTableChunk * kTableTileLd + e % kTableChunk] = staged[i];
      }
      // The tile and (first chunk) the hidden jets are written; this tile was last read two chunks
      // ago, and the last pass's output jets are read.
      __syncthreads();
      if (k0 + kTableChunk < H) load_chunk(k0 + kTableChunk, staged);  // in flight during the products
      const int chunk = H - k0 < kTableChunk ? H - k0 : kTableChunk;
      for (int c = 0; c < chunk; ++c) {
        const double w = tile[column * kTableTileLd + c];
#pragma unroll
        for (int i = 0; i < kTableEndsPerGroup; ++i) {
          const int end = group + i * kTableGroups;
          if (end >= ends) break;
          const double2 a = values[end * H + k0 + c];
          f[i].v += w * a.x;
          f[i].d1 += w * a.y;
          f[i].d2 += w * curvatures[end * H + k0 + c];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kTableEndsPerGroup; ++i) {
      const int end = group + i * kTableGroups;
      if (end >= ends) break;
      const Jet g = times(f[i], envelope_jet(p.envelope, static_cast<double>(first + end) * width, cutoff));
      double* out = outputs + 3 * (end * kTableColumns + column);
      out[0] = g.v;
      out[1] = g.d1;
      out[2] = g.d2;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < (ends - 1) * kTableColumns; e += kTableThreads) {
      const int piece = e / kTableColumns, col = e % kTableColumns;
      if (m0 + col >= M) continue;
      const double* left = outputs + 3 * (piece * kTableColumns + col);
      const double* right = left + 3 * kTableColumns;
      double c[kCoefficients];
      quintic({left[0], left[1], left[2]}, {right[0], right[1], right[2]}, width, c);
      for (int q = 0; q < kCoefficients; ++q)
        p.table[((first + piece) * kCoefficients + q) * M + m0 + col] = static_cast<float>(c[q]);
    }
  }
}

// The passes: a warp takes kPassSpan consecutive positions of the walk (list order forward, the
// messages onto the receivers; sender order backward for long lists, onto the senders), lane k <
// kPassSpan holding the k-th pair's rows, piece and place in it; the pairs go kPassBatch at a time
// with their loads in flight together, lane l the columns 4 l, 4 l + 128, ... Each pair's run
// sum (RunSum) and, backward, its distance gradient stay in registers until the columns are done.
constexpr int kPassThreads = 256;
constexpr int kPassSpan = 16;
constexpr int kPassBatch = 2;

template <bool kBackward>
__global__ void __launch_bounds__(kPassThreads) radial_cfconv_kernel(RadialCfconvParams p, const int* order) {
  start_after_prior_grid();
  using filter_table::kCoefficients;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kPassThreads / 32);
  const int64_t M = p.width;
  const float scale = static_cast<float>(p.intervals) / p.cutoff;
  for (int64_t first = (static_cast<int64_t>(blockIdx.x) * kPassThreads + threadIdx.x) / 32 * kPassSpan;
       first < p.num_pairs; first += warps * kPassSpan) {
    // from: the row gathered (forward the sender's x, backward the receiver's grad), -1 where the
    // pair adds nothing (none, at or past the cutoff, an index out of range); to: the row summed onto.
    int64_t pair = -1, from = -1, to = -1, piece = 0;
    float s = 0.0f;
    if (lane < kPassSpan && first + lane < p.num_pairs) {
      pair = pair_at(order, first + lane);
      const int64_t i = p.pairs[pair], j = p.pairs[p.num_pairs + pair];
      const float d = p.distances[pair];
      if (i < 0 || i >= p.num_nodes || j < 0 || j >= p.num_nodes) {
        *p.invalid = 1;  // every writer stores the same value
      } else if (!(d >= p.cutoff)) {
        // A negative or NaN distance takes piece 0 at s = NaN: NaN filters, as the network's.
        const float u = d * scale;
        piece = d >= 0.0f ? std::min<int64_t>(static_cast<int64_t>(u), p.intervals - 1) : 0;
        s = d >= 0.0f ? u - static_cast<float>(piece) : __int_as_float(0x7fc00000);
        from = kBackward ? i : j;
        to = kBackward ? j : i;
      }
    }
    float dot[kPassSpan] = {};  // backward: each pair's distance gradient, this lane's columns
    for (int64_t c0 = 0; c0 < M; c0 += 128) {  // uniform over the warp: the shuffles need every lane
      const int64_t c = c0 + 4 * lane;
      RunSum sums(p.out + c, M);
#pragma unroll
      for (int k0 = 0; k0 < kPassSpan; k0 += kPassBatch) {
        float row[kPassBatch][4], x[kPassBatch][4], coefficient[kPassBatch][kCoefficients][4], at[kPassBatch];
        int64_t onto[kPassBatch];
        bool mine[kPassBatch];
#pragma unroll
        for (int k = 0; k < kPassBatch; ++k) {
          const int64_t fk = __shfl_sync(0xffffffffu, from, k0 + k), pk = __shfl_sync(0xffffffffu, piece, k0 + k);
          onto[k] = __shfl_sync(0xffffffffu, to, k0 + k);
          at[k] = __shfl_sync(0xffffffffu, s, k0 + k);
          mine[k] = fk >= 0 && c < M;
          if (!mine[k]) continue;
          load_packed<float, 4>(p.rows + fk * M + c, row[k]);
          if constexpr (kBackward) load_packed<float, 4>(p.x + onto[k] * M + c, x[k]);
#pragma unroll
          for (int q = 0; q < kCoefficients; ++q)
            load_packed<float, 4>(p.table + (pk * kCoefficients + q) * M + c, coefficient[k][q]);
        }
#pragma unroll
        for (int k = 0; k < kPassBatch; ++k) {
          if (!mine[k]) continue;
          const float t = at[k];
          const auto& a = coefficient[k];
          float f[4];
#pragma unroll
          for (int e = 0; e < 4; ++e)
            f[e] = fmaf(fmaf(fmaf(fmaf(fmaf(a[5][e], t, a[4][e]), t, a[3][e]), t, a[2][e]), t, a[1][e]), t, a[0][e]);
          sums.fma(onto[k], row[k], f);
          if constexpr (kBackward) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float slope =
                  fmaf(fmaf(fmaf(fmaf(5.0f * a[5][e], t, 4.0f * a[4][e]), t, 3.0f * a[3][e]), t, 2.0f * a[2][e]), t,
                       a[1][e]);
              dot[k0 + k] = fmaf(row[k][e] * x[k][e], slope, dot[k0 + k]);
            }
          }
        }
      }
      sums.flush();
    }
    if constexpr (kBackward) {
      float mine = 0.0f;  // lane k: pair k's distance gradient
#pragma unroll
      for (int k = 0; k < kPassSpan; ++k) {
        const float sum = warp_sum(dot[k]);
        if (lane == k) mine = sum * scale;  // d/dd = d/ds * intervals / cutoff
      }
      if (pair >= 0) p.grad_distances[pair] = mine;
    }
  }
}

// Zeroes the invalid flag and the [N, M] accumulator, then runs the pass (none without pairs) and
// converts the outputs or, after a bad index or a handed-in sender order that failed `check`,
// poisons them.
template <bool kBackward>
cudaError_t launch_radial_pass(const RadialCfconvParams& params, const SenderOrder& walk, const Segments& outputs,
                               cudaStream_t stream) {
  const int64_t warps = ceil_div(params.num_pairs, kPassSpan);
  const int64_t blocks = std::min<int64_t>(ceil_div(warps, kPassThreads / 32), 16LL * sm_count());
  const cudaError_t status = launch_overlapped(radial_cfconv_kernel<kBackward>, dim3(static_cast<unsigned>(blocks)),
                                               dim3(kPassThreads), 0, stream, false, params, walk.order);
  if (status != cudaSuccess) return status;
  return launch_finish<float>(outputs, params.invalid, stream, walk.check);
}
}  // namespace

bool cfconv_supported(int64_t num_rbf, int64_t hidden, int64_t width) {
  if (hidden != width || (width != 64 && width != 128) || num_rbf < 1 || num_rbf > kMaxRbf) return false;
  int device = 0, major = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  const int rbf = static_cast<int>(num_rbf);  // checked <= kMaxRbf above
  const size_t needed = width == 64 ? shared_bytes<64>(rbf) : shared_bytes<128>(rbf);
  return major >= 8 && needed <= max_shared_bytes_per_block();
}

cudaError_t launch_cfconv(const CfconvParams& params, cudaStream_t stream) {
  // An index out of range anywhere turns every output NaN (the outputs are float32 already, the
  // padding's filters written by the kernels).
  const Segments outputs{{{nullptr, params.out, params.num_nodes * params.weights.width},
                          {nullptr, params.filters, params.num_pairs * params.weights.width}}};
  const bool hopper = use_sm90(params.weights);
  return launch_passes(params, params.out, outputs, stream, [&](auto width, auto split, auto ssp) {
    if (hopper) {
      return launch(sm90::cfconv_kernel<split(), ssp()>, params, sm90::SharedLayout::kTotal * sizeof(float),
                    sm90::kThreads, sm90::kTeams, stream);
    }
    return launch(cfconv_kernel<width(), split(), ssp()>, params, shared_bytes<width()>(params.weights.num_rbf),
                  kThreads, kTeams, stream);
  });
}

size_t cfconv_backward_workspace_bytes(int64_t num_nodes, int64_t num_pairs, bool given_order) {
  return sender_order_workspace_bytes(num_nodes, num_pairs, given_order);
}

cudaError_t launch_cfconv_backward(const CfconvBackwardParams& params, void* workspace, cudaStream_t stream) {
  SenderOrder walk;  // by sender for lists long enough to pay, else none (the list's own order)
  const cudaError_t status = launch_sender_order(params.pairs, params.num_nodes, params.num_pairs, params.live_pairs,
                                                 params.sender_order, workspace, &walk, stream);
  if (status != cudaSuccess) return status;
  const Segments outputs{{{nullptr, params.grad_x, params.num_nodes * params.weights.width},
                          {nullptr, params.grad_basis, params.num_pairs * params.weights.num_rbf},
                          {nullptr, params.grad_envelope, params.num_pairs}}};
  const bool hopper = use_sm90(params.weights);
  return launch_passes(
      params, params.grad_x, outputs, stream,
      [&](auto width, auto split, auto ssp) {
        if (hopper) {
          return launch(sm90::cfconv_backward_kernel<split(), ssp()>, params,
                        sm90::SharedLayout::kTotal * sizeof(float), sm90::kThreads, sm90::kTeams, stream, walk.order);
        }
        return launch(cfconv_backward_kernel<width(), split(), ssp()>, params,
                      shared_bytes<width()>(params.weights.num_rbf), kThreads, kTeams, stream, walk.order);
      },
      walk.check);
}

bool radial_cfconv_supported(int64_t num_rbf, int64_t hidden, int64_t width) {
  return num_rbf >= 1 && hidden >= 1 && width >= 1 && width % 4 == 0 &&
         filter_table_shared_bytes(num_rbf, hidden) <= max_shared_bytes_per_block();
}

cudaError_t launch_filter_table(const FilterTableParams& table, cudaStream_t stream) {
  const size_t bytes = filter_table_shared_bytes(table.num_rbf, table.hidden);
  const cudaError_t status =
      cudaFuncSetAttribute(filter_table_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (status != cudaSuccess) return status;
  const int64_t blocks = ceil_div(table.intervals, kTablePieces);
  return launch_overlapped(filter_table_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kTableThreads), bytes,
                           stream, false, table);
}

cudaError_t launch_radial_cfconv(const FilterTableParams& table, const RadialCfconvParams& params,
                                 cudaStream_t stream) {
  cudaError_t status = launch_filter_table(table, stream);
  if (status == cudaSuccess) {
    status = zero_flag_and_accumulator(params.invalid, params.out, params.num_nodes * params.width, stream);
  }
  if (status != cudaSuccess || params.num_pairs == 0) return status;
  const Segments outputs{{{nullptr, params.out, params.num_nodes * params.width}}};
  return launch_radial_pass<false>(params, SenderOrder{}, outputs, stream);
}

cudaError_t launch_radial_cfconv_backward(const RadialCfconvParams& params, void* workspace, cudaStream_t stream) {
  cudaError_t status = zero_flag_and_accumulator(params.invalid, params.out, params.num_nodes * params.width, stream);
  if (status != cudaSuccess || params.num_pairs == 0) return status;
  SenderOrder walk;
  status = launch_sender_order(params.pairs, params.num_nodes, params.num_pairs, /*live=*/nullptr,
                               params.sender_order, workspace, &walk, stream);
  if (status != cudaSuccess) return status;
  const Segments outputs{{{nullptr, params.out, params.num_nodes * params.width},
                          {nullptr, params.grad_distances, params.num_pairs}}};
  return launch_radial_pass<true>(params, walk, outputs, stream);
}
}  // namespace mirage::cuda
