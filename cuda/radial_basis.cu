// Radial basis: one thread per output element (coalesced writes; the distance is re-read from
// L1 by the num threads that share it), float32 arithmetic whatever the I/O dtype.
// Its backward: a group of lanes per distance, each lane summing a strided share of the basis
// functions, the group's sums added with shuffles; also float32 arithmetic.
#include <algorithm>

#include "kernel_utils.cuh"
#include "radial_basis.cuh"
#include "radial_functions.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 256;
template <typename T>
__global__ void __launch_bounds__(kThreads) radial_basis_kernel(RadialBasisParams p) {
  start_after_prior_grid();
  const T* distances = static_cast<const T*>(p.distances);  // [count]
  T* out = static_cast<T*>(p.out);                          // [count, num]
  const int64_t total = p.count * p.num;
  // Bessel frequencies k pi / c; Gaussians: radial_functions.cuh.
  const float spacing = gaussian_spacing(p.num, p.cutoff);
  const float bessel_scale = sqrtf(2.0f / p.cutoff);
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = e / p.num;
    const int k = static_cast<int>(e - row * p.num);
    const float d = to_float(distances[row]);
    float basis;
    if (p.kind == RadialBasisKind::kGaussian) {
      basis = gaussian(d, k, spacing);
    } else if (p.kind == RadialBasisKind::kNone) {
      basis = no_basis(d);
    } else {
      const float frequency = (k + 1) * kPi / p.cutoff;
      basis = bessel_scale * frequency * sinc(frequency * d);  // sqrt(2/c) sin(n pi d / c) / d
    }
    out[e] = from_float<T>(basis * envelope(p.cutoff_fn, d, p.cutoff));
  }
}

// G consecutive lanes (a power of two, at most a warp) per distance: lane l takes the basis
// functions k = l, l + G, ..., so a group reads its row of grad coalesced.
// grad_distances = f * sum_k g_k basis_k' + f' * sum_k g_k basis_k.
template <typename T, int G>
__global__ void __launch_bounds__(kThreads) radial_basis_backward_kernel(RadialBasisBackwardParams p) {
  start_after_prior_grid();
  static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0 && kThreads % G == 0);
  const T* grad = static_cast<const T*>(p.grad);            // [count, num]
  const T* distances = static_cast<const T*>(p.distances);  // [count]
  T* grad_distances = static_cast<T*>(p.grad_distances);    // [count]
  const int lane = static_cast<int>(threadIdx.x % G);
  // Only this group's lanes shuffle together: they share every row, so they leave the loop
  // together whatever the other groups of the warp do.
  const unsigned mask =
      G == 32 ? 0xffffffffu : ((1u << G) - 1u) << (threadIdx.x % 32 / G * G);
  const float spacing = gaussian_spacing(p.num, p.cutoff);
  const int64_t groups = static_cast<int64_t>(gridDim.x) * (blockDim.x / G);
  for (int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / G;
       row < p.count; row += groups) {
    const float d = to_float(distances[row]);
    float sum_basis = 0.0f, sum_derivative = 0.0f;
#pragma unroll 4
    for (int k = lane; k < p.num; k += G) {
      const float g = to_float(grad[row * p.num + k]);
      float basis, derivative;
      basis_and_derivative(p.kind, k, d, spacing, p.cutoff, basis, derivative);
      sum_basis += g * basis;
      sum_derivative += g * derivative;
    }
#pragma unroll
    for (int offset = G / 2; offset > 0; offset >>= 1) {
      sum_basis += __shfl_xor_sync(mask, sum_basis, offset, G);
      sum_derivative += __shfl_xor_sync(mask, sum_derivative, offset, G);
    }
    if (lane == 0) {
      grad_distances[row] = from_float<T>(envelope(p.cutoff_fn, d, p.cutoff) * sum_derivative +
                                          envelope_derivative(p.cutoff_fn, d, p.cutoff) * sum_basis);
    }
  }
}

template <int G>
cudaError_t launch_backward_with_group(const RadialBasisBackwardParams& params,
                                       cudaStream_t stream) {
  cudaError_t status = cudaSuccess;
  MIRAGE_DISPATCH_FLOAT(params.dtype, [&] {
    const int64_t blocks =
        std::min<int64_t>(ceil_div(params.count * G, kThreads), 8LL * sm_count());
    status = launch_overlapped(radial_basis_backward_kernel<scalar_t, G>, dim3(static_cast<unsigned>(blocks)),
                               dim3(kThreads), 0, stream, false, params);
  });
  return status;
}

}  // namespace

cudaError_t launch_radial_basis_backward(const RadialBasisBackwardParams& params,
                                         cudaStream_t stream) {
  if (params.count == 0) return cudaSuccess;
  // Groups of 4 lanes up to 32 functions (SchNet's 20 Gaussians and PaiNN's 20 Bessel functions:
  // 5 a lane; a warp then takes 8 distances at a time), wider groups for wider bases. A warp a
  // distance (one function a lane) spent each iteration waiting on its one load, 12 of its lanes
  // idle at 20 functions: 36 us for SchNet's 139k distances on an H200.
  if (params.num <= 32) return launch_backward_with_group<4>(params, stream);
  if (params.num <= 64) return launch_backward_with_group<8>(params, stream);
  if (params.num <= 128) return launch_backward_with_group<16>(params, stream);
  return launch_backward_with_group<32>(params, stream);
}

cudaError_t launch_radial_basis(const RadialBasisParams& params, cudaStream_t stream) {
  if (params.count == 0 || params.num == 0) return cudaSuccess;
  cudaError_t status = cudaSuccess;
  MIRAGE_DISPATCH_FLOAT(params.dtype, [&] {
    const int64_t blocks =
        std::min<int64_t>(ceil_div(params.count * params.num, kThreads), 8LL * sm_count());
    status = launch_overlapped(radial_basis_kernel<scalar_t>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0,
                               stream, false, params);
  });
  return status;
}

}  // namespace mirage::cuda
