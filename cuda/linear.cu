// The few-rows linear: every block stages activation(x) as float32 in shared memory (rounded to
// the dtype first, as a separate activation's output would be); each warp owns one output
// feature, streams its weight row in 16-byte vectors and keeps one sum per row of x.
//
// Latency is everything at these sizes (0.8 MB of weights at [2, 1280] x [1280, 320]; reading
// them alone takes 1.9 us in a CUDA graph on an H200). Measured there (2026-11-23, 100 calls in
// a graph, weights past L2): staging x and only then reading the weights, two DRAM round trips
// in a row, 7-8 us; so each warp issues its first weight loads before the block stages x. Still
// 6.5 us: the activation's switch, inlined into unrolled loops, made a 160 KB kernel that missed
// the instruction cache; with the activation a template constant in the staging loop and fewer
// rows' code for m <= 2 (36 KB), 3.3 us.
#include "kernel_utils.cuh"
#include "linear.cuh"
#include "tf32.cuh"

namespace mirage::cuda {
namespace {

constexpr int kWarps = 8;
// Weight vectors a lane loads before staging x: whole rows of up to 2,048 fp16/bf16 inputs.
constexpr int kAhead = 8;

// V consecutive staged floats; 16-byte reads where V allows (lanes V floats apart would otherwise
// meet in the same shared-memory banks).
template <int V>
__device__ __forceinline__ void load_staged(const float* p, float (&out)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int i = 0; i < V; i += 4) {
      const float4 q = *reinterpret_cast<const float4*>(p + i);
      out[i] = q.x;
      out[i + 1] = q.y;
      out[i + 2] = q.z;
      out[i + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = p[i];
  }
}

// sum[r] += w . staged row r, over the V inputs from column c.
template <typename T, int V, int M>
__device__ __forceinline__ void accumulate(const Packed<T, V>& w, const float* staged, int m, int k, int c,
                                           float (&sum)[M]) {
#pragma unroll
  for (int r = 0; r < M; ++r) {
    if (r < m) {
      float xs[V];
      load_staged<V>(staged + r * k + c, xs);
#pragma unroll
      for (int i = 0; i < V; ++i) sum[r] = fmaf(to_float(w.v[i]), xs[i], sum[r]);
    }
  }
}

// activation(x) as float32 in shared memory, rounded to the dtype first. kAct is a constant so
// that this loop's body holds one activation's code, not a switch of five (unrolled, that code
// outgrew the instruction cache).
template <typename T, int V, Activation kAct>
__device__ __forceinline__ void stage_x(const SmallLinearParams& p, float* staged) {
  const int k = static_cast<int>(p.k), values = static_cast<int>(p.m) * k;
  const T* x = static_cast<const T*>(p.x);
#pragma unroll 2
  for (int i = threadIdx.x * V; i < values; i += blockDim.x * V) {
    const int row = i / k, col = i - row * k;  // V divides k: a vector stays in its row
    float v[V];
    load_packed<T, V>(x + row * p.ldx + col, v);
#pragma unroll
    for (int j = 0; j < V; ++j) staged[i + j] = to_float(from_float<T>(activate(v[j], kAct)));
  }
}

// V: x and weight elements read at once (16 bytes, or 1 where rows are not 16-byte aligned).
// M: the most rows of x this instance takes (fewer rows, less code).
template <typename T, int V, int M>
__global__ void __launch_bounds__(kWarps * 32) small_linear_kernel(SmallLinearParams p) {
  start_after_prior_grid();
  extern __shared__ float staged[];  // [m, k]
  const int m = static_cast<int>(p.m), k = static_cast<int>(p.k);
  const int lane = threadIdx.x % 32;
  const int64_t out = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  // Past the last feature a warp still helps to stage x: it only skips its weights.
  const T* w_row = static_cast<const T*>(p.weight) + (out < p.n ? out : 0) * p.ldw;
  Packed<T, V> ahead[kAhead];
#pragma unroll
  for (int u = 0; u < kAhead; ++u) {
    const int c = (u * 32 + lane) * V;
    if (out < p.n && c < k) ahead[u] = *reinterpret_cast<const Packed<T, V>*>(w_row + c);
  }

  switch (p.activation) {
    case Activation::kSilu: stage_x<T, V, Activation::kSilu>(p, staged); break;
    case Activation::kGelu: stage_x<T, V, Activation::kGelu>(p, staged); break;
    case Activation::kGeluTanh: stage_x<T, V, Activation::kGeluTanh>(p, staged); break;
    case Activation::kRelu: stage_x<T, V, Activation::kRelu>(p, staged); break;
    default: stage_x<T, V, Activation::kNone>(p, staged); break;
  }
  __syncthreads();
  if (out >= p.n) return;

  float sum[M] = {};
#pragma unroll
  for (int u = 0; u < kAhead; ++u) {
    const int c = (u * 32 + lane) * V;
    if (c < k) accumulate<T, V, M>(ahead[u], staged, m, k, c, sum);
  }
#pragma unroll 1
  for (int c = (kAhead * 32 + lane) * V; c < k; c += 32 * V) {
    accumulate<T, V, M>(*reinterpret_cast<const Packed<T, V>*>(w_row + c), staged, m, k, c, sum);
  }
  const float bias = p.bias != nullptr ? to_float(static_cast<const T*>(p.bias)[out]) : 0.0f;
#pragma unroll
  for (int r = 0; r < M; ++r) {
    if (r < m) {
      float v = warp_sum(sum[r]) + bias;
      if (lane == 0) {
        if (p.residual != nullptr) v += to_float(static_cast<const T*>(p.residual)[r * p.ldr + out]);
        static_cast<T*>(p.y)[r * p.n + out] = from_float<T>(v);
      }
    }
  }
}

// The narrow linear: the weight as [k][kNarrowLd] (k padded to 2 kNarrowChunk with zeros, n to
// 32), a row's stride chosen so that the fragment reads (k = 4 t + ..., n = g: lanes 4 g + t) hit
// 32 banks.
constexpr int kNarrowLd = 34;
constexpr int kNarrowWarps = 8;
constexpr int kNarrowTile = 16;   // output rows a warp takes at a time: one m16 tile
constexpr int kNarrowChunk = 32;  // k columns of x a lane loads at once; two chunks are in flight

__host__ __device__ int narrow_padded_k(int k) {
  return static_cast<int>(ceil_div(k, 2 * kNarrowChunk) * 2 * kNarrowChunk);
}
size_t narrow_shared_bytes(int k) { return static_cast<size_t>(narrow_padded_k(k)) * kNarrowLd * sizeof(float); }

// A lane's part of a chunk of x: rows g and g + 8 of the warp's m16 tile, 4 columns at
// k0 + 16 q + 4 t for q = 0, 1 (zeros past the matrix).
struct NarrowChunk {
  float v[2][2][4];  // [row g, g + 8][q][4]

