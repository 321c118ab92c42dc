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

}  // namespace

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
    kernel<<<static_cast<unsigned>(blocks), kWarps * 32, shared, stream>>>(p);
    status = cudaGetLastError();
  });
  return status;
}

}  // namespace mirage::cuda
