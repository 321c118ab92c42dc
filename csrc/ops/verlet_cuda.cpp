// mirage::verlet_kick_drift, mirage::verlet_forces_kick and mirage::verlet_forces_kick_drift on CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../cuda/verlet.cuh"
#include "checks.h"
#include "cuda_utils.h"
#include "verlet.h"

namespace mirage::ops {
namespace {

// Read-only inputs the kernels index flat, made contiguous; kept alive until the launch.
struct Inputs {
  at::Tensor inverse_masses, forces, grad, model_energy;
};

// kick_drift's fields: the positions (updated) and, returned, a new tensor for them in `dtype`.
at::Tensor set_kick_drift(cuda::VerletParams& params, at::Tensor& positions, double drift, at::ScalarType dtype) {
  at::Tensor out = at::empty(positions.sizes(), positions.options().dtype(dtype));
  params.drift = drift;
  params.positions = positions.mutable_data_ptr();
  params.model_positions = out.mutable_data_ptr();
  return out;
}

// forces_kick's fields. The kernel reads a float32 or float64 energy as it is (a cast would be a
// kernel of its own, a couple of µs of a small molecule's MD step); others (bfloat16 under
// autocast) are cast first to the state's dtype, once, as the CPU's copy_ rounds them.
void set_forces_kick(cuda::VerletParams& params, Inputs& inputs, at::Tensor& forces, at::Tensor& energy,
                     const at::Tensor& grad, const at::Tensor& model_energy,
                     const std::optional<at::Tensor>& pair_count,
                     const std::optional<at::Tensor>& pair_count_range) {
  const bool as_is = model_energy.scalar_type() == at::kFloat || model_energy.scalar_type() == at::kDouble;
  inputs.grad = grad.contiguous();
  inputs.model_energy = as_is ? model_energy : model_energy.to(energy.scalar_type());
  params.model_float64 = grad.scalar_type() == at::kDouble;
  params.forces = forces.mutable_data_ptr();
  params.energy = energy.mutable_data_ptr();
  params.grad = inputs.grad.const_data_ptr();
  params.model_energy = inputs.model_energy.const_data_ptr();
  params.model_energy_float64 = inputs.model_energy.scalar_type() == at::kDouble;
  if (present(pair_count)) {  // one element, any strides; the range checked contiguous
    params.pair_count = pair_count->const_data_ptr<int64_t>();
    params.pair_count_range = pair_count_range->mutable_data_ptr<int64_t>();
  }
}

// The fields every step sets: the state's size and dtype, the velocities and the kick.
cuda::VerletParams state_params(at::Tensor& velocities, Inputs& inputs, const at::Tensor& inverse_masses,
                                double kick) {
  inputs.inverse_masses = inverse_masses.contiguous();
  cuda::VerletParams params{};
  params.atoms = velocities.size(0);
  params.state_float64 = velocities.scalar_type() == at::kDouble;
  params.kick = kick;
  params.velocities = velocities.mutable_data_ptr();
  params.inverse_masses = inputs.inverse_masses.const_data_ptr();
  return params;
}

at::Tensor verlet_kick_drift_cuda(at::Tensor& positions, at::Tensor& velocities, const at::Tensor& forces,
                                  const at::Tensor& inverse_masses, double kick, double drift, at::ScalarType dtype) {
  check_verlet_kick_drift(positions, velocities, forces, inverse_masses, kick, drift, dtype);
  const c10::cuda::CUDAGuard guard(positions.device());
  Inputs inputs;
  cuda::VerletParams params = state_params(velocities, inputs, inverse_masses, kick);
  inputs.forces = forces.contiguous();
  params.forces = const_cast<void*>(inputs.forces.const_data_ptr());  // the field forces_kick writes; read only here
  params.model_float64 = dtype == at::kDouble;
  at::Tensor out = set_kick_drift(params, positions, drift, dtype);
  check_launch(kVerletKickDrift, cuda::launch_verlet_kick_drift(params, c10::cuda::getCurrentCUDAStream()));
  return out;
}

void verlet_forces_kick_cuda(at::Tensor& velocities, at::Tensor& forces, at::Tensor& energy, const at::Tensor& grad,
                             const at::Tensor& model_energy, const at::Tensor& inverse_masses, double kick,
                             const std::optional<at::Tensor>& pair_count,
                             const std::optional<at::Tensor>& pair_count_range) {
  check_verlet_forces_kick(velocities, forces, energy, grad, model_energy, inverse_masses, kick, pair_count,
                           pair_count_range);
  const c10::cuda::CUDAGuard guard(velocities.device());
  Inputs inputs;
  cuda::VerletParams params = state_params(velocities, inputs, inverse_masses, kick);
  set_forces_kick(params, inputs, forces, energy, grad, model_energy, pair_count, pair_count_range);
  check_launch(kVerletForcesKick, cuda::launch_verlet_forces_kick(params, c10::cuda::getCurrentCUDAStream()));
}

at::Tensor verlet_forces_kick_drift_cuda(at::Tensor& positions, at::Tensor& velocities, at::Tensor& forces,
                                         at::Tensor& energy, const at::Tensor& grad, const at::Tensor& model_energy,
                                         const at::Tensor& inverse_masses, double kick, double drift,
                                         at::ScalarType dtype, const std::optional<at::Tensor>& pair_count,
                                         const std::optional<at::Tensor>& pair_count_range) {
  check_verlet_forces_kick_drift(positions, velocities, forces, energy, grad, model_energy, inverse_masses, kick,
                                 drift, dtype, pair_count, pair_count_range);
  const c10::cuda::CUDAGuard guard(positions.device());
  Inputs inputs;
  cuda::VerletParams params = state_params(velocities, inputs, inverse_masses, kick);
  set_forces_kick(params, inputs, forces, energy, grad, model_energy, pair_count, pair_count_range);
  at::Tensor out = set_kick_drift(params, positions, drift, dtype);
  check_launch(kVerletForcesKickDrift,
               cuda::launch_verlet_forces_kick_drift(params, c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) {
  m.impl("verlet_kick_drift", &verlet_kick_drift_cuda);
  m.impl("verlet_forces_kick", &verlet_forces_kick_cuda);
  m.impl("verlet_forces_kick_drift", &verlet_forces_kick_drift_cuda);
}

}  // namespace mirage::ops
