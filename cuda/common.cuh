// Types shared by every kernel family and by the host code that calls the launchers.
// Host-includable: no device code and no torch here (ARCHITECTURE.md rule 1).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <cuda_runtime_api.h>

#include "kinds.h"

namespace mirage::cuda {

// The floating dtypes the kernels are built for. csrc/ maps at::ScalarType onto this.
enum class DType : int { kFloat32, kFloat16, kBFloat16 };

// The two GELU forms diffusers and PyTorch offer (F.gelu's approximate="none" / "tanh").
enum class GeluApprox : int { kNone, kTanh };

inline int dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// Whether launch_overlapped overlaps: on devices of compute capability 9.0 or later, unless the
// environment sets MIRAGE_OVERLAP_LAUNCHES=0 (read once a process; for measuring the overlap's gain
// and for ruling it out when hunting a bug). The whole-model ops' cluster kernel overlaps its own
// filters kernel regardless (atomwise::launch_cluster): the two are one op.
inline bool overlapped_launches() {
  static const bool allowed = [] {
    const char* env = std::getenv("MIRAGE_OVERLAP_LAUNCHES");
    return env == nullptr || std::string_view(env) != "0";
  }();
  // 0 unknown, 1 no, 2 yes; atomic, since launchers run on any thread (two that race both work
  // the answer out, the same one).
  static std::atomic<int> cached[64] = {};
  int device = 0, major = 0;
  cudaGetDevice(&device);
  const int known = device < 64 ? cached[device].load(std::memory_order_relaxed) : 0;
  if (known != 0) return known == 2;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  const bool overlap = allowed && major >= 9;
  if (device < 64) cached[device].store(overlap ? 2 : 1, std::memory_order_relaxed);
  return overlap;
}

// MIRAGE_CLUSTER_LIMIT=n in the environment (read once a process) caps the clusters of the
// whole-model kernels (schnet_energy, painn_energy) at n blocks; 1 runs them as one block with a
// plain launch, as below sm_90, so that that path can be tested and timed on Hopper. Any cap
// also keeps painn_energy's feature-split kernel (painn_split.cu, 16 blocks) off. 0 when unset or
// not a positive number (no cap).
inline int cluster_limit_from_env() {
  static const int limit = [] {
    const char* env = std::getenv("MIRAGE_CLUSTER_LIMIT");
    return env != nullptr ? std::max(0, std::atoi(env)) : 0;
  }();
  return limit;
}

// Whether the whole-model kernels run as thread-block clusters on the current device (compute
// capability 9.0 on, unless MIRAGE_CLUSTER_LIMIT=1), or as one block.
inline bool whole_model_clusters() {
  int device = 0, major = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  return major >= 9 && cluster_limit_from_env() != 1;
}

}  // namespace mirage::cuda
