// GEGLU: one pass, 16-byte accesses when the half width and pointers allow it.
#include <cstdint>

#include "geglu.cuh"
#include "kernel_utils.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 256;

// One V-vector of a row a thread in a row_grid launch (no division); Index is int when the grid
// and x fit in one. The GELU form is a template argument: chosen at run time, element by element,
// it cost 5% (H200, fp16 8192x2560: 18.59 us against 17.49).
template <typename T, int V, typename Index, GeluApprox kApprox>
__global__ void __launch_bounds__(kThreads) geglu_kernel(GegluParams p, Index row_vecs) {
  start_after_prior_grid();
  const Index col = grid_col<Index>(), row = grid_row<Index>();
  if (col >= row_vecs || row >= p.rows) return;
  const Index half = static_cast<Index>(p.half_dim);
  const T* x = static_cast<const T*>(p.x) + row * 2 * half + col * V;
  float value[V], gate[V];
  load_packed<T, V>(x, value);
  load_packed<T, V>(x + half, gate);
#pragma unroll
  for (int j = 0; j < V; ++j) value[j] *= gelu(gate[j], kApprox);
  store_packed<T, V>(static_cast<T*>(p.y) + row * half + col * V, value);
}

template <typename T, int V, typename Index>
cudaError_t launch_kernel(const GegluParams& p, Index row_vecs, dim3 grid, dim3 block,
                          cudaStream_t stream) {
  return launch_overlapped(p.approximate == GeluApprox::kTanh ? geglu_kernel<T, V, Index, GeluApprox::kTanh>
                                                              : geglu_kernel<T, V, Index, GeluApprox::kNone>,
                           grid, block, 0, stream, false, p, row_vecs);
}

template <typename T, int V>
cudaError_t launch_with(const GegluParams& p, cudaStream_t stream) {
  // The row grid against the former grid-stride kernel with a 64-bit division, fp16 on an H200
  // (the sweep of docs/perf/norms.md), us: 8192x2560 19.45 -> 17.30, 2048x5120 10.84 -> 9.62, 512x10240
  // 6.28 -> 6.02. In the sweep 2 or 4 vectors a thread and cache hints were slower, and 128-thread
  // tiles won only at 512x10240 (5.73 against 5.98) and lost at the others (19.76, 11.18).
  const int64_t row_vecs = p.half_dim / V;
  const RowGrid g = row_grid(p.rows, row_vecs, kThreads);
  if (!g.valid) return cudaErrorInvalidValue;  // > 4e9 rows
  return g.fits_int(p.rows * 2 * p.half_dim) ? launch_kernel<T, V>(p, static_cast<int>(row_vecs), g.grid, g.block, stream)
                                             : launch_kernel<T, V>(p, row_vecs, g.grid, g.block, stream);
}

}  // namespace

cudaError_t launch_geglu(const GegluParams& params, cudaStream_t stream) {
  if (params.rows == 0 || params.half_dim == 0) return cudaSuccess;
  cudaError_t status = cudaSuccess;
  MIRAGE_DISPATCH_FLOAT(params.dtype, [&] {
    constexpr int kPack = kPackWidth<scalar_t>;
    const bool packed =
        params.half_dim % kPack == 0 && is_aligned(params.x, 16) && is_aligned(params.y, 16);
    status = packed ? launch_with<scalar_t, kPack>(params, stream)
                    : launch_with<scalar_t, 1>(params, stream);
  });
  return status;
}

}  // namespace mirage::cuda
