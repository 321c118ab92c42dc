// subpixel_shuffle: a copy with a bias add, one output pixel's channel vector per thread.
#include <cstdint>

#include "kernel_utils.cuh"
#include "subpixel_shuffle.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 256;

// A row of the row_grid launch is one output pixel, its columns V-vectors of channels. Every y
// value is read at most once and every output written once, so the pass moves about twice the
// output's bytes. B is the bias' element type (T or float); the bias' presence is a template
// constant so that the unrolled body carries no run-time branch.
template <typename T, typename B, bool kBias, int V, typename Index>
__global__ void __launch_bounds__(kThreads) subpixel_shuffle_kernel(SubpixelShuffleParams p, Index pixels) {
  start_after_prior_grid();
  const Index col = grid_col<Index>(), pixel = grid_row<Index>();
  const Index channels = static_cast<Index>(p.channels);
  if (col * V >= channels || pixel >= pixels) return;
  const Index out_w = 2 * static_cast<Index>(p.width), out_h = 2 * static_cast<Index>(p.height);
  const Index ox = pixel % out_w, rest = pixel / out_w;
  const Index oy = rest % out_h, n = rest / out_h;
  const Index py = oy & 1, px = ox & 1;
  const Index src_pixel = (n * (out_h / 2 + 1) + (oy >> 1) + py) * (out_w / 2 + 1) + (ox >> 1) + px;
  const T* src = static_cast<const T*>(p.y) + src_pixel * 4 * channels + (2 * py + px) * channels + col * V;
  float value[V];
  load_packed<T, V>(src, value);
  if constexpr (kBias) {
    float bias[V];
    load_packed<B, V>(static_cast<const B*>(p.bias) + col * V, bias);
#pragma unroll
    for (int j = 0; j < V; ++j) value[j] += bias[j];
  }
  store_packed<T, V>(static_cast<T*>(p.out) + pixel * channels + col * V, value);
}

template <typename T, typename B, bool kBias, int V>
cudaError_t launch_with(const SubpixelShuffleParams& p, cudaStream_t stream) {
  const int64_t pixels = p.batch * 4 * p.height * p.width;
  const RowGrid g = row_grid(pixels, p.channels / V, kThreads);
  if (!g.valid) return cudaErrorInvalidValue;  // > 4e9 pixels
  const int64_t y_elements = p.batch * (p.height + 1) * (p.width + 1) * 4 * p.channels;
  if (g.fits_int(y_elements))
    return launch_overlapped(subpixel_shuffle_kernel<T, B, kBias, V, int>, g.grid, g.block, 0, stream, false, p,
                             static_cast<int>(pixels));
  return launch_overlapped(subpixel_shuffle_kernel<T, B, kBias, V, int64_t>, g.grid, g.block, 0, stream, false, p, pixels);
}

template <typename T, int V>
cudaError_t launch_vector(const SubpixelShuffleParams& p, cudaStream_t stream) {
  if (p.bias == nullptr) return launch_with<T, T, false, V>(p, stream);
  return p.bias_dtype == DType::kFloat32 ? launch_with<T, float, true, V>(p, stream)
                                         : launch_with<T, T, true, V>(p, stream);
}

}  // namespace

cudaError_t launch_subpixel_shuffle(const SubpixelShuffleParams& params, cudaStream_t stream) {
  if (params.batch == 0 || params.height == 0 || params.width == 0 || params.channels == 0) return cudaSuccess;
  cudaError_t status = cudaSuccess;
  MIRAGE_DISPATCH_FLOAT(params.dtype, [&] {
    constexpr int kPack = kPackWidth<scalar_t>;
    // The bias is read kPack values at a time as well: a float32 one needs 4 * kPack-byte
    // alignment.
    const int bias_bytes = (params.bias_dtype == DType::kFloat32 ? 4 : static_cast<int>(sizeof(scalar_t))) * kPack;
    const bool packed = params.channels % kPack == 0 && is_aligned(params.y, 16) &&
                        is_aligned(params.out, 16) &&
                        (params.bias == nullptr || is_aligned(params.bias, bias_bytes));
    status = packed ? launch_vector<scalar_t, kPack>(params, stream)
                    : launch_vector<scalar_t, 1>(params, stream);
  });
  return status;
}

}  // namespace mirage::cuda
