// Device helpers shared by the kernel families: dtype dispatch, conversions, vector access,
// reductions. Included by .cu files only.
#pragma once

#include <algorithm>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "pair_order.cuh"

// Runs BODY with scalar_t bound to the C++ type of DTYPE. The one dispatch macro of cuda/.
#define MIRAGE_DISPATCH_FLOAT(DTYPE, ...)                  \
  switch (DTYPE) {                                         \
    case ::mirage::cuda::DType::kFloat32: {                \
      using scalar_t = float;                              \
      __VA_ARGS__();                                       \
      break;                                               \
    }                                                      \
    case ::mirage::cuda::DType::kFloat16: {                \
      using scalar_t = __half;                             \
      __VA_ARGS__();                                       \
      break;                                               \
    }                                                      \
    case ::mirage::cuda::DType::kBFloat16: {               \
      using scalar_t = __nv_bfloat16;                      \
      __VA_ARGS__();                                       \
      break;                                               \
    }                                                      \
  }

namespace mirage::cuda {

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// out[0 .. V) += v. With V = 4 (out 16-byte aligned, as the callers ensure) Hopper adds the four
// in one vector atomic: a quarter of the atomic requests, which bound the scatter. Older GPUs get
// four scalar atomics from their own code path of this fat binary.
template <int V>
__device__ __forceinline__ void atomic_add(float* out, const float (&v)[V]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kVector = V == 4;
#else
  constexpr bool kVector = false;
#endif
  if constexpr (kVector) {
    atomicAdd(reinterpret_cast<float4*>(out), make_float4(v[0], v[1], v[2], v[3]));
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) atomicAdd(out + e, v[e]);
  }
}

