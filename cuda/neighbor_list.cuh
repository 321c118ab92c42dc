// Neighbor-list launchers: every pair (i, j, image) with |r_j - r_i + shift| < cutoff, written into
// fixed-capacity outputs with the true count on the device (graph-safe). Host-includable.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

// How the CUDA path searches: every pair of a molecule (warp per atom), or a cell list (atoms
// binned by a sort on the GPU). kAuto picks by size; batched molecules always go direct.
enum class NeighborSearch : int { kAuto, kDirect, kCellList };

struct NeighborListParams {
  const float* positions;  // [N, 3] contiguous
  const float* cell;       // [M, 3, 3] contiguous, rows are the lattice vectors; nullptr: open
  const bool* pbc;         // [M, 3] (pbc_stride 3) or [3] (pbc_stride 0); nullptr: all periodic
  int64_t pbc_stride;
  const int64_t* batch;    // [N] molecule of each atom, sorted; nullptr: one molecule
  int64_t num_molecules;   // M: rows of cell (1 without batch)
  int64_t num_atoms;       // N
  float cutoff;            // > 0
  float max_reach;         // a periodic axis may be spanned <= max_reach times by the cutoff
  int64_t max_pairs;       // P: capacity of the outputs
  bool half;               // keep one of (i, j, S) and (j, i, -S)
  NeighborSearch search;
  int64_t* pairs;          // [2, P]: row 0 the center atom i, row 1 the neighbor j
  float* shifts;           // [P, 3]: S @ cell, with S the integer image of j
  float* distances;        // [P]: |r_j - r_i + shift|
  int64_t* num_pairs;      // [1]: the true count (may exceed P); -1 for invalid geometry
};

// kDirect or kCellList: what launch_neighbor_list runs for these params.
NeighborSearch resolve_neighbor_search(const NeighborListParams& params);

// Bytes of device scratch launch_neighbor_list needs (from the shapes only).
size_t neighbor_list_workspace_bytes(const NeighborListParams& params);

// Launches on `stream` into the current device; `workspace` holds neighbor_list_workspace_bytes.
// No host synchronization. Returns the launch status (cudaGetLastError after the last launch).
cudaError_t launch_neighbor_list(const NeighborListParams& params, void* workspace,
                                 cudaStream_t stream);

}  // namespace mirage::cuda
