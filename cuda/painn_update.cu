// PaiNN's update block: one thread per (atom n, feature f), the three vector components in
// registers. Each kernel replaces 5 to 15 of PyTorch's elementwise kernels (the norm, the cat,
// the products and their sums, and their backward), which for a small molecule cost a launch
// each in a CUDA graph.
#include <cstdint>

#include "kernel_utils.cuh"
#include "painn_update.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 256;

// Element (n, c, f) of an [N, 3, F] tensor.
__device__ __forceinline__ int64_t at3(int64_t n, int c, int64_t f, int64_t F) {
  return (n * 3 + c) * F + f;
}

template <typename T>
__device__ __forceinline__ float load(const void* p, int64_t i) {
  return to_float(static_cast<const T*>(p)[i]);
}

template <typename T>
__device__ __forceinline__ void store(void* p, int64_t i, float value) {
  static_cast<T*>(p)[i] = from_float<T>(value);
}

__device__ __forceinline__ bool element(int64_t nodes, int64_t F, int64_t& n, int64_t& f) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  n = e / F;
  f = e - n * F;
  return n < nodes;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) update_input_kernel(PainnUpdateInputParams p) {
  start_after_prior_grid();
  int64_t n, f;
  const int64_t F = p.features;
  if (!element(p.nodes, F, n, f)) return;
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    const float w = load<T>(p.vv, at3(n, c, f, F));
    sum += w * w;
  }
  store<T>(p.input, n * 2 * F + f, load<T>(p.s, n * F + f));
  store<T>(p.input, n * 2 * F + F + f, sqrtf(sum + p.eps));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) update_input_backward_kernel(PainnUpdateInputBackwardParams p) {
  start_after_prior_grid();
  int64_t n, f;
  const int64_t F = p.features;
  if (!element(p.nodes, F, n, f)) return;
  float w[3], sum = 0.0f;
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    w[c] = load<T>(p.vv, at3(n, c, f, F));
    sum += w[c] * w[c];
  }
  const float scale = load<T>(p.grad, n * 2 * F + F + f) / sqrtf(sum + p.eps);
#pragma unroll
  for (int c = 0; c < 3; ++c) store<T>(p.grad_vv, at3(n, c, f, F), scale * w[c]);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) update_kernel(PainnUpdateParams p) {
  start_after_prior_grid();
  int64_t n, f;
  const int64_t F = p.features;
  if (!element(p.nodes, F, n, f)) return;
  const int64_t row = n * 3 * F + f;
  const float a_vv = load<T>(p.a, row), a_sv = load<T>(p.a, row + F), a_ss = load<T>(p.a, row + 2 * F);
  float dot = 0.0f;
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    const int64_t i = at3(n, c, f, F);
    const float u = load<T>(p.uv, i);
    dot += u * load<T>(p.vv, i);
    store<T>(p.v_out, i, load<T>(p.v, i) + a_vv * u);
  }
  store<T>(p.s_out, n * F + f, load<T>(p.s, n * F + f) + a_ss + a_sv * dot);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) update_backward_kernel(PainnUpdateBackwardParams p) {
  start_after_prior_grid();
  int64_t n, f;
  const int64_t F = p.features;
  if (!element(p.nodes, F, n, f)) return;
  const int64_t row = n * 3 * F + f;
  const float a_vv = load<T>(p.a, row), a_sv = load<T>(p.a, row + F);
  const float g_s = load<T>(p.grad_s, n * F + f), g_dot = g_s * a_sv;
  float dot = 0.0f, g_a_vv = 0.0f;
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    const int64_t i = at3(n, c, f, F);
    const float u = load<T>(p.uv, i), w = load<T>(p.vv, i), g_v = load<T>(p.grad_v, i);
    dot += u * w;
    g_a_vv += g_v * u;
    store<T>(p.grad_uv, i, g_v * a_vv + g_dot * w);
    store<T>(p.grad_vv, i, g_dot * u);
  }
  store<T>(p.grad_a, row, g_a_vv);
  store<T>(p.grad_a, row + F, g_s * dot);
  store<T>(p.grad_a, row + 2 * F, g_s);
}

// One launch over the N * F elements; `kernel(T{})` is the kernel for element type T.
template <typename Params, typename KernelOf>
cudaError_t launch(const Params& p, cudaStream_t stream, KernelOf kernel) {
  const int64_t elements = p.nodes * p.features;
  if (elements == 0) return cudaSuccess;
  const int64_t blocks = ceil_div(elements, kThreads);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  cudaError_t status = cudaSuccess;
  MIRAGE_DISPATCH_FLOAT(p.dtype, [&] {
    status = launch_overlapped(kernel(scalar_t{}), dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream, false, p);
  });
  return status;
}

}  // namespace

cudaError_t launch_painn_update_input(const PainnUpdateInputParams& params, cudaStream_t stream) {
  return launch(params, stream, [](auto t) { return update_input_kernel<decltype(t)>; });
}

cudaError_t launch_painn_update_input_backward(const PainnUpdateInputBackwardParams& params,
                                               cudaStream_t stream) {
  return launch(params, stream, [](auto t) { return update_input_backward_kernel<decltype(t)>; });
}

cudaError_t launch_painn_update(const PainnUpdateParams& params, cudaStream_t stream) {
  return launch(params, stream, [](auto t) { return update_kernel<decltype(t)>; });
}

cudaError_t launch_painn_update_backward(const PainnUpdateBackwardParams& params, cudaStream_t stream) {
  return launch(params, stream, [](auto t) { return update_backward_kernel<decltype(t)>; });
}

}  // namespace mirage::cuda