// V elements of T moved as one access: 16 bytes when V * sizeof(T) == 16.
template <typename T, int V>
struct alignas(sizeof(T) * V) Packed {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ void load_packed(const T* p, float (&out)[V]) {
  const Packed<T, V> packed = *reinterpret_cast<const Packed<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = to_float(packed.v[i]);
}

template <typename T, int V>
__device__ __forceinline__ void store_packed(T* p, const float (&in)[V]) {
  Packed<T, V> packed;
#pragma unroll
  for (int i = 0; i < V; ++i) packed.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Packed<T, V>*>(p) = packed;
}

// The widest vector (16 bytes) for T; kernels fall back to 1 when pointers or sizes do not allow it.
template <typename T>
constexpr int kPackWidth = 16 / sizeof(T);

// Buffers laid end to end in one workspace, each 256-byte aligned. On base == nullptr it only
// sizes them, so that a launcher's *_workspace_bytes and its launch share one plan.
class WorkspaceLayout {
 public:
  explicit WorkspaceLayout(char* base) : base_(base) {}
  // The next buffer of `bytes` (nullptr when only sizing).
  void* take(size_t bytes) {
    offset_ = (offset_ + 255) / 256 * 256;
    void* at = base_ == nullptr ? nullptr : base_ + offset_;
    offset_ += bytes;
    return at;
  }
  size_t bytes() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

inline bool is_aligned(const void* p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One thread per vector of a [rows, row_vecs] grid of V-wide vectors, no division: a row in the
// fewest tiles of <= `threads` threads (blockIdx.x), spread evenly over them; then as many whole
// rows a block as fit (threadIdx.y), rows past gridDim.y's limit going on in blockIdx.z. Measured
// on an H200 for GEGLU (cuda/geglu.cu) against a grid-stride loop over a flat index.
struct RowGrid {
  dim3 grid, block;
  bool valid;  // false past 65535 x 65535 row blocks

  // Whether every thread's (row, column) and offsets up to `elements` fit in an int: the grid
  // covers whole blocks, so its rows and columns run past the tensor's.
  bool fits_int(int64_t elements) const {
    const int64_t rows = int64_t{grid.y} * grid.z * block.y, cols = int64_t{grid.x} * block.x;
    return elements <= INT32_MAX && rows <= INT32_MAX && cols <= INT32_MAX;
  }
};

// A row split in several tiles is split, where it can be, into the fewest whole warps with no idle
// lane (up to twice the fewest tiles): GEGLU's rows of 640 vectors took 5.90 us at 512x10240 on an
// H200 in 3 tiles of 214 threads, 5.78 in the 4 tiles of 160 this picks (5 of 128: 5.73 in the
// same sweep, docs/perf/norms.md).
inline RowGrid row_grid(int64_t rows, int64_t row_vecs, int threads) {
  constexpr int64_t kMaxGridYZ = 65535;
  int64_t tiles = ceil_div(row_vecs, threads);
  if (tiles > 1) {
    for (int64_t whole = tiles; whole <= 2 * tiles; ++whole) {
      if (row_vecs % whole == 0 && row_vecs / whole % 32 == 0) {
        tiles = whole;
        break;
      }
    }
  }
  const int tx = static_cast<int>(ceil_div(row_vecs, tiles));
  const int ty = tiles == 1 ? threads / tx : 1;
  const int64_t row_blocks = ceil_div(rows, ty);
  const int64_t grid_y = std::min(row_blocks, kMaxGridYZ), grid_z = ceil_div(row_blocks, grid_y);
  return {dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(grid_y), static_cast<unsigned>(grid_z)),
          dim3(tx, ty), grid_z <= kMaxGridYZ};
}

// This thread's (row, vector in the row) of a row_grid launch.
template <typename Index>
__device__ __forceinline__ Index grid_row() {
  return (static_cast<Index>(blockIdx.z) * gridDim.y + blockIdx.y) * blockDim.y + threadIdx.y;
}
template <typename Index>
__device__ __forceinline__ Index grid_col() {
  return static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// Multiprocessors of the current device: grids are sized to fill them.
inline int sm_count() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms > 0 ? sms : 1;
}

// Programmatic dependent launch (sm_90 and later). A kernel started by launch_overlapped may
// begin while the kernel ahead of it in the stream is still finishing: its launch and block
// start-up hide behind that kernel's tail, which in a chain of short kernels (the norms of a
// U-Net, a CUDA graph of them) is a good part of each one's time. Such a kernel must call
// start_after_prior_grid() before it touches global memory: the kernel ahead may still be reading
// what this one writes (the caching allocator hands a freed block straight to the next op) or
// writing what it reads.

// A cudaLaunchKernelEx configuration with its attributes: a cluster, a cooperative grid, an
// overlapped start. The one place launch attributes are built (launch_overlapped, the force-field
// clusters). Copyable: get() points the configuration at this copy's attributes.
class LaunchConfig {
 public:
  LaunchConfig(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream) {
    config_.gridDim = grid;
    config_.blockDim = block;
    config_.dynamicSmemBytes = shared_bytes;
    config_.stream = stream;
  }
  // The whole grid (a 1-D one) as one cluster.
  LaunchConfig& one_cluster() {
    cudaLaunchAttribute& a = add(cudaLaunchAttributeClusterDimension);
    a.val.clusterDim.x = config_.gridDim.x;
    a.val.clusterDim.y = a.val.clusterDim.z = 1;
    return *this;
  }
  // Every block resident at once, for a grid barrier.
  LaunchConfig& cooperative() {
    add(cudaLaunchAttributeCooperative).val.cooperative = 1;
    return *this;
  }
  // Programmatic dependent launch: see start_after_prior_grid.
  LaunchConfig& overlapped() {
    add(cudaLaunchAttributeProgrammaticStreamSerialization).val.programmaticStreamSerializationAllowed = 1;
    return *this;
  }
  const cudaLaunchConfig_t* get() {
    config_.attrs = attrs_;
    return &config_;
  }
  template <typename... Params, typename... Args>
  cudaError_t launch(void (*kernel)(Params...), Args&&... args) {
    return cudaLaunchKernelEx(get(), kernel, std::forward<Args>(args)...);
  }

