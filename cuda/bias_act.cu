// bias_act: one thread per 16-byte vector of x seen as rows (channels-last: a pixel's channels;
// NCHW: a channel's pixels), in the division-free row grid of kernel_utils.cuh; bias read as a
// vector of channels (channels-last) or one value a row (NCHW).
#include <type_traits>

#include "bias_act.cuh"
#include "kernel_utils.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T, typename P, int V, typename Index>
__global__ void __launch_bounds__(kThreads) bias_act_kernel(BiasActParams p, Index rows, Index row_vecs) {
  const Index col = grid_col<Index>(), row = grid_row<Index>();
  if (col >= row_vecs || row >= rows) return;
  const Index e = (row * row_vecs + col) * V;
  // Both loads are issued before any arithmetic: the residual's read waiting for the activation
  // would cost a second memory round trip per thread.
  float value[V], r[V];
  load_packed<T, V>(static_cast<const T*>(p.x) + e, value);
  if (p.residual != nullptr) load_packed<T, V>(static_cast<const T*>(p.residual) + e, r);
  if (p.bias != nullptr) {
    const P* bias = static_cast<const P*>(p.bias);
    const Index channels = static_cast<Index>(p.channels);
    if (p.channels_last) {  // row = n * spatial + pixel; this vector holds channels col * V + i
      const Index sample = p.bias_per_sample ? row / static_cast<Index>(p.spatial) : 0;
      float b[V];
      load_packed<P, V>(bias + sample * channels + col * V, b);
#pragma unroll
      for (int i = 0; i < V; ++i) value[i] += b[i];
    } else {  // row = n * channels + c: [N, C] bias is indexed by the row itself
      const float b = to_float(bias[p.bias_per_sample ? row : row % channels]);
#pragma unroll
      for (int i = 0; i < V; ++i) value[i] += b;
    }
  }
#pragma unroll
  for (int i = 0; i < V; ++i) value[i] = activate(value[i], p.activation);
  if (p.residual != nullptr) {
#pragma unroll
    for (int i = 0; i < V; ++i) value[i] += r[i];
  }
  if (p.scale != 1.0f) {
#pragma unroll
    for (int i = 0; i < V; ++i) value[i] *= p.scale;
  }
  store_packed<T, V>(static_cast<T*>(p.y) + e, value);
}

template <typename T, typename P, int V>
cudaError_t launch_with(const BiasActParams& p, cudaStream_t stream) {
  const int64_t rows = p.channels_last ? p.batch * p.spatial : p.batch * p.channels;
  const int64_t row_vecs = (p.channels_last ? p.channels : p.spatial) / V;
  const RowGrid g = row_grid(rows, row_vecs, kThreads);
  if (!g.valid) return cudaErrorInvalidValue;  // > 4e9 rows
  if (g.fits_int(rows * row_vecs * V)) {
    bias_act_kernel<T, P, V, int><<<g.grid, g.block, 0, stream>>>(p, static_cast<int>(rows),
                                                                   static_cast<int>(row_vecs));
  } else {
    bias_act_kernel<T, P, V, int64_t><<<g.grid, g.block, 0, stream>>>(p, rows, row_vecs);
  }
  return cudaGetLastError();
}

// The bias comes in x's dtype or in float32.
template <typename T, int V>
cudaError_t launch_with_bias(const BiasActParams& p, cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (p.bias_dtype == DType::kFloat32) return launch_with<T, float, V>(p, stream);
  }
  return launch_with<T, T, V>(p, stream);
}

}  // namespace

cudaError_t launch_bias_act(const BiasActParams& params, cudaStream_t stream) {
  if (params.batch * params.channels * params.spatial == 0) return cudaSuccess;
  cudaError_t status = cudaSuccess;
  MIRAGE_DISPATCH_FLOAT(params.dtype, [&] {
    constexpr int kPack = kPackWidth<scalar_t>;
    const int64_t inner = params.channels_last ? params.channels : params.spatial;
    // Channels-last reads kPack bias values at once: the bias must be aligned for them.
    const int bias_bytes = kPack * dtype_size(params.bias_dtype);
    const bool packed = inner % kPack == 0 && is_aligned(params.x, 16) && is_aligned(params.y, 16) &&
                        (params.residual == nullptr || is_aligned(params.residual, 16)) &&
                        (!params.channels_last || is_aligned(params.bias, bias_bytes));
    status = packed ? launch_with_bias<scalar_t, kPack>(params, stream)
                    : launch_with_bias<scalar_t, 1>(params, stream);
  });
  return status;
}

}  // namespace mirage::cuda
