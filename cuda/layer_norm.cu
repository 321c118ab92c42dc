// LayerNorm: a team of threads (a warp, or more for long rows) owns one row, keeps it in
// registers, and computes exact two-pass statistics before writing; x is read once.
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
__device__ __forceinline__ float team_sum(float v, float* scratch) {
  v = warp_sum(v);
  if (blockDim.x == 32) return v;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  float* mine = scratch + threadIdx.y * 32;
  if (lane == 0) mine[warp] = v;
  __syncthreads();
  v = lane < warps ? mine[lane] : 0.0f;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

// Loads the affine parameters of `v` (ones and zeros when absent) as raw P values.
template <typename P, int V>
__device__ __forceinline__ void load_affine(const LayerNormParams& p, int64_t v, Packed<P, V>& w,
                                            Packed<P, V>& b) {
#pragma unroll
  for (int i = 0; i < V; ++i) {
    w.v[i] = from_float<P>(1.0f);
    b.v[i] = from_float<P>(0.0f);
  }
  if (p.weight != nullptr) w = reinterpret_cast<const Packed<P, V>*>(p.weight)[v];
  if (p.bias != nullptr) b = reinterpret_cast<const Packed<P, V>*>(p.bias)[v];
}

template <typename T, typename P, int V, int K>
__global__ void __launch_bounds__(kMaxTeam) layer_norm_kernel(Args a) {
  __shared__ float scratch[32 * 32];
  const LayerNormParams& p = a.p;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  // A team past the last row stays to the end: its block's barriers count every thread.
  const int64_t row_vecs = row < p.rows ? a.row_vecs : 0;
  const int64_t offset = row * p.dim;

  float vals[K][V];
  Packed<P, V> w[K], b[K];  // fetched with x, so their latency hides behind the reductions
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (v < row_vecs) {
      load_packed<T, V>(static_cast<const T*>(p.x) + offset + v * V, vals[k]);
      load_affine<P, V>(p, v, w[k], b[k]);
      if (p.residual != nullptr) {
        float r[V];
        load_packed<T, V>(static_cast<const T*>(p.residual) + offset + v * V, r);
        // The sum is normalized as stored (rounded to T), as x + residual would be in PyTorch.
#pragma unroll
        for (int i = 0; i < V; ++i) vals[k][i] = to_float(from_float<T>(vals[k][i] + r[i]));
        store_packed<T, V>(static_cast<T*>(p.sum) + offset + v * V, vals[k]);
      }
#pragma unroll
      for (int i = 0; i < V; ++i) sum += vals[k][i];
    }
  }
  const float mean = team_sum(sum, scratch) / p.dim;
  float m2 = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float d = vals[k][i] - mean;
      m2 += v < row_vecs ? d * d : 0.0f;
    }
  }
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

template <typename T, typename P, int V>
cudaError_t launch_with(const Args& a, cudaStream_t stream) {
  // Smallest team, then fewest vectors per thread, that hold the row.
  int team = 32;
  while (static_cast<int64_t>(team) * (kMaxValuesPerThread / V) < a.row_vecs) team *= 2;
  int per_thread = 1;
  while (static_cast<int64_t>(team) * per_thread < a.row_vecs) per_thread *= 2;
  const int rows_per_block = team >= kBlockThreads ? 1 : kBlockThreads / team;
  const dim3 block(team, rows_per_block);
  const dim3 grid(static_cast<unsigned>((a.p.rows + rows_per_block - 1) / rows_per_block));
  switch (per_thread) {
#define MIRAGE_LAYER_NORM_CASE(K)                                \
  case K:                                                        \
    if constexpr (K * V <= kMaxValuesPerThread)                  \
      layer_norm_kernel<T, P, V, K><<<grid, block, 0, stream>>>(a); \
    break;
    MIRAGE_LAYER_NORM_CASE(1)
    MIRAGE_LAYER_NORM_CASE(2)
    MIRAGE_LAYER_NORM_CASE(4)
    MIRAGE_LAYER_NORM_CASE(8)
    MIRAGE_LAYER_NORM_CASE(16)
    MIRAGE_LAYER_NORM_CASE(32)
#undef MIRAGE_LAYER_NORM_CASE
  }
  return cudaGetLastError();
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
