// bias_act: one thread per 16-byte vector of x over a flat index; the bias is read as a vector of
// channels (channels-last: a row is a pixel's channels) or one value a row (NCHW: a channel's
// pixels).
//
// Measured on an H200 (scratch probe, 2026-11-23; bias + residual, channels-last, fp16, 100 calls
// in a CUDA graph, inputs past L2), us at 2x320x64x64 / 2x1280x8x8 / 2x960x64x64 / 2x640x32x32:
// kernel_utils' row grid with every option read at run time 7.35 / 2.64 / 14.72 / 4.40; this flat
// grid alone no better (7.49 / 2.53 / 14.52 / 4.24); the residual and the activation as template
// constants 6.24 / 2.24 / 13.35 / 3.74. A kernel with no run-time options at all took 5.33 / 1.87
// / 12.64 / 3.48 (torch.compile's Triton kernel in bench_norms: 5.5 / 1.9 / 11.9 / 3.6); two or
// more vectors a thread were slower.
#include <type_traits>

#include "bias_act.cuh"
#include "kernel_utils.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 256;

// One thread's vector i. The residual's presence and the activation are template constants: read
// from the params inside this body, they made the whole kernel 7.5 us instead of 5.4 at
// 2x320x64x64 with bias and residual (H200 probe, 2026-11-23).
template <typename T, typename P, int V, typename Index, bool kResidual, Activation kAct>
__device__ __forceinline__ void bias_act_vector(const BiasActParams& p, Index i, Index row_vecs) {
  const Index e = i * V;
  // Both loads are issued before any arithmetic: the residual's read waiting for the activation
  // would cost a second memory round trip per thread.
  float value[V], r[V];
  load_packed<T, V>(static_cast<const T*>(p.x) + e, value);
  if constexpr (kResidual) load_packed<T, V>(static_cast<const T*>(p.residual) + e, r);
  if (p.bias != nullptr) {
    const P* bias = static_cast<const P*>(p.bias);
    const Index channels = static_cast<Index>(p.channels), row = i / row_vecs;
    if (p.channels_last) {  // row = n * spatial + pixel; this vector holds channels col * V + j
      const Index sample = p.bias_per_sample ? row / static_cast<Index>(p.spatial) : 0, col = i - row * row_vecs;
      float b[V];
      load_packed<P, V>(bias + sample * channels + col * V, b);
#pragma unroll
      for (int j = 0; j < V; ++j) value[j] += b[j];
    } else {  // row = n * channels + c: [N, C] bias is indexed by the row itself
      const float b = to_float(bias[p.bias_per_sample ? row : row % channels]);
#pragma unroll
      for (int j = 0; j < V; ++j) value[j] += b;
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    value[j] = activate(value[j], kAct);
    if constexpr (kResidual) value[j] += r[j];
    value[j] *= p.scale;  // exact for the usual 1
  }
  store_packed<T, V>(static_cast<T*>(p.y) + e, value);
}

template <typename T, typename P, int V, typename Index, bool kResidual>
__device__ __forceinline__ void bias_act_vector(const BiasActParams& p, Index i, Index row_vecs) {
  switch (p.activation) {
    case Activation::kSilu: return bias_act_vector<T, P, V, Index, kResidual, Activation::kSilu>(p, i, row_vecs);
    case Activation::kGelu: return bias_act_vector<T, P, V, Index, kResidual, Activation::kGelu>(p, i, row_vecs);
    case Activation::kGeluTanh:
      return bias_act_vector<T, P, V, Index, kResidual, Activation::kGeluTanh>(p, i, row_vecs);
    case Activation::kRelu: return bias_act_vector<T, P, V, Index, kResidual, Activation::kRelu>(p, i, row_vecs);
    default: return bias_act_vector<T, P, V, Index, kResidual, Activation::kNone>(p, i, row_vecs);
  }
}

template <typename T, typename P, int V, typename Index>
__global__ void __launch_bounds__(kThreads) bias_act_kernel(BiasActParams p, Index vectors, Index row_vecs) {
  start_after_prior_grid();
  const Index i = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= vectors) return;
  if (p.residual != nullptr) bias_act_vector<T, P, V, Index, true>(p, i, row_vecs);
  else bias_act_vector<T, P, V, Index, false>(p, i, row_vecs);
}

template <typename T, typename P, int V>
cudaError_t launch_with(const BiasActParams& p, cudaStream_t stream) {
  const int64_t elements = p.batch * p.channels * p.spatial;
  const int64_t row_vecs = (p.channels_last ? p.channels : p.spatial) / V, vectors = elements / V;
  const int64_t blocks = ceil_div(vectors, kThreads);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;  // > 5e11 vectors
  // int offsets where the grid's last thread's fit (it runs up to a block past the end).
  const dim3 grid(static_cast<unsigned>(blocks)), block(kThreads);
  if ((vectors + kThreads) * V <= INT32_MAX)
    return launch_overlapped(bias_act_kernel<T, P, V, int>, grid, block, 0, stream, false, p,
                             static_cast<int>(vectors), static_cast<int>(row_vecs));
  return launch_overlapped(bias_act_kernel<T, P, V, int64_t>, grid, block, 0, stream, false, p, vectors, row_vecs);
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
