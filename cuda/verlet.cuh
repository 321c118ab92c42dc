// Velocity-Verlet updates of an MD state in place (mirage.ff.md), one thread per coordinate:
//   kick_drift:   v += kick * f * inverse_mass; x += drift * v; out = x in the model's dtype
//   forces_kick:  f = -grad; energy = model_energy; v += kick * f * inverse_mass
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
  void* positions;              // [atoms, 3] State (kick_drift)
  void* velocities;             // [atoms, 3] State
  void* forces;                 // [atoms, 3] State: read by kick_drift, written by forces_kick
  const void* inverse_masses;   // [atoms] State
  void* model_positions;        // [atoms, 3] Model, written by kick_drift
  void* energy;                 // [] State, written by forces_kick
  const void* grad;             // [atoms, 3] Model: dE/dx, read by forces_kick
  const void* model_energy;     // [] State (cast by the caller), read by forces_kick
};

cudaError_t launch_verlet_kick_drift(const VerletParams& params, cudaStream_t stream);
cudaError_t launch_verlet_forces_kick(const VerletParams& params, cudaStream_t stream);

}  // namespace mirage::cuda
