// Velocity-Verlet updates: elementwise over the 3N coordinates. Each replaces three to six
// PyTorch kernels of an MD step (a couple of µs each in a CUDA graph, where a small molecule's
// whole step is under 100 µs), and is launched overlapped with the model's kernels.
#include <cstdint>

#include "kernel_utils.cuh"
#include "verlet.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 128;

// kForcesKickDrift: kForcesKick then kKickDrift, with the same kick.
enum class Step { kKickDrift, kForcesKick, kForcesKickDrift };

template <Step kStep, typename State, typename Model>
__global__ void __launch_bounds__(kThreads) verlet_kernel(VerletParams p) {
  start_after_prior_grid();
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if constexpr (kStep != Step::kKickDrift) {
    if (e == 0) {
      // Rounded once to the state's dtype (exact from float32 into float64), as the CPU's copy_.
      const double energy = p.model_energy_float64 ? *static_cast<const double*>(p.model_energy)
                                                   : *static_cast<const float*>(p.model_energy);
      *static_cast<State*>(p.energy) = static_cast<State>(energy);
      if (p.pair_count != nullptr) {
        const int64_t count = *p.pair_count;
        p.pair_count_range[0] = max(p.pair_count_range[0], count);
        p.pair_count_range[1] = min(p.pair_count_range[1], count);
      }
    }
  }
  if (e >= 3 * p.atoms) return;
  State* v = static_cast<State*>(p.velocities);
  State* f = static_cast<State*>(p.forces);
  const State inverse_mass = static_cast<const State*>(p.inverse_masses)[e / 3];
  const State kick = static_cast<State>(p.kick);
  // A kick of 0 leaves v alone (no 0 * Inf), as the references do.
  State velocity = v[e], force;
  if constexpr (kStep == Step::kKickDrift) {
    force = f[e];
  } else {
    force = -static_cast<State>(static_cast<const Model*>(p.grad)[e]);
    f[e] = force;
    if (p.kick != 0.0) velocity = velocity + kick * force * inverse_mass;
  }
  if constexpr (kStep != Step::kForcesKick) {
    if (p.kick != 0.0) velocity = velocity + kick * force * inverse_mass;
    State* x = static_cast<State*>(p.positions);
    const State position = x[e] + static_cast<State>(p.drift) * velocity;
    x[e] = position;
    static_cast<Model*>(p.model_positions)[e] = static_cast<Model>(position);
  }
  v[e] = velocity;
}

template <Step kStep>
cudaError_t launch(const VerletParams& p, cudaStream_t stream) {
  // One block at least: forces_kick writes the energy even with no atoms.
  const int64_t blocks = ceil_div(3 * p.atoms, kThreads);
  const dim3 grid(static_cast<unsigned>(blocks > 0 ? blocks : 1)), block(kThreads);
  if (p.state_float64)
    return p.model_float64 ? launch_overlapped(verlet_kernel<kStep, double, double>, grid, block, 0, stream, false, p)
                           : launch_overlapped(verlet_kernel<kStep, double, float>, grid, block, 0, stream, false, p);
  return p.model_float64 ? launch_overlapped(verlet_kernel<kStep, float, double>, grid, block, 0, stream, false, p)
                         : launch_overlapped(verlet_kernel<kStep, float, float>, grid, block, 0, stream, false, p);
}

}  // namespace

cudaError_t launch_verlet_kick_drift(const VerletParams& params, cudaStream_t stream) {
  return launch<Step::kKickDrift>(params, stream);
}

cudaError_t launch_verlet_forces_kick(const VerletParams& params, cudaStream_t stream) {
  return launch<Step::kForcesKick>(params, stream);
}

cudaError_t launch_verlet_forces_kick_drift(const VerletParams& params, cudaStream_t stream) {
  return launch<Step::kForcesKickDrift>(params, stream);
}

}  // namespace mirage::cuda
