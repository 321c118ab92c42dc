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
#include <type_traits>

#include "cfconv.cuh"
#include "kernel_utils.cuh"

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
constexpr int kRowsPerWarp = kTile / kTeamWarps;  // rows of a warp in the per-pair passes
constexpr int kMaxRbf = 64;
static_assert((kTeamWarps / kWarpsAlongColumns) * 32 == kTile, "the product's warps cover the tile's rows");

__device__ __forceinline__ int team() { return threadIdx.x / kTeamThreads; }
__device__ __forceinline__ int team_thread() { return threadIdx.x % kTeamThreads; }
// __syncthreads for one team (named barriers 1 and 2; 0 is __syncthreads').
__device__ __forceinline__ void team_sync() {
  asm volatile("bar.sync %0, %1;" ::"r"(1 + team()), "n"(kTeamThreads) : "memory");
}

// v = hi + lo for the tensor cores, which read a register's top 19 bits as a TF32 value (an
// H200 reads 1 + 0x1fff ulp as 1). hi is v rounded to TF32 with two integer operations
// (cvt.rna.tf32 takes four with its NaN and Inf checks); lo, below half of hi's last bit, goes
// raw (whatever the hardware does with its low bits costs < 2^-21 of v: float32's accuracy, as
// the tests check). Without kSplit hi alone. A non-finite v makes lo NaN, so an infinite operand
// gives NaN where PyTorch's product is infinite (docs/ops.md): non-finite values still reach
// exactly the outputs they reach in PyTorch.
template <bool kSplit>
__device__ __forceinline__ void split(float v, uint32_t& hi, uint32_t& lo) {
  hi = (__float_as_uint(v) + 0x1000u) & 0xffffe000u;
  if constexpr (kSplit) lo = __float_as_uint(v - __uint_as_float(hi));
}

// c += a b for one m16n8k8 TF32 tile (fragments in the PTX ISA's layout).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
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

// A tile's pairs: receivers (-1 for padding rows and pairs with an index out of range, which
// also raise *invalid), senders, envelopes (0 for padding) and the basis rows (zero-filled).
// fetch() puts the loads in flight: the pairs into registers, the basis rows straight into
// shared memory by cp.async; stash() stores the pairs and waits for the basis. The kernels fetch
// the next tile once the current one is done with the basis, before its last pass (which still
// reads the current pairs), and stash it after: the loads overlap that pass.
template <int D>
struct TileFetch {
  static_assert(kTile <= kTeamThreads, "one pair a thread");
  int64_t receiver, sender;  // checked in stash(): a check here would wait for the loads
  float envelope;
  bool real;  // a pair, not padding

  template <typename Params>
  __device__ void fetch(const Params& p, const Layout<D>& l, float* smem, int64_t base) {
    const int row = team_thread();
    envelope = 0.0f;
    real = row < kTile && base + row < p.num_pairs;
    if (real) {
      receiver = p.pairs[base + row];
      sender = p.pairs[p.num_pairs + base + row];
      envelope = p.envelope[base + row];
    }
    const int num_rbf = p.weights.num_rbf;
    for (int e = team_thread(); e < kTile * l.rbf8; e += kTeamThreads) {
      const int r = e % l.rbf8;
      const int64_t pair = base + e / l.rbf8;
      const bool value = r < num_rbf && pair < p.num_pairs;
      // Four bytes from global memory, or (source size 0) four zero bytes.
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(static_cast<uint32_t>(
                       __cvta_generic_to_shared(smem + l.basis + e / l.rbf8 * l.ld_basis + r))),
                   "l"(value ? p.basis + pair * num_rbf + r : p.basis), "r"(value ? 4 : 0));
    }
    asm volatile("cp.async.commit_group;");
  }

  template <typename Params>
  __device__ void stash(const Params& p, const Layout<D>& l, float* smem) const {
    const int row = team_thread();
    if (row < kTile) {
      int i = -1, j = 0;
      if (real) {
        if (receiver >= 0 && receiver < p.num_nodes && sender >= 0 && sender < p.num_nodes) {
          i = static_cast<int>(receiver);
          j = static_cast<int>(sender);
        } else {
          *p.invalid = 1;  // every writer stores the same value
        }
      }
      reinterpret_cast<int*>(smem + l.receivers)[row] = i;
      reinterpret_cast<int*>(smem + l.senders)[row] = j;
      smem[l.envelope + row] = envelope;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  }
};

