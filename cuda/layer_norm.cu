// LayerNorm: a team of threads (a few lanes of a warp, or more for long rows) owns one row, keeps
// it in registers, and computes exact two-pass statistics before writing; x is read once.
//
// Two kernels. layer_norm_team_kernel takes the transformer case (16-byte vectors, weight and
// bias given, rows of 9 to 160 vectors: 72 to 1280 fp16 values) with its team size, vectors a
// lane and residual fixed at compile time. layer_norm_kernel takes everything else with those
// read at run time. Measured on an H200 (docs/perf/norms.md, fp16): the compile-time form was
// 1.1-1.4x faster at the SD-1.5 U-Net's rows of 320, 640 and 1280 (8192x320: 5.6 -> 4.1 us).
#include <type_traits>

#include "kernel_utils.cuh"
#include "layer_norm.cuh"

namespace mirage::cuda {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kMaxTeam = 512;  // 128 registers a thread: the row stays out of local memory
constexpr int kMaxValuesPerThread = 32;  // row values per thread, kept in registers

struct Args {
  LayerNormParams p;
  int64_t row_vecs;
};

// Sum over the team of threadIdx.x (blockDim.x threads, a power of two); threadIdx.y picks the row.
// A team under 32 lanes shares its warp with other rows, so it shuffles only at xor offsets below
// its size; every lane of the warp takes part (teams past the last row included).
__device__ __forceinline__ float team_sum(float v, float* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    if (offset < static_cast<int>(blockDim.x)) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (blockDim.x <= 32) return v;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  float* mine = scratch + threadIdx.y * 32;
  if (lane == 0) mine[warp] = v;
  __syncthreads();
  v = lane < warps ? mine[lane] : 0.0f;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

// Loads the affine parameters of `v` as raw P values. kAffine: weight and bias are both given (the
// usual case). Otherwise an absent one reads as ones or zeros, merged in element by element: the
// merge costs instructions the usual case does not pay.
template <typename P, int V, bool kAffine>
__device__ __forceinline__ void load_affine(const LayerNormParams& p, int64_t v, Packed<P, V>& w,
                                            Packed<P, V>& b) {
  if constexpr (!kAffine) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      w.v[i] = from_float<P>(1.0f);
      b.v[i] = from_float<P>(0.0f);
    }
  }
  if (kAffine || p.weight != nullptr) w = reinterpret_cast<const Packed<P, V>*>(p.weight)[v];
  if (kAffine || p.bias != nullptr) b = reinterpret_cast<const Packed<P, V>*>(p.bias)[v];
}

template <typename T, typename P, int V, int K, bool kAffine>
__global__ void __launch_bounds__(kMaxTeam) layer_norm_kernel(Args a) {
  start_after_prior_grid();
  __shared__ float scratch[32 * 32];
  const LayerNormParams& p = a.p;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  // A team past the last row stays to the end: its block's barriers count every thread.
  const int64_t row_vecs = row < p.rows ? a.row_vecs : 0;
  // Loads are unconditional: a slot past the row reads vector 0, a team past the last row reads
  // row 0, and neither value is used. Loads under a condition made the compiler merge 16-bit
  // values into registers one by one (fp16 on an H200, with kAffine: 8192x320 6.18 -> 5.74 us,
  // 512x1280 with a residual 4.40 -> 3.75).
  const int64_t offset = (row < p.rows ? row : 0) * p.dim;

  // x (and the residual) first, all vectors at once; w and b after the sum, their latency hidden
  // behind the reductions.
  Packed<T, V> xs[K], rs[K];
  Packed<P, V> w[K], b[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    const int64_t at = offset + (v < a.row_vecs ? v : 0) * V;
    xs[k] = *reinterpret_cast<const Packed<T, V>*>(static_cast<const T*>(p.x) + at);
    if (p.residual != nullptr)
      rs[k] = *reinterpret_cast<const Packed<T, V>*>(static_cast<const T*>(p.residual) + at);
  }
  float vals[K][V];
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
#pragma unroll
    for (int i = 0; i < V; ++i) vals[k][i] = to_float(xs[k].v[i]);
    if (v < row_vecs) {
      if (p.residual != nullptr) {
        // The sum is normalized as stored (rounded to T), as x + residual would be in PyTorch.
#pragma unroll
        for (int i = 0; i < V; ++i)
          vals[k][i] = to_float(from_float<T>(vals[k][i] + to_float(rs[k].v[i])));
        store_packed<T, V>(static_cast<T*>(p.sum) + offset + v * V, vals[k]);
      }
#pragma unroll
      for (int i = 0; i < V; ++i) sum += vals[k][i];
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    load_affine<P, V, kAffine>(p, v < a.row_vecs ? v : 0, w[k], b[k]);
  }
  const float mean = team_sum(sum, scratch) / p.dim;
  const float m2 = squared_deviations(
      vals, mean, [&](int k) { return threadIdx.x + static_cast<int64_t>(k) * blockDim.x < row_vecs; });
  const float rstd = rsqrtf(team_sum(m2, scratch) / p.dim + p.eps);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (v < row_vecs) {
#pragma unroll
      for (int i = 0; i < V; ++i)
        vals[k][i] = (vals[k][i] - mean) * rstd * to_float(w[k].v[i]) + to_float(b[k].v[i]);
      store_packed<T, V>(static_cast<T*>(p.y) + offset + v * V, vals[k]);
    }
  }
}