 private:
  cudaLaunchAttribute& add(cudaLaunchAttributeID id) {
    cudaLaunchAttribute& a = attrs_[config_.numAttrs++];
    a.id = id;
    return a;
  }
  cudaLaunchConfig_t config_{};
  cudaLaunchAttribute attrs_[3]{};
};

// Launches kernel<<<grid, block, shared, stream>>>(args...), overlapped with the kernel ahead where
// the device allows it. `cooperative`: all blocks resident at once, for a grid barrier.
template <typename... Params, typename... Args>
cudaError_t launch_overlapped(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared,
                              cudaStream_t stream, bool cooperative, Args&&... args) {
  LaunchConfig config(grid, block, shared, stream);
  if (cooperative) config.cooperative();
  if (overlapped_launches()) config.overlapped();
  const cudaError_t status = config.launch(kernel, std::forward<Args>(args)...);
  // Clear a failed launch's error, as cudaGetLastError did after a <<<>>> launch: the op reports
  // this status, and a pending error would otherwise surface in the next op's launch check.
  if (status != cudaSuccess) cudaGetLastError();
  return status;
}

// The dynamic shared memory the running block was launched with, in floats.
__device__ __forceinline__ int dynamic_shared_floats() {
  unsigned bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return static_cast<int>(bytes / sizeof(float));
}

// Waits until the kernel ahead in the stream has finished and its writes are visible (a no-op in
// a kernel not launched overlapped, and below sm_90).
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the kernel behind this one in the stream launch now (it waits in wait_for_prior_grid).
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// The first statement of an overlapped kernel: the kernel ahead is done, the kernel behind may
// start (after the wait, so that at most one grid waits behind a running one).
__device__ __forceinline__ void start_after_prior_grid() {
  wait_for_prior_grid();
  allow_next_grid();
}

// cp.async (sm_80 and later) of `bytes` (4, or 16 with both addresses 16-byte aligned) from global
// to shared memory; where !valid, that many zero bytes (the source is not read, but must be a
// valid address). The data is there after wait_copies (or commit_copies, then cp.async.wait_group),
// whose "memory" clobber orders the reads after it; the copy itself orders nothing.
__device__ __forceinline__ void copy_async(float* to, const float* from, int bytes, bool valid = true) {
  const unsigned shared = static_cast<unsigned>(__cvta_generic_to_shared(to));
  const int read = valid ? bytes : 0;
  if (bytes == 16)  // .cg: through L2 only (16 bytes only)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared), "l"(from), "r"(read));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(shared), "l"(from), "r"(read));
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;"); }

__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// The shared memory one block of the current device may opt in to, in bytes.
inline size_t max_shared_bytes_per_block() {
  int device = 0, bytes = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  return static_cast<size_t>(bytes);
}

// How many blocks of `threads` threads with `shared` bytes of dynamic shared memory fit on the
// current device at once (one wave; at least one a multiprocessor), after opting the kernel in to
// that much shared memory. Grids of this size whose blocks walk the work stage per-block data
// once per block.
template <typename Kernel>
cudaError_t blocks_per_wave(Kernel kernel, int threads, size_t shared, int64_t& blocks) {
  cudaError_t status =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
  int per_sm = 0;
  if (status == cudaSuccess) status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared);
  blocks = static_cast<int64_t>(std::max(per_sm, 1)) * sm_count();
  return status;
}

// Affine parameters (weight, bias) may be stored in the activation dtype or in float32
// (mixed-precision models keep them in float32); a null pointer means "absent".
__device__ __forceinline__ float load_param(const void* p, DType dtype, int64_t i, float absent) {
  if (p == nullptr) return absent;
  switch (dtype) {
    case DType::kFloat16: return __half2float(static_cast<const __half*>(p)[i]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// v * sigmoid(v) with the hardware's approximate division (2 ulp). Against an IEEE reciprocal, on
// an H200 (2026-11-23, bench_norms): bias_act 2x960x64x64 15.6 -> 14.4 us, group_norm+silu
// 2x1280x16x16 NCHW 8.6 -> 7.1 us. Very negative v gives -0 rather than NaN: the approximate
// reciprocal of +inf, and of anything above 2^126, is 0.
__device__ __forceinline__ float silu(float v) { return __fdividef(v, 1.0f + __expf(-v)); }

// silu of a result stored as T. 16-bit types take 0.5 v (1 + tanh(v / 2)) on the special-function
// unit's tanh (one MUFU.TANH, relative error at most 1.1e-5, instead of an exponential and a
// reciprocal), which sped up group_norm's fused and channels-last passes (H200, 2026-11-24,
// docs/perf/norms.md; not every kernel gains: see group_norm.cu's activate). Its error, at most
// 5.6e-6 |v|, is below half an fp16 ulp of the result for v > -3.7 and far below the ulp of values
// near 1 everywhere. float32 results keep silu(). silu(-inf) is NaN, as in PyTorch.
template <typename T>
__device__ __forceinline__ float silu_as(float v) {
  if constexpr (sizeof(T) == 2) {
    const float half_v = 0.5f * v;
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(half_v));
    return fmaf(half_v, t, half_v);
  } else {
    return silu(v);
  }
}

__device__ __forceinline__ float gelu(float v, GeluApprox approximate) {
  if (approximate == GeluApprox::kTanh) {
    const float inner = 0.7978845608028654f * (v + 0.044715f * v * v * v);  // sqrt(2/pi)
    return 0.5f * v * (1.0f + tanhf(inner));
  }
  return 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));  // 1/sqrt(2)
}

// F.softplus (beta 1, threshold 20: the identity above it).
__device__ __forceinline__ float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

__device__ __forceinline__ float activate(float v, Activation activation) {
  switch (activation) {
    case Activation::kSilu: return silu(v);
    case Activation::kGelu: return gelu(v, GeluApprox::kNone);
    case Activation::kGeluTanh: return gelu(v, GeluApprox::kTanh);
    case Activation::kRelu: return v > 0.0f ? v : (v == v ? 0.0f : v);  // NaN stays NaN, as torch.relu
    case Activation::kTanh: return tanhf(v);
    case Activation::kSoftplus: return softplus(v);
    case Activation::kShiftedSoftplus: return softplus(v) - 0.6931471805599453f;  // log 2
    default: return v;
  }
}

// d activate(v) / dv, as PyTorch's backward formulas compute it.
__device__ __forceinline__ float activation_grad(float v, Activation activation) {
  switch (activation) {
    case Activation::kSilu: {
      const float s = 1.0f / (1.0f + expf(-v));
      return s * (1.0f + v * (1.0f - s));
    }
    case Activation::kGelu:  // Phi(v) + v phi(v)
      return 0.5f * (1.0f + erff(v * 0.7071067811865476f)) + v * 0.3989422804014327f * expf(-0.5f * v * v);
    case Activation::kGeluTanh: {
      const float inner = 0.7978845608028654f * (v + 0.044715f * v * v * v), t = tanhf(inner);
      return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 0.134145f * v * v);
    }
    case Activation::kRelu: return v > 0.0f ? 1.0f : 0.0f;
    case Activation::kTanh: {
      const float t = tanhf(v);
      return 1.0f - t * t;
    }
    case Activation::kSoftplus:
    case Activation::kShiftedSoftplus: return v > 20.0f ? 1.0f : 1.0f / (1.0f + expf(-v));
    default: return 1.0f;
  }
}

// Sum over each aligned group of kLanes lanes (a power of two, at most 32) of a warp whose lanes
// all take part; every lane gets its group's sum. V: float, or an integer type (exact sums).
template <int kLanes = 32, typename V = float>
__device__ __forceinline__ V warp_sum(V v) {
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "kLanes: a power of two <= 32");
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Two sums at once, in the same order as two warp_sum calls.
__device__ __forceinline__ float2 warp_sum(float2 v) { return make_float2(warp_sum(v.x), warp_sum(v.y)); }

// Sum of (v - mean)^2 over the rows k of vals for which counted(k) holds: the second pass of
// exact two-pass statistics over values a thread keeps in registers.
template <int K, int V, typename Counted>
__device__ __forceinline__ float squared_deviations(const float (&vals)[K][V], float mean, Counted counted) {
  float m2 = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float d = vals[k][i] - mean;
      m2 += counted(k) ? d * d : 0.0f;
    }
  return m2;
}

