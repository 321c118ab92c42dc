// Velocity-Verlet updates of an MD state in place (mirage.ff.md), one thread per coordinate:
//   kick_drift:   v += kick * f * inverse_mass; x += drift * v; out = x in the model's dtype
//   forces_kick:  f = -grad; energy = model_energy; v += kick * f * inverse_mass;
//                 pair_count_range = [max(range[0], pair_count), min(range[1], pair_count)]
//   forces_kick_drift: forces_kick, then kick_drift with the same kick (one step's end, the next's start)
// (a kick of 0 leaves v alone). The state (x, v, f, inverse masses, energy) is float32 or float64
// (`State`); the model's positions and gradient are float32 or float64 (`Model`).
#pragma once

#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

struct VerletParams {
  int64_t atoms;
  bool state_float64, model_float64;
  double kick, drift;
  void* positions;              // [atoms, 3] State (kick_drift, forces_kick_drift)
  void* velocities;             // [atoms, 3] State
  void* forces;                 // [atoms, 3] State: read by kick_drift, written by forces_kick(_drift)
  const void* inverse_masses;   // [atoms] State
  void* model_positions;        // [atoms, 3] Model, written by kick_drift and forces_kick_drift
  void* energy;                 // [] State, written by forces_kick(_drift)
  const void* grad;             // [atoms, 3] Model: dE/dx, read by forces_kick(_drift)
  const void* model_energy;     // one element, float64 if model_energy_float64 else float32: forces_kick(_drift)
  bool model_energy_float64 = false;
  // forces_kick(_drift), or null: the model's neighbor-pair count folded into a running [max, min]
  // (mirage.ff.md's capacity check, which would otherwise take two PyTorch kernels a step).
  const int64_t* pair_count = nullptr;   // [1]
  int64_t* pair_count_range = nullptr;   // [2]
};

cudaError_t launch_verlet_kick_drift(const VerletParams& params, cudaStream_t stream);
cudaError_t launch_verlet_forces_kick(const VerletParams& params, cudaStream_t stream);
cudaError_t launch_verlet_forces_kick_drift(const VerletParams& params, cudaStream_t stream);

}  // namespace mirage::cuda