constexpr int kTeamThreads = 128;
constexpr int kTeamMinK = 3;  // vectors a lane
constexpr int kTeamMinLanes = 4, kTeamMaxLanes = 32;

// The most vectors a lane holds: 5, or 4 when the parameters are wider than x (fp32 weight and
// bias with fp16/bf16 x, under autocast), whose K = 5 form needs more than 128 registers and spills.
template <typename T, typename P>
constexpr int kTeamMaxK = sizeof(P) > sizeof(T) ? 4 : 5;

// The team kernel's team: the fewest lanes (a power of two, 4 to 32) that hold the row in at most
// max_k vectors a lane; 0 when the row is too short or too long for it. Then K = ceil(row_vecs /
// team) is 3 to max_k (fewer lanes would need more), and for rows of 5 x 8, 5 x 16 and 5 x 32
// vectors (320, 640 and 1280 fp16 values) no slot is idle. On an H200 (fp16) 8 lanes x 5 beat
// 16 x 3 by 2-7% at 8192x320 and 16 x 5 tied 32 x 3 at 2048x640; 128 and 256 threads a block
// were within 2% of each other.
int team_lanes(int64_t row_vecs, int max_k) {
  if (row_vecs < kTeamMinLanes * (kTeamMinK - 1) + 1 || row_vecs > kTeamMaxLanes * max_k) return 0;
  int lanes = kTeamMinLanes;
  while (lanes * max_k < row_vecs) lanes *= 2;
  return lanes;
}

// kTeam lanes of one warp own a row, K vectors a lane: vectors lane + k * kTeam, of which only the
// last (k = K - 1) may fall past the row's end. Four blocks an SM cap it at 128 registers (the
// plain K = 5 form takes 118); capped at 102 (five blocks) it was 13% slower at 8192x320.
template <typename T, typename P, int kTeam, int K, bool kResidual>
__global__ void __launch_bounds__(kTeamThreads, 4) layer_norm_team_kernel(Args a) {
  start_after_prior_grid();
  constexpr int V = kPackWidth<T>;
  using Vec = Packed<T, V>;
  const LayerNormParams& p = a.p;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kTeamThreads / kTeam) + threadIdx.x / kTeam;
  const int lane = threadIdx.x % kTeam;
  const int row_vecs = static_cast<int>(a.row_vecs);
  // A team past the last row reads row 0 and stores nothing; its lanes still join the shuffles.
  const bool live = row < p.rows;
  const int64_t offset = (live ? row : 0) * p.dim;
  auto in_row = [&](int k) { return k < K - 1 || lane + k * kTeam < row_vecs; };
  // Loads are unconditional (a slot past the row reads the lane's first vector again): see
  // layer_norm_kernel for what conditional loads cost.
  auto slot = [&](int k) { return in_row(k) ? lane + k * kTeam : lane; };

  const Vec* x = reinterpret_cast<const Vec*>(static_cast<const T*>(p.x) + offset);
  const Vec* r = kResidual ? reinterpret_cast<const Vec*>(static_cast<const T*>(p.residual) + offset) : nullptr;
  Vec xs[K], rs[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    xs[k] = x[slot(k)];
    if constexpr (kResidual) rs[k] = r[slot(k)];
  }
  float vals[K][V];
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      vals[k][i] = to_float(xs[k].v[i]);
      // The sum is normalized as stored (rounded to T), as x + residual would be in PyTorch.
      if constexpr (kResidual) vals[k][i] = to_float(from_float<T>(vals[k][i] + to_float(rs[k].v[i])));
      sum += in_row(k) ? vals[k][i] : 0.0f;
    }
    if constexpr (kResidual)
      if (live && in_row(k)) store_packed<T, V>(static_cast<T*>(p.sum) + offset + slot(k) * V, vals[k]);
  }
  // The parameters after x, their latency hidden behind the reductions.
  Packed<P, V> w[K], b[K];
