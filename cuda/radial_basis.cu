// Radial basis: one thread per output element (coalesced writes; the distance is re-read from
// L1 by the num threads that share it), float32 arithmetic whatever the I/O dtype.
#include <algorithm>

#include "kernel_utils.cuh"
#include "radial_basis.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 256;
constexpr float kPi = 3.14159265358979323846f;
// Below this |x|, sin(x) / x is its Taylor series: exact to float64 rounding there, and the
// autograd composite switches at the same point so that its derivatives stay finite at d = 0.
constexpr float kSincSeriesBelow = 0.1f;

__device__ __forceinline__ float sinc(float x) {
  if (fabsf(x) < kSincSeriesBelow) {
    const float x2 = x * x;
    return 1.0f - x2 / 6.0f * (1.0f - x2 / 20.0f * (1.0f - x2 / 42.0f * (1.0f - x2 / 72.0f)));
  }
  return sinf(x) / x;
}

// Zero from the cutoff on (so the padding of mirage::neighbor_list, at the cutoff, is zero).
// NaN gives 0 here and NaN in the basis, so the product stays NaN.
__device__ __forceinline__ float envelope(CutoffFn fn, float d, float cutoff) {
  if (fn == CutoffFn::kNone) return 1.0f;
  if (!(d < cutoff)) return 0.0f;
  const float x = d / cutoff;
  if (fn == CutoffFn::kCosine) return 0.5f * (cosf(kPi * x) + 1.0f);
  const float x2 = x * x, x6 = x2 * x2 * x2;  // p = 6: 1 - 28 x^6 + 48 x^7 - 21 x^8
  return 1.0f + x6 * (-28.0f + x * (48.0f - 21.0f * x));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) radial_basis_kernel(RadialBasisParams p) {
  const T* distances = static_cast<const T*>(p.distances);  // [count]
  T* out = static_cast<T*>(p.out);                          // [count, num]
  const int64_t total = p.count * p.num;
  // Gaussian centers k * spacing over [0, cutoff], width the spacing; Bessel frequencies k pi / c.
  const float spacing = p.num > 1 ? p.cutoff / static_cast<float>(p.num - 1) : p.cutoff;
  const float bessel_scale = sqrtf(2.0f / p.cutoff);
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = e / p.num;
    const int k = static_cast<int>(e - row * p.num);
    const float d = to_float(distances[row]);
    float basis;
    if (p.kind == RadialBasisKind::kGaussian) {
      const float z = (d - k * spacing) / spacing;
      basis = expf(-0.5f * z * z);
    } else {
      const float frequency = (k + 1) * kPi / p.cutoff;
      basis = bessel_scale * frequency * sinc(frequency * d);  // sqrt(2/c) sin(n pi d / c) / d
    }
    out[e] = from_float<T>(basis * envelope(p.cutoff_fn, d, p.cutoff));
  }
}

}  // namespace

cudaError_t launch_radial_basis(const RadialBasisParams& params, cudaStream_t stream) {
  if (params.count == 0 || params.num == 0) return cudaSuccess;
  cudaError_t status = cudaSuccess;
  MIRAGE_DISPATCH_FLOAT(params.dtype, [&] {
    const int64_t blocks =
        std::min<int64_t>(ceil_div(params.count * params.num, kThreads), 8LL * sm_count());
    radial_basis_kernel<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
    status = cudaGetLastError();
  });
  return status;
}

}  // namespace mirage::cuda