// The per-pair passes: a warp walks kRowsPerWarp consecutive rows of the tile, D/4 lanes per row
// (each a float4 of columns), 32/(D/4) groups of lanes splitting the rows between them. Rows are
// read a few at a time before any atomic, so their loads overlap.
template <int D>
struct RowWalk {
  static constexpr int kLanesPerRow = D / 4;
  static constexpr int kGroups = 32 / kLanesPerRow;
  static constexpr int kRows = kRowsPerWarp / kGroups;
  static_assert(kRows % 4 == 0, "the per-pair passes take their rows in batches of 4 and 2");
  int first, col;
  __device__ RowWalk() {
    const int lane = threadIdx.x % 32;
    first = (team_thread() / 32) * kRowsPerWarp + (lane / kLanesPerRow) * kRows;
    col = (lane % kLanesPerRow) * 4;
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

template <bool kSsp>
__device__ __forceinline__ float filter_activation(float v, Activation activation) {
  if constexpr (kSsp) {  // softplus(v) - log 2 = max(v, 0) + log(1 + exp(-|v|)) - log 2; v above 20 as F.softplus
    return v > 20.0f ? v - 0.6931471805599453f
                     : fmaxf(v, 0.0f) + __logf(1.0f + __expf(-fabsf(v))) - 0.6931471805599453f;
  } else {
    return any_activation(v, activation);
  }
}

template <bool kSsp>
__device__ __forceinline__ float filter_activation_grad(float v, Activation activation) {
  if constexpr (kSsp) {  // sigmoid(v); 1 above 20 as F.softplus' backward
    return v > 20.0f ? 1.0f : __fdividef(1.0f, 1.0f + __expf(-v));
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

template <int D, bool kSplit, bool kSsp>
__global__ void __launch_bounds__(kThreads, 1) cfconv_kernel(CfconvParams p) {
  using W = WarpTile<D>;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const Layout<D> l(p.weights.num_rbf, team());
  constexpr int kLd = Layout<D>::kLd;
  const int* receivers = reinterpret_cast<const int*>(smem + l.receivers);
  const int* senders = reinterpret_cast<const int*>(smem + l.senders);
  float* tile = smem + l.tile;
  load_weights<D, false>(p.weights, l, smem);
  const int64_t tiles = ceil_div(p.num_pairs, kTile);
  __syncthreads();  // the weights are in
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kTeams;
  TileFetch<D> next;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kTeams + team();
  if (first < tiles) next.fetch(p, l, smem, first * kTile);
  for (int64_t t = first; t < tiles; t += stride) {
    const int64_t base = t * kTile;
    const int rows = static_cast<int>(std::min<int64_t>(kTile, p.num_pairs - base));
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
    if (t + stride < tiles) next.fetch(p, l, smem, base + stride * kTile);
    // Save the filters; scatter x[j] * filter * envelope, one atomic per run of equal receivers.
    const RowWalk<D> walk;
    float sum[4] = {};
    int run = -1;
    constexpr int kBatch = 4;
    for (int k0 = 0; k0 < RowWalk<D>::kRows; k0 += kBatch) {
      float f[kBatch][4], x[kBatch][4];
      int receiver[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int row = walk.first + k0 + k;
        receiver[k] = row < rows ? receivers[row] : -1;
        if (row < rows) {
          load_packed<float, 4>(tile + row * kLd + walk.col, f[k]);
          store_packed<float, 4>(p.filters + (base + row) * D + walk.col, f[k]);
          const float e = smem[l.envelope + row];
#pragma unroll
          for (int c = 0; c < 4; ++c) f[k][c] *= e;
        }
        if (receiver[k] >= 0) load_packed<float, 4>(p.x + static_cast<int64_t>(senders[row]) * D + walk.col, x[k]);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        if (receiver[k] < 0) continue;
        if (receiver[k] != run) {
          if (run >= 0) atomic_add<4>(p.out + static_cast<int64_t>(run) * D + walk.col, sum);
          run = receiver[k];
#pragma unroll
          for (int c = 0; c < 4; ++c) sum[c] = 0.0f;
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) sum[c] = fmaf(x[k][c], f[k][c], sum[c]);
      }
    }
    if (run >= 0) atomic_add<4>(p.out + static_cast<int64_t>(run) * D + walk.col, sum);
  }
}

template <int D, bool kSplit, bool kSsp>
__global__ void __launch_bounds__(kThreads, 1) cfconv_backward_kernel(CfconvBackwardParams p) {
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
  const int64_t tiles = ceil_div(p.num_pairs, kTile);
  __syncthreads();  // the weights are in
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kTeams;
  TileFetch<D> next;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kTeams + team();
  if (first < tiles) next.fetch(p, l, smem, first * kTile);
  for (int64_t t = first; t < tiles; t += stride) {
    const int64_t base = t * kTile;
    const int rows = static_cast<int>(std::min<int64_t>(kTile, p.num_pairs - base));
    team_sync();
    next.stash(p, l, smem);
    team_sync();
    // Per pair: grad_x[j] += grad[i] * filter * envelope; the filter's gradient grad[i] * x[j]
    // gives the envelope's (dotted with the filter) and, times the envelope, the tile.
    {
      const RowWalk<D> walk;
      constexpr int kBatch = 2;  // three operand rows a row: more spills registers
      for (int k0 = 0; k0 < RowWalk<D>::kRows; k0 += kBatch) {
        float f[kBatch][4], g[kBatch][4], x[kBatch][4];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const int row = walk.first + k0 + k, i = receivers[row];
          if (i >= 0) {
            load_packed<float, 4>(p.filters + (base + row) * D + walk.col, f[k]);
            load_packed<float, 4>(p.grad + static_cast<int64_t>(i) * D + walk.col, g[k]);
            load_packed<float, 4>(p.x + static_cast<int64_t>(senders[row]) * D + walk.col, x[k]);
          }
        }
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const int row = walk.first + k0 + k;
          float grad_pre[4] = {}, gx[4];
          float dot = 0.0f;
          if (receivers[row] >= 0) {
            const float e = smem[l.envelope + row];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              gx[c] = g[k][c] * f[k][c] * e;
              const float grad_filter = g[k][c] * x[k][c];
              dot = fmaf(grad_filter, f[k][c], dot);
              grad_pre[c] = grad_filter * e;
            }
            atomic_add<4>(p.grad_x + static_cast<int64_t>(senders[row]) * D + walk.col, gx);
          }
          store_packed<float, 4>(tile + row * kLd + walk.col, grad_pre);
#pragma unroll
          for (int offset = RowWalk<D>::kLanesPerRow / 2; offset > 0; offset >>= 1)
            dot += __shfl_xor_sync(0xffffffffu, dot, offset);
          if (walk.col == 0 && row < rows) p.grad_envelope[base + row] = dot;
        }
      }
    }
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
    if (t + stride < tiles) next.fetch(p, l, smem, base + stride * kTile);
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
          if (row < rows && r < R) p.grad_basis[(base + row) * R + r] = out[m][0][e];
        }
    }
  }
}

