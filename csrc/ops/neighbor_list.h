// mirage::neighbor_list: checks and the shape function shared by the CPU, Meta and CUDA kernels.
#pragma once

#include <optional>
#include <string_view>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace mirage::ops {

inline constexpr std::string_view kNeighborList = "mirage::neighbor_list";

// A periodic axis may be spanned by the cutoff at most this many times (cutoff / plane spacing):
// beyond it the image loops grow without bound, and a near-singular cell would never finish.
// The CPU kernel refuses such input; the CUDA kernel gets the limit and flags it.
inline constexpr double kNeighborListMaxReach = 32.0;

// Positions may lie at most 2^24 cell widths from the origin along a periodic axis: the CUDA
// kernel keeps image indices in float32, exact up to there.
inline constexpr double kNeighborListMaxCellWidths = 16777216.0;

struct NeighborListShape {
  int64_t num_atoms;      // N
  int64_t num_molecules;  // M: rows of cell (1 without batch or cell)
  int64_t max_pairs;      // P, with -1 resolved to N * (N - 1)
};

// Checks everything that does not need the tensors' values (shapes, dtypes, devices, scalars).
// Values (finite positions, a non-singular cell, a sorted batch) are checked by the CPU kernel
// and flagged on the device by the CUDA kernel.
NeighborListShape check_neighbor_list(const at::Tensor& positions, double cutoff,
                                      const std::optional<at::Tensor>& cell,
                                      const std::optional<at::Tensor>& pbc,
                                      const std::optional<at::Tensor>& batch, int64_t max_pairs,
                                      std::string_view method);

// (pairs [2, P] int64, shifts [P, 3], distances [P], num_pairs [1] int64), uninitialized.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> empty_neighbor_list_outputs(
    const at::Tensor& positions, const NeighborListShape& shape);

}  // namespace mirage::ops