  __device__ void load(const NarrowLinearParams& p, int64_t row0, int k0) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int64_t row = row0 + 8 * h + g;
        const int col = k0 + 16 * q + 4 * t;
        const float4 x = row < p.m && col < p.k ? *reinterpret_cast<const float4*>(p.x + row * p.ldx + col)
                                                : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        v[h][q][0] = x.x;
        v[h][q][1] = x.y;
        v[h][q][2] = x.z;
        v[h][q][3] = x.w;
      }
  }
};

// acc += the chunk at k0 times the weight's first 8 kTiles columns. Each 16 columns of a chunk
// are two k8 steps whose "k index" t stands for column 4 t + 2 s and t + 4 for the next one (a
// permutation, matched in the weight's fragments, so that x comes in 16-byte loads).
template <int kTiles>
__device__ __forceinline__ void narrow_products(const NarrowChunk& a, const float* w, int k0,
                                                float (&acc)[kTiles][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int q = 0; q < 2; ++q)
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      uint32_t a_hi[4], a_lo[4], b_hi[kTiles][2], b_lo[kTiles][2];
      const float f[4] = {a.v[0][q][2 * s], a.v[1][q][2 * s], a.v[0][q][2 * s + 1], a.v[1][q][2 * s + 1]};
#pragma unroll
      for (int i = 0; i < 4; ++i) split<true>(f[i], a_hi[i], a_lo[i]);
      const float* w_row = w + (k0 + 16 * q + 4 * t + 2 * s) * kNarrowLd + g;
#pragma unroll
      for (int n = 0; n < kTiles; ++n) {
        split<true>(w_row[8 * n], b_hi[n][0], b_lo[n][0]);
        split<true>(w_row[kNarrowLd + 8 * n], b_hi[n][1], b_lo[n][1]);
      }
#pragma unroll
      for (int n = 0; n < kTiles; ++n) {  // the small terms first
        mma_tf32(acc[n], a_lo, b_hi[n]);
        mma_tf32(acc[n], a_hi, b_lo[n]);
        mma_tf32(acc[n], a_hi, b_hi[n]);
      }
    }
}