#pragma unroll
  for (int k = 0; k < K; ++k) load_affine<P, V, true>(p, slot(k), w[k], b[k]);
  const float mean = warp_sum<kTeam>(sum) / p.dim;
  const float rstd = rsqrtf(warp_sum<kTeam>(squared_deviations(vals, mean, in_row)) / p.dim + p.eps);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (!live || !in_row(k)) continue;
#pragma unroll
    for (int i = 0; i < V; ++i)
      vals[k][i] = (vals[k][i] - mean) * rstd * to_float(w[k].v[i]) + to_float(b[k].v[i]);
    store_packed<T, V>(static_cast<T*>(p.y) + offset + slot(k) * V, vals[k]);
  }
}

template <typename T, typename P, int kTeam, bool kResidual>
cudaError_t launch_team_kernel(const Args& a, cudaStream_t stream) {
  constexpr int kRows = kTeamThreads / kTeam;
  const dim3 grid(static_cast<unsigned>((a.p.rows + kRows - 1) / kRows));
  const dim3 block(kTeamThreads);
  switch (ceil_div(a.row_vecs, kTeam)) {
    case 3: return launch_overlapped(layer_norm_team_kernel<T, P, kTeam, 3, kResidual>, grid, block, 0, stream, false, a);
    case 4: return launch_overlapped(layer_norm_team_kernel<T, P, kTeam, 4, kResidual>, grid, block, 0, stream, false, a);
    case 5:
      if constexpr (kTeamMaxK<T, P> >= 5)
        return launch_overlapped(layer_norm_team_kernel<T, P, kTeam, 5, kResidual>, grid, block, 0, stream, false, a);
      [[fallthrough]];
    default: return cudaErrorInvalidValue;  // team_lanes keeps K within 3..kTeamMaxK
  }
}