template <int D>
size_t shared_bytes(int num_rbf) {
  return Layout<D>(num_rbf, 0).bytes();
}

int max_shared_bytes() {
  int device = 0, bytes = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  return bytes;
}

// Launches a kernel with its shared memory on min(tiles, SMs) blocks (one block per SM).
template <typename Params>
cudaError_t launch(void (*kernel)(Params), const Params& params, size_t bytes, cudaStream_t stream) {
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(bytes));
  if (status != cudaSuccess) return status;
  const int64_t tiles = ceil_div(params.num_pairs, kTile);
  const int64_t blocks = std::min<int64_t>(ceil_div(tiles, kTeams), sm_count());
  kernel<<<static_cast<unsigned>(blocks), kThreads, bytes, stream>>>(params);
  return cudaGetLastError();
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

// Zeroes the invalid flag and the [N, D] float32 accumulator, runs the kernel (launch_kernel(width,
// split, ssp); none without pairs), then converts the outputs or, after a bad index, poisons them.
template <typename Params, typename LaunchKernel>
cudaError_t launch_passes(const Params& params, float* accumulator, const Segments& outputs, cudaStream_t stream,
                          LaunchKernel&& launch_kernel) {
  cudaError_t status = cudaMemsetAsync(params.invalid, 0, sizeof(int), stream);
  if (status == cudaSuccess) {
    status = cudaMemsetAsync(accumulator, 0, params.num_nodes * params.weights.width * sizeof(float), stream);
  }
  if (status != cudaSuccess || params.num_pairs == 0) return status;
  status = dispatch(params.weights, launch_kernel);
  if (status != cudaSuccess) return status;
  return launch_finish<float>(outputs, params.invalid, stream);
}

}  // namespace

bool cfconv_supported(int64_t num_rbf, int64_t hidden, int64_t width) {
  if (hidden != width || (width != 64 && width != 128) || num_rbf < 1 || num_rbf > kMaxRbf) return false;
  int device = 0, major = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  const int rbf = static_cast<int>(num_rbf);  // checked <= kMaxRbf above
  const size_t needed = width == 64 ? shared_bytes<64>(rbf) : shared_bytes<128>(rbf);
  return major >= 8 && needed <= static_cast<size_t>(max_shared_bytes());
}

cudaError_t launch_cfconv(const CfconvParams& params, cudaStream_t stream) {
  // An index out of range anywhere turns every output NaN (the outputs are float32 already).
  const Segments outputs{{{nullptr, params.out, params.num_nodes * params.weights.width},
                          {nullptr, params.filters, params.num_pairs * params.weights.width}}};
  return launch_passes(params, params.out, outputs, stream, [&](auto width, auto split, auto ssp) {
    return launch(cfconv_kernel<width(), split(), ssp()>, params, shared_bytes<width()>(params.weights.num_rbf),
                  stream);
  });
}

cudaError_t launch_cfconv_backward(const CfconvBackwardParams& params, cudaStream_t stream) {
  const Segments outputs{{{nullptr, params.grad_x, params.num_nodes * params.weights.width},
                          {nullptr, params.grad_basis, params.num_pairs * params.weights.num_rbf},
                          {nullptr, params.grad_envelope, params.num_pairs}}};
  return launch_passes(params, params.grad_x, outputs, stream, [&](auto width, auto split, auto ssp) {
    return launch(cfconv_backward_kernel<width(), split(), ssp()>, params,
                  shared_bytes<width()>(params.weights.num_rbf), stream);
  });
}

}  // namespace mirage::cuda