// Two chunks of x in flight per lane: each chunk's loads are issued two chunks ahead of its
// products (one chunk ahead was latency-bound, 2.3 TB/s on an H200). kTiles: the n8 tiles that
// cover the outputs (PaiNN's 21 take 3: a quarter fewer products than padding them to 32).
template <int kTiles>
__global__ void __launch_bounds__(kNarrowWarps * 32) narrow_linear_kernel(NarrowLinearParams p) {
  extern __shared__ float4 smem4[];
  float* w = reinterpret_cast<float*>(smem4);
  const int k_padded = narrow_padded_k(p.k);
  for (int idx = threadIdx.x; idx < k_padded * kNarrowLinearMaxOutputs; idx += blockDim.x) {
    const int kk = idx / kNarrowLinearMaxOutputs, n = idx % kNarrowLinearMaxOutputs;
    w[kk * kNarrowLd + n] = kk < p.k && n < p.n ? p.weight[n * p.wn + kk * p.wk] : 0.0f;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t tiles = ceil_div(p.m, int64_t{kNarrowTile});
  for (int64_t tile = static_cast<int64_t>(blockIdx.x) * kNarrowWarps + threadIdx.x / 32; tile < tiles;
       tile += static_cast<int64_t>(gridDim.x) * kNarrowWarps) {
    const int64_t row0 = tile * kNarrowTile;
    float acc[kTiles][4] = {};
    NarrowChunk even, odd;
    even.load(p, row0, 0);
    odd.load(p, row0, kNarrowChunk);
#pragma unroll 1
    for (int k0 = 0; k0 < k_padded; k0 += 2 * kNarrowChunk) {
      NarrowChunk a = even;
      if (k0 + 2 * kNarrowChunk < k_padded) even.load(p, row0, k0 + 2 * kNarrowChunk);
      narrow_products<kTiles>(a, w, k0, acc);
      a = odd;
      if (k0 + 3 * kNarrowChunk < k_padded) odd.load(p, row0, k0 + 3 * kNarrowChunk);
      narrow_products<kTiles>(a, w, k0 + kNarrowChunk, acc);
    }
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t row = row0 + 8 * (e / 2) + g;
        const int col = 8 * n + 2 * t + e % 2;
        if (row < p.m && col < p.n) p.y[row * p.n + col] = acc[n][e] + (p.bias != nullptr ? p.bias[col] : 0.0f);
      }
  }
}


// The tiled linear: each block a kSize x kSize tile of y (64, or 32 where 64 would leave the GPU
// short of blocks), its four warps a quarter each (kSize / 32 m16 by kSize / 16 n8 MMA tiles); k in
// slices of 32, three slices in flight. Shared-memory rows are padded so that the fragment reads of
// a warp (rows g, columns t: lanes 4 g + t) meet 32 banks.
constexpr int kTiledDepth = 32, kTiledStages = 3, kTiledWarps = 4;
constexpr int kTiledLd = kTiledDepth + 4;  // x's slice [kSize][36], a row-major weight's [kSize][36]

template <int kSize>
struct TiledShape {
  static constexpr int kM = kSize / 32, kN = kSize / 16;  // a warp's m16 and n8 tiles
  static constexpr int kColumnsLd = kSize + 8;            // a column-major weight's slice [32][kSize + 8]
  static constexpr int kSliceFloats = kSize * kTiledLd > kTiledDepth * kColumnsLd ? kSize * kTiledLd
                                                                                   : kTiledDepth * kColumnsLd;
  static constexpr int kPieces = 8 * kSize / (kTiledWarps * 32);  // 16-byte pieces a thread copies per operand
  static constexpr size_t kSharedBytes = kTiledStages * 2 * kSliceFloats * sizeof(float);
};