template <typename T, typename P, bool kResidual>
cudaError_t launch_team(const Args& a, int lanes, cudaStream_t stream) {
  switch (lanes) {
    case 4: return launch_team_kernel<T, P, 4, kResidual>(a, stream);
    case 8: return launch_team_kernel<T, P, 8, kResidual>(a, stream);
    case 16: return launch_team_kernel<T, P, 16, kResidual>(a, stream);
    case 32: return launch_team_kernel<T, P, 32, kResidual>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, typename P, int V, int K>
cudaError_t launch_kernel(const Args& a, dim3 grid, dim3 block, cudaStream_t stream) {
  const bool affine = a.p.weight != nullptr && a.p.bias != nullptr;
  return launch_overlapped(affine ? layer_norm_kernel<T, P, V, K, true> : layer_norm_kernel<T, P, V, K, false>,
                           grid, block, 0, stream, false, a);
}

template <typename T, typename P, int V>
cudaError_t launch_with(const Args& a, cudaStream_t stream) {
  if constexpr (V == kPackWidth<T>) {
    const int lanes =
        a.p.weight != nullptr && a.p.bias != nullptr ? team_lanes(a.row_vecs, kTeamMaxK<T, P>) : 0;
    if (lanes != 0) {
      return a.p.residual != nullptr ? launch_team<T, P, true>(a, lanes, stream)
                                     : launch_team<T, P, false>(a, lanes, stream);
    }
  }
  // The smallest team (a power of two, 1 to kMaxTeam lanes) that holds the row in at most 3
  // vectors a thread, one row a team, 256-thread blocks. It was the rule of the 2026-11-22 sweep
  // (docs/perf/norms.md, fp16, H200), taken when this kernel served every row; the U-Net's rows
  // now take the team kernel above.
  int team = 1;
  while (team < kMaxTeam && static_cast<int64_t>(team) * 3 < a.row_vecs) team *= 2;
  // 1, 2 or 3; past that (kMaxTeam lanes, longer rows) a power of two.
  int per_thread = 1;
  while (static_cast<int64_t>(team) * per_thread < a.row_vecs)
    per_thread += per_thread < 4 ? 1 : per_thread;
  const int rows_per_block = team >= kBlockThreads ? 1 : kBlockThreads / team;
  const dim3 block(team, rows_per_block);
  const dim3 grid(static_cast<unsigned>((a.p.rows + rows_per_block - 1) / rows_per_block));
  switch (per_thread) {
#define MIRAGE_LAYER_NORM_CASE(K)                                 \
  case K:                                                         \
    if constexpr (K * V <= kMaxValuesPerThread)                   \
      return launch_kernel<T, P, V, K>(a, grid, block, stream);   \
    break;
    MIRAGE_LAYER_NORM_CASE(1)
    MIRAGE_LAYER_NORM_CASE(2)
    MIRAGE_LAYER_NORM_CASE(3)
    MIRAGE_LAYER_NORM_CASE(4)
    MIRAGE_LAYER_NORM_CASE(8)
    MIRAGE_LAYER_NORM_CASE(16)
    MIRAGE_LAYER_NORM_CASE(32)
#undef MIRAGE_LAYER_NORM_CASE
  }
  return cudaErrorInvalidValue;  // layer_norm_max_dim keeps rows within K * V <= kMaxValuesPerThread
}

// Parameters come in x's dtype or in float32.
template <typename T, int V>
cudaError_t launch_with_params(const Args& a, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, float>) {
    return launch_with<T, float, V>(a, stream);
  } else {
    return a.p.param_dtype == DType::kFloat32 ? launch_with<T, float, V>(a, stream)
                                              : launch_with<T, T, V>(a, stream);
  }
}

}  // namespace

int64_t layer_norm_max_dim(DType dtype) {
  (void)dtype;  // the scalar path bounds every dtype alike
  return static_cast<int64_t>(kMaxTeam) * kMaxValuesPerThread;
}

cudaError_t launch_layer_norm(const LayerNormParams& params, cudaStream_t stream) {
  if (params.rows == 0 || params.dim == 0) return cudaSuccess;
  if (params.dim > layer_norm_max_dim(params.dtype)) return cudaErrorInvalidValue;
  cudaError_t status = cudaSuccess;
  MIRAGE_DISPATCH_FLOAT(params.dtype, [&] {
    constexpr int kPack = kPackWidth<scalar_t>;
    // Parameters are read packed too: kPack of them need not be 16 bytes, but must be aligned so.
    const int param_pack_bytes = kPack * dtype_size(params.param_dtype);
    const bool packed = params.dim % kPack == 0 && is_aligned(params.x, 16) &&
                        is_aligned(params.y, 16) &&
                        (params.residual == nullptr ||
                         (is_aligned(params.residual, 16) && is_aligned(params.sum, 16))) &&
                        is_aligned(params.weight, param_pack_bytes) &&
                        is_aligned(params.bias, param_pack_bytes);
    const Args args{params, params.dim / (packed ? kPack : 1)};
    status = packed ? launch_with_params<scalar_t, kPack>(args, stream)
                    : launch_with_params<scalar_t, 1>(args, stream);
  });
  return status;
}

}  // namespace mirage::cuda