// Sum over all threads of a 1-D block whose size is a multiple of 32, of a float, a float2 or an
// integer. scratch: >= 32 of them. Every thread gets the result; scratch may be reused right after.
template <typename V>
__device__ __forceinline__ V block_sum(V v, V* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : V{};
  v = warp_sum(v);
  __syncthreads();
  return v;
}

// Count, mean and sum of squared deviations of a set of values: merged exactly (Chan et al.),
// so partial statistics of chunks combine without the cancellation of sum / sum-of-squares.
struct Moments {
  float count, mean, m2;
};

__device__ __forceinline__ Moments merge(Moments a, Moments b) {
  // An empty side must not reach delta * delta * 0: with |mean| near FLT_MAX that is inf * 0.
  if (b.count == 0.0f) return a;
  if (a.count == 0.0f) return b;
  const float count = a.count + b.count;
  const float delta = b.mean - a.mean;
  const float share_b = b.count / count;
  return {count, a.mean + delta * share_b, a.m2 + b.m2 + delta * delta * a.count * share_b};
}

__device__ __forceinline__ Moments warp_merge(Moments m) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Moments other{__shfl_xor_sync(0xffffffffu, m.count, offset),
                        __shfl_xor_sync(0xffffffffu, m.mean, offset),
                        __shfl_xor_sync(0xffffffffu, m.m2, offset)};
    m = merge(m, other);
  }
  return m;
}

