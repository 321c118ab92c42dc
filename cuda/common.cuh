// Types shared by every kernel family and by the host code that calls the launchers.
// Host-includable: no device code and no torch here (ARCHITECTURE.md rule 1).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "kinds.h"

namespace mirage::cuda {

// The floating dtypes the kernels are built for. csrc/ maps at::ScalarType onto this.
enum class DType : int { kFloat32, kFloat16, kBFloat16 };

// The two GELU forms diffusers and PyTorch offer (F.gelu's approximate="none" / "tanh").
enum class GeluApprox : int { kNone, kTanh };

inline int dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

}  // namespace mirage::cuda
