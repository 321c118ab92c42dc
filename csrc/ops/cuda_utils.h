// Shared by the *_cuda.cpp files: dtype mapping and the launch-status check.
#pragma once

#include <cstdint>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "../../cuda/common.cuh"
#include "../../cuda/radial_basis.cuh"
#include "kinds.h"
#include "message.h"

namespace mirage::ops {

inline cuda::DType to_kernel_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf: return cuda::DType::kFloat16;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    default: return cuda::DType::kFloat32;  // checks admit only float32 besides these on CUDA
  }
}

// Whether t's data starts on a 16-byte boundary (the kernels move rows as float4s).
inline bool is_16_byte_aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

inline const void* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr() : nullptr;
}

// Device scratch for a launcher, on x's device from the caching allocator (safe under graph capture).
inline at::Tensor workspace_for(size_t bytes, const at::Tensor& x) {
  return at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
}

inline void check_launch(std::string_view op, cudaError_t status) {
  MIRAGE_CHECK(status == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(status));
}

}  // namespace mirage::ops