// Slice `slice` of k of x's and the weight's tiles into stage buffers xs and ws: 8 kSize 16-byte
// pieces each.
template <int kSize, bool kWeightColumns>
__device__ __forceinline__ void fetch_slice(const TiledLinearParams& p, int64_t row0, int col0, int slice, float* xs,
                                            float* ws) {
  using S = TiledShape<kSize>;
  const int k0 = slice * kTiledDepth;
#pragma unroll
  for (int i = 0; i < S::kPieces; ++i) {
    const int piece = threadIdx.x + i * kTiledWarps * 32;
    const int r = piece / 8, c = 4 * (piece % 8);  // x: row r, columns k0 + c..c+3
    const int64_t row = row0 + r;
    const bool x_valid = row < p.m && k0 + c < p.k;
    copy_async(xs + r * kTiledLd + c, x_valid ? p.x + row * p.ldx + k0 + c : p.x, 16, x_valid);
    if constexpr (kWeightColumns) {  // a row of kSize outputs for each of the slice's 32 inputs
      const int kk = piece / (kSize / 4), n = 4 * (piece % (kSize / 4));
      const bool valid = k0 + kk < p.k && col0 + n < p.n;
      copy_async(ws + kk * S::kColumnsLd + n,
                 valid ? p.weight + static_cast<int64_t>(k0 + kk) * p.ldw + col0 + n : p.weight, 16, valid);
    } else {  // 32 inputs of each of kSize outputs
      const bool valid = col0 + r < p.n && k0 + c < p.k;
      copy_async(ws + r * kTiledLd + c, valid ? p.weight + static_cast<int64_t>(col0 + r) * p.ldw + k0 + c : p.weight,
                 16, valid);
    }
  }
  commit_copies();
}

// acc += the slice's products: four k8 steps of the warp's kM x kN MMA tiles.
template <int kSize, bool kWeightColumns, bool kSplit>
__device__ __forceinline__ void slice_products(const float* xs, const float* ws, int warp_row, int warp_col,
                                               float (&acc)[TiledShape<kSize>::kM][TiledShape<kSize>::kN][4]) {
  using S = TiledShape<kSize>;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int s = 0; s < kTiledDepth / 8; ++s) {
    uint32_t a_hi[S::kM][4], a_lo[S::kM][4], b_hi[S::kN][2], b_lo[S::kN][2];
#pragma unroll
    for (int mi = 0; mi < S::kM; ++mi) {
      const float* x = xs + (warp_row + 16 * mi + g) * kTiledLd + 8 * s + t;
      const float f[4] = {x[0], x[8 * kTiledLd], x[4], x[8 * kTiledLd + 4]};
#pragma unroll
      for (int e = 0; e < 4; ++e) split<kSplit>(f[e], a_hi[mi][e], a_lo[mi][e]);
    }
#pragma unroll
    for (int ni = 0; ni < S::kN; ++ni) {
      const int n = warp_col + 8 * ni + g, kk = 8 * s + t;
      const float f0 = kWeightColumns ? ws[kk * S::kColumnsLd + n] : ws[n * kTiledLd + kk];
      const float f1 = kWeightColumns ? ws[(kk + 4) * S::kColumnsLd + n] : ws[n * kTiledLd + kk + 4];
      split<kSplit>(f0, b_hi[ni][0], b_lo[ni][0]);
      split<kSplit>(f1, b_hi[ni][1], b_lo[ni][1]);
    }
    // The small terms first; one term for all the warp's tiles before the next, so that no MMA
    // waits on the one before it.
    if constexpr (kSplit) {
#pragma unroll
      for (int mi = 0; mi < S::kM; ++mi)
#pragma unroll
        for (int ni = 0; ni < S::kN; ++ni) mma_tf32(acc[mi][ni], a_lo[mi], b_hi[ni]);
#pragma unroll
      for (int mi = 0; mi < S::kM; ++mi)
#pragma unroll
        for (int ni = 0; ni < S::kN; ++ni) mma_tf32(acc[mi][ni], a_hi[mi], b_lo[ni]);
    }
#pragma unroll
    for (int mi = 0; mi < S::kM; ++mi)
#pragma unroll
      for (int ni = 0; ni < S::kN; ++ni) mma_tf32(acc[mi][ni], a_hi[mi], b_hi[ni]);
  }
}

