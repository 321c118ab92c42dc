// mirage::neighbor_list on CUDA: shape checks, device guard, current stream, workspace from the
// caching allocator, then the torch-free launcher. Nothing here reads tensor values (graph-safe).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../cuda/neighbor_list.cuh"
#include "checks.h"
#include "cuda_utils.h"
#include "neighbor_list.h"

namespace mirage::ops {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> neighbor_list_cuda(
    const at::Tensor& positions, double cutoff, const std::optional<at::Tensor>& cell,
    const std::optional<at::Tensor>& pbc, const std::optional<at::Tensor>& batch,
    int64_t max_pairs, bool half, c10::string_view method) {
  const NeighborListShape shape =
      check_neighbor_list(positions, cutoff, cell, pbc, batch, max_pairs, method);
  const c10::cuda::CUDAGuard guard(positions.device());
  const at::Tensor pos = positions.contiguous();
  const at::Tensor cell_c = contiguous_or_undefined(cell);
  const at::Tensor pbc_c = contiguous_or_undefined(pbc);
  const at::Tensor batch_c = contiguous_or_undefined(batch);
  auto [pairs, shifts, distances, num_pairs] = empty_neighbor_list_outputs(positions, shape);

  cuda::NeighborListParams params{};
  params.positions = pos.const_data_ptr<float>();
  params.cell = cell_c.defined() ? cell_c.const_data_ptr<float>() : nullptr;
  params.pbc = pbc_c.defined() ? pbc_c.const_data_ptr<bool>() : nullptr;
  params.pbc_stride = pbc_c.defined() && pbc_c.dim() == 2 ? 3 : 0;
  params.batch = batch_c.defined() ? batch_c.const_data_ptr<int64_t>() : nullptr;
  params.num_molecules = shape.num_molecules;
  params.num_atoms = shape.num_atoms;
  params.cutoff = static_cast<float>(cutoff);
  params.max_reach = static_cast<float>(kNeighborListMaxReach);
  params.max_pairs = shape.max_pairs;
  params.half = half;
  params.search = method == "direct"      ? cuda::NeighborSearch::kDirect
                  : method == "cell_list" ? cuda::NeighborSearch::kCellList
                                          : cuda::NeighborSearch::kAuto;
  params.pairs = pairs.mutable_data_ptr<int64_t>();
  params.shifts = shifts.mutable_data_ptr<float>();
  params.distances = distances.mutable_data_ptr<float>();
  params.num_pairs = num_pairs.mutable_data_ptr<int64_t>();

  const at::Tensor workspace = workspace_for(cuda::neighbor_list_workspace_bytes(params), positions);
  check_launch(kNeighborList, cuda::launch_neighbor_list(params, workspace.mutable_data_ptr(),
                                                         c10::cuda::getCurrentCUDAStream()));
  return {pairs, shifts, distances, num_pairs};
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) { m.impl("neighbor_list", &neighbor_list_cuda); }

}  // namespace mirage::ops