// Merge over a 1-D block (size a multiple of 32). scratch: >= 32 Moments. Every thread gets it.
__device__ __forceinline__ Moments block_merge(Moments m, Moments* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  m = warp_merge(m);
  if (lane == 0) scratch[warp] = m;
  __syncthreads();
  m = lane < warps ? scratch[lane] : Moments{0.0f, 0.0f, 0.0f};
  m = warp_merge(m);
  __syncthreads();
  return m;
}

// The pairs a pass walks (sender_order.h's walked_pairs of the caller's device count `live`):
// all num_pairs without one.
__device__ __forceinline__ int64_t pairs_to_walk(const int64_t* live, int64_t num_pairs) {
  return live != nullptr ? walked_pairs(*live, num_pairs) : num_pairs;
}

// Whether a handed-in sender order failed its check (pair_order.cuh): its balances do not sum
// to 0. The block's first warp adds them up; every thread of the block calls it (a barrier).
__device__ inline bool order_rejected(const OrderCheck& check) {
  __shared__ bool rejected;
  if (threadIdx.x < 32) {
    unsigned long long total = 0;
    for (int b = threadIdx.x; b < check.count; b += 32) total += check.balances[b];
    total = warp_sum(total);
    if (threadIdx.x == 0) rejected = total != 0;
  }
  __syncthreads();
  return rejected;
}

// Zeros out[0 .. count) over the (two-dimensional) grid: 16-byte stores, with single elements
// before the first 16-byte boundary and after the last.
template <typename T>
__device__ void grid_zero(T* out, int64_t count) {
  constexpr int kPerVector = 16 / sizeof(T);
  const int64_t block_threads = static_cast<int64_t>(blockDim.x) * blockDim.y;
  const int64_t id = (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * block_threads +
                     threadIdx.y * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * gridDim.y * block_threads;
  const int64_t head =
      std::min<int64_t>(count, (16 - reinterpret_cast<uintptr_t>(out) % 16) % 16 / sizeof(T));
  const int64_t vectors = (count - head) / kPerVector, tail = count - head - kPerVector * vectors;
  if (id < head) out[id] = from_float<T>(0.0f);
  float4* body = reinterpret_cast<float4*>(out + head);
  for (int64_t v = id; v < vectors; v += threads) body[v] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (id < tail) out[head + kPerVector * vectors + id] = from_float<T>(0.0f);
}

// The padding's rows (pairs from `walked` on, pairs_to_walk) of a per-pair output, per_pair values
// a pair: zeros, written by the kernel that skips those pairs while its first loads are in flight
// rather than by a pass of their own (SchNet's filters at 3,000 atoms: 17.8 MB; PaiNN's
// grad_filter 53 MB).
template <typename T>
__device__ void zero_padding(T* out, int64_t walked, int64_t num_pairs, int64_t per_pair) {
  grid_zero(out + walked * per_pair, (num_pairs - walked) * per_pair);
}

// The last pass of kernels that accumulate in float32 and flag invalid input on the device (no
// host sync): up to four outputs, each with where its values are: `acc` holds them in float32
// (converted into `out`), or is null when `out` already holds them (float32 outputs, per-pair
// gradients; a pass that skips the padding writes its zeros itself, zero_padding). A raised flag, or
// a handed-in sender order that failed its check, turns every output NaN.
struct Segment {
  const float* acc;
  void* out;
  int64_t count;
};

struct Segments {
  Segment s[4];  // unused ones have count 0
};

template <typename T>
__global__ void __launch_bounds__(256) finish_kernel(Segments segments, const int* invalid, OrderCheck check) {
  start_after_prior_grid();
  const bool rejected = order_rejected(check);  // a barrier: every thread, before any other test
  const bool bad = *invalid != 0 || rejected;
  const T nan = from_float<T>(__int_as_float(0x7fc00000));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // unrolled: a constant index keeps the segments in parameter space
    const Segment s = segments.s[k];
    if (s.acc == nullptr && !bad) continue;  // nothing to convert and nothing to poison
    T* out = static_cast<T*>(s.out);
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < s.count; e += stride)
      out[e] = bad ? nan : from_float<T>(s.acc[e]);
  }
}

template <typename T>
cudaError_t launch_finish(const Segments& segments, const int* invalid, cudaStream_t stream,
                          const OrderCheck& check = {}) {
  int64_t largest = 0;
  for (const Segment& s : segments.s) largest = std::max(largest, s.count);
  const int64_t blocks = std::clamp<int64_t>(ceil_div(largest, 256), 1, 4LL * sm_count());
  return launch_overlapped(finish_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, stream, false, segments,
                           invalid, check);
}

}  // namespace mirage::cuda
