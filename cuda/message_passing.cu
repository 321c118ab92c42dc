// Message passing: a scatter with float32 atomics, correct for pairs in any order. Each thread
// owns V features of a run of consecutive pairs and keeps a running sum while the receiver stays
// the same, adding it to the output only when the receiver changes: for the receiver-sorted lists
// of mirage::neighbor_list that is one atomic per V features per run instead of one per pair, and
// for unsorted pairs it degrades to one per pair, never to a wrong sum.
// Pair product: one thread per V features of one pair, a gather and a product.
#include <algorithm>
#include <cmath>

#include "kernel_utils.cuh"
#include "message_passing.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 256;
// The flag sits in the first 16 bytes of the workspace, the float32 accumulator after it (aligned).
constexpr size_t kAccumOffset = 16;
// Pairs one thread sums over before it must add to the output (at most).
constexpr int kMaxRun = 32;

__device__ __forceinline__ bool valid_index(int64_t v, int64_t n) { return v >= 0 && v < n; }

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    message_passing_scatter_kernel(MessagePassingParams p, float* accum, int* invalid, int run) {
  start_after_prior_grid();
  const T* x = static_cast<const T*>(p.x);            // [num_nodes, features]
  const T* filter = static_cast<const T*>(p.filter);  // [num_pairs, features]
  const int64_t* receivers = p.pairs;                 // [num_pairs]
  const int64_t* senders = p.pairs + p.num_pairs;     // [num_pairs]
  const int64_t groups = p.features / V;
  const int64_t tasks = ceil_div(p.num_pairs, run) * groups;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < tasks;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t chunk = t / groups;
    const int64_t f = (t - chunk * groups) * V;
    const int64_t begin = chunk * run;
    const int64_t end = std::min<int64_t>(begin + run, p.num_pairs);
    float sum[V] = {};
    int64_t row = -1;
    for (int64_t q = begin; q < end; ++q) {
      const int64_t i = receivers[q], j = senders[q];
      if (!valid_index(i, p.num_nodes) || !valid_index(j, p.num_nodes)) {
        *invalid = 1;  // every writer stores the same value: no atomic needed
        continue;
      }
      if (i != row) {
        if (row >= 0) {
#pragma unroll
          for (int v = 0; v < V; ++v) atomicAdd(accum + row * p.features + f + v, sum[v]);
        }
        row = i;
#pragma unroll
        for (int v = 0; v < V; ++v) sum[v] = 0.0f;
      }
      float xv[V], wv[V];
      load_packed<T, V>(x + j * p.features + f, xv);
      load_packed<T, V>(filter + q * p.features + f, wv);
#pragma unroll
      for (int v = 0; v < V; ++v) sum[v] = fmaf(xv[v], wv[v], sum[v]);
    }
    if (row >= 0) {
#pragma unroll
      for (int v = 0; v < V; ++v) atomicAdd(accum + row * p.features + f + v, sum[v]);
    }
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) pair_product_kernel(PairProductParams p) {
  start_after_prior_grid();
  const T* a = static_cast<const T*>(p.a);  // [num_nodes, features]
  const T* b = static_cast<const T*>(p.b);  // [num_nodes, features]
  T* out = static_cast<T*>(p.out);          // [num_pairs, features]
  const int64_t groups = p.features / V;
  const int64_t tasks = p.num_pairs * groups;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < tasks;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t q = t / groups;
    const int64_t f = (t - q * groups) * V;
    const int64_t i = p.pairs[q], j = p.pairs[p.num_pairs + q];
    float product[V];
    if (valid_index(i, p.num_nodes) && valid_index(j, p.num_nodes)) {
      float av[V], bv[V];
      load_packed<T, V>(a + i * p.features + f, av);
      load_packed<T, V>(b + j * p.features + f, bv);
#pragma unroll
      for (int v = 0; v < V; ++v) product[v] = av[v] * bv[v];
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) product[v] = NAN;
    }
    store_packed<T, V>(out + q * p.features + f, product);
  }
}

unsigned grid_for(int64_t tasks) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(tasks, kThreads),
                                                                      8LL * sm_count())));
}

