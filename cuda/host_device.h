// MIRAGE_HOST_DEVICE marks functions that CUDA kernels and host code both call, in headers free of
// CUDA and torch headers (CPU-only builds include them too).
#pragma once

#if defined(__CUDACC__)
#define MIRAGE_HOST_DEVICE __host__ __device__
#else
#define MIRAGE_HOST_DEVICE
#endif