template <int kSize, bool kWeightColumns, bool kSplit>
__global__ void __launch_bounds__(kTiledWarps * 32) tiled_linear_kernel(TiledLinearParams p) {
  using S = TiledShape<kSize>;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);  // per stage: x's slice, then the weight's
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kSize;
  const int col0 = static_cast<int>(blockIdx.y) * kSize;
  const int warp = threadIdx.x / 32, warp_row = kSize / 2 * (warp / 2), warp_col = kSize / 2 * (warp % 2);
  const int slices = static_cast<int>(ceil_div(p.k, kTiledDepth));
  auto stage = [&](int slice) { return smem + (slice % kTiledStages) * 2 * S::kSliceFloats; };
#pragma unroll
  for (int s = 0; s < kTiledStages - 1; ++s) {
    if (s < slices) fetch_slice<kSize, kWeightColumns>(p, row0, col0, s, stage(s), stage(s) + S::kSliceFloats);
    else commit_copies();  // an empty group keeps the count the wait below expects
  }
  float acc[S::kM][S::kN][4] = {};
#pragma unroll 1
  for (int slice = 0; slice < slices; ++slice) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kTiledStages - 2) : "memory");
    __syncthreads();  // this slice has landed for every thread; the previous one's buffer is free
    const int next = slice + kTiledStages - 1;
    if (next < slices) {
      fetch_slice<kSize, kWeightColumns>(p, row0, col0, next, stage(next), stage(next) + S::kSliceFloats);
    } else {
      commit_copies();
    }
    slice_products<kSize, kWeightColumns, kSplit>(stage(slice), stage(slice) + S::kSliceFloats, warp_row, warp_col,
                                                  acc);
  }
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mi = 0; mi < S::kM; ++mi)
#pragma unroll
    for (int ni = 0; ni < S::kN; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t row = row0 + warp_row + 16 * mi + 8 * (e / 2) + g;
        const int col = col0 + warp_col + 8 * ni + 2 * t + e % 2;
        if (row < p.m && col < p.n) {
          float v = acc[mi][ni][e];
          if (p.bias != nullptr) v += p.bias[col];
          if (p.residual != nullptr) v += p.residual[row * p.ldr + col];
          p.y[row * p.n + col] = v;
        }
      }
}

}  // namespace

bool narrow_linear_fits(int64_t k) {
  return k >= 1 && k <= kNarrowLinearMaxInputs &&
         narrow_shared_bytes(static_cast<int>(k)) <= max_shared_bytes_per_block();
}

cudaError_t launch_narrow_linear(const NarrowLinearParams& p, cudaStream_t stream) {
  if (p.n < 1 || p.n > kNarrowLinearMaxOutputs || p.k < 1 || p.k > kNarrowLinearMaxInputs || p.k % 4 != 0 ||
      p.ldx % 4 != 0 || !is_aligned(p.x, 16))
    return cudaErrorInvalidValue;
  if (p.m == 0) return cudaSuccess;
  const size_t shared = narrow_shared_bytes(p.k);
  constexpr void (*kernels[])(NarrowLinearParams) = {narrow_linear_kernel<1>, narrow_linear_kernel<2>,
                                                     narrow_linear_kernel<3>, narrow_linear_kernel<4>};
  const auto kernel = kernels[ceil_div(p.n, 8) - 1];
  int64_t wave = 0;
  const cudaError_t status = blocks_per_wave(kernel, kNarrowWarps * 32, shared, wave);
  if (status != cudaSuccess) return status;
  // One wave of blocks (each stages the weight once), fewer when there are fewer tiles.
  const int64_t blocks = std::min(ceil_div(ceil_div(p.m, int64_t{kNarrowTile}), int64_t{kNarrowWarps}), wave);
  // A plain launch, as for the tiled kernel below: see there.
  kernel<<<static_cast<unsigned>(blocks), kNarrowWarps * 32, shared, stream>>>(p);
  return cudaGetLastError();
}