// The longest run (a power of two up to kMaxRun) that still leaves about one thread per resident
// slot of the GPU: long runs save atomics, short ones keep small systems (benzene) parallel.
int run_length(int64_t num_pairs, int64_t groups) {
  const int64_t target = 2048LL * sm_count();
  int run = 1;
  while (run < kMaxRun && ceil_div(num_pairs, 2LL * run) * groups >= target) run *= 2;
  return run;
}

template <typename T>
bool vectorizable(int64_t features, std::initializer_list<const void*> pointers) {
  if (features % kPackWidth<T> != 0) return false;
  for (const void* ptr : pointers)
    if (!is_aligned(ptr, 16)) return false;
  return true;
}

}  // namespace

size_t message_passing_workspace_bytes(int64_t num_nodes, int64_t features, DType dtype) {
  const size_t accum = dtype == DType::kFloat32 ? 0 : static_cast<size_t>(num_nodes * features) * 4;
  return kAccumOffset + accum;
}

cudaError_t launch_message_passing(const MessagePassingParams& params, cudaStream_t stream) {
  const int64_t total = params.num_nodes * params.features;
  if (total == 0) return cudaSuccess;
  char* workspace = static_cast<char*>(params.workspace);
  int* invalid = reinterpret_cast<int*>(workspace);
  float* accum = params.dtype == DType::kFloat32 ? static_cast<float*>(params.out)
                                                 : reinterpret_cast<float*>(workspace + kAccumOffset);
  cudaError_t status =
      cudaMemsetAsync(workspace, 0, message_passing_workspace_bytes(params.num_nodes, params.features,
                                                                    params.dtype), stream);
  if (status != cudaSuccess) return status;
  if (params.dtype == DType::kFloat32) {
    status = cudaMemsetAsync(params.out, 0, static_cast<size_t>(total) * sizeof(float), stream);
    if (status != cudaSuccess) return status;
  }
  MIRAGE_DISPATCH_FLOAT(params.dtype, [&] {
    constexpr int V = kPackWidth<scalar_t>;
    if (params.num_pairs > 0) {
      if (vectorizable<scalar_t>(params.features, {params.x, params.filter})) {
        const int run = run_length(params.num_pairs, params.features / V);
        status = launch_overlapped(message_passing_scatter_kernel<scalar_t, V>,
                                   grid_for(ceil_div(params.num_pairs, run) * (params.features / V)), dim3(kThreads),
                                   0, stream, false, params, accum, invalid, run);
      } else {
        const int run = run_length(params.num_pairs, params.features);
        status = launch_overlapped(message_passing_scatter_kernel<scalar_t, 1>,
                                   grid_for(ceil_div(params.num_pairs, run) * params.features), dim3(kThreads), 0,
                                   stream, false, params, accum, invalid, run);
      }
      if (status != cudaSuccess) return;
    }
    // float16/bfloat16: the float32 accumulator into out; float32 (accum is out): nothing to
    // convert. Either way an invalid pair anywhere makes every output NaN.
    const bool float32 = params.dtype == DType::kFloat32;
    status = launch_finish<scalar_t>(Segments{{{float32 ? nullptr : accum, params.out, total}}}, invalid, stream);
  });
  return status;
}

cudaError_t launch_pair_product(const PairProductParams& params, cudaStream_t stream) {
  if (params.num_pairs == 0 || params.features == 0) return cudaSuccess;
  cudaError_t status = cudaSuccess;
  MIRAGE_DISPATCH_FLOAT(params.dtype, [&] {
    constexpr int V = kPackWidth<scalar_t>;
    const bool packed = vectorizable<scalar_t>(params.features, {params.a, params.b, params.out});
    status = packed ? launch_overlapped(pair_product_kernel<scalar_t, V>, grid_for(params.num_pairs * (params.features / V)),
                                        dim3(kThreads), 0, stream, false, params)
                    : launch_overlapped(pair_product_kernel<scalar_t, 1>, grid_for(params.num_pairs * params.features),
                                        dim3(kThreads), 0, stream, false, params);
  });
  return status;
}

}  // namespace mirage::cuda