bool tiled_linear_applies(const TiledLinearParams& p) {
  constexpr int64_t kMaxGridX = INT32_MAX, kMaxGridY = 65535;
  return p.m >= 1 && p.n >= 1 && p.k >= 4 && p.k % 4 == 0 && p.ldx % 4 == 0 && p.ldw % 4 == 0 &&
         is_aligned(p.x, 16) && is_aligned(p.weight, 16) && (!p.weight_columns || p.n % 4 == 0) &&
         ceil_div(p.m, 32) <= kMaxGridX && ceil_div(p.n, 32) <= kMaxGridY;
}

namespace {

template <int kSize>
cudaError_t launch_tiles(const TiledLinearParams& p, cudaStream_t stream) {
  const auto kernel = p.weight_columns
                          ? (p.split ? tiled_linear_kernel<kSize, true, true> : tiled_linear_kernel<kSize, true, false>)
                          : (p.split ? tiled_linear_kernel<kSize, false, true> : tiled_linear_kernel<kSize, false, false>);
  constexpr size_t kShared = TiledShape<kSize>::kSharedBytes;
  // Past 48 KB a kernel's dynamic shared memory must be asked for; cheap enough to ask each call.
  if (kShared > 48 * 1024) {
    const cudaError_t status =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kShared));
    if (status != cudaSuccess) return status;
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(p.m, kSize)), static_cast<unsigned>(ceil_div(p.n, kSize)));
  // A plain launch, not an overlapped one. PaiNN at 3,000 atoms (H200, 2026-11-28, bench_forcefield,
  // two runs each): 2.182-2.185 ms a call with this kernel and the narrow one overlapped, 2.134 with
  // them plain and the rest overlapped, 2.135-2.141 with nothing overlapped. The likely cause: an
  // overlapped grid's blocks are placed while the kernel ahead still holds the multiprocessors,
  // wherever there is room, so a grid of fewer blocks than multiprocessors (PaiNN's [3000, 128] x
  // [128, 128]: 94) can end up with two on one multiprocessor while another idles.
  kernel<<<grid, kTiledWarps * 32, kShared, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_tiled_linear(const TiledLinearParams& p, cudaStream_t stream) {
  if (!tiled_linear_applies(p)) return cudaErrorInvalidValue;
  // 64 x 64 tiles where they give every multiprocessor four blocks or more, else 32 x 32: Nsight
  // Compute on [3000, 128] x [128, 128] (94 blocks of 64 x 64) found 6% of the warps a
  // multiprocessor can hold busy and the tensor cores 13% (H200).
  const bool large = ceil_div(p.m, 64) * ceil_div(p.n, 64) >= 4LL * sm_count();
  return large ? launch_tiles<64>(p, stream) : launch_tiles<32>(p, stream);
}

cudaError_t launch_small_linear(const SmallLinearParams& p, cudaStream_t stream) {
  if (p.m < 1 || p.m > kSmallLinearMaxRows || p.m * p.k > kSmallLinearMaxInputs) return cudaErrorInvalidValue;
  if (p.n == 0) return cudaSuccess;
  cudaError_t status = cudaSuccess;
  MIRAGE_DISPATCH_FLOAT(p.dtype, [&] {
    constexpr int kPack = kPackWidth<scalar_t>;
    const bool packed = p.k % kPack == 0 && p.ldw % kPack == 0 && p.ldx % kPack == 0 &&
                        is_aligned(p.weight, 16) && is_aligned(p.x, 16);
    const auto kernel = p.m <= 2 ? (packed ? small_linear_kernel<scalar_t, kPack, 2> : small_linear_kernel<scalar_t, 1, 2>)
                                 : (packed ? small_linear_kernel<scalar_t, kPack, kSmallLinearMaxRows>
                                           : small_linear_kernel<scalar_t, 1, kSmallLinearMaxRows>);
    const int64_t blocks = ceil_div(p.n, int64_t{kWarps});  // one warp per output feature
    const size_t shared = static_cast<size_t>(p.m * p.k) * sizeof(float);
    status = launch_overlapped(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kWarps * 32), shared, stream, false, p);
  });
  return status;
}

}  // namespace mirage::cuda
