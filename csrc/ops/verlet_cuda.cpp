// mirage::verlet_kick_drift and mirage::verlet_forces_kick on CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../cuda/verlet.cuh"
#include "cuda_utils.h"
#include "verlet.h"

namespace mirage::ops {
namespace {

at::Tensor verlet_kick_drift_cuda(at::Tensor& positions, at::Tensor& velocities, const at::Tensor& forces,
                                  const at::Tensor& inverse_masses, double kick, double drift, at::ScalarType dtype) {
  check_verlet_kick_drift(positions, velocities, forces, inverse_masses, dtype);
  const c10::cuda::CUDAGuard guard(positions.device());
  const at::Tensor f = forces.contiguous(), inverse = inverse_masses.contiguous();
  at::Tensor out = at::empty(positions.sizes(), positions.options().dtype(dtype));
  cuda::VerletParams params{};
  params.atoms = positions.size(0);
  params.state_float64 = positions.scalar_type() == at::kDouble;
  params.model_float64 = dtype == at::kDouble;
  params.kick = kick;
  params.drift = drift;
  params.positions = positions.mutable_data_ptr();
  params.velocities = velocities.mutable_data_ptr();
  params.forces = const_cast<void*>(f.const_data_ptr());  // the field forces_kick writes; read only here
  params.inverse_masses = inverse.const_data_ptr();
  params.model_positions = out.mutable_data_ptr();
  check_launch(kVerletKickDrift, cuda::launch_verlet_kick_drift(params, c10::cuda::getCurrentCUDAStream()));
  return out;
}

void verlet_forces_kick_cuda(at::Tensor& velocities, at::Tensor& forces, at::Tensor& energy, const at::Tensor& grad,
                             const at::Tensor& model_energy, const at::Tensor& inverse_masses, double kick) {
  check_verlet_forces_kick(velocities, forces, energy, grad, model_energy, inverse_masses);
  const c10::cuda::CUDAGuard guard(velocities.device());
  // The kernel reads the energy in the state's dtype, cast once as the CPU's copy_ does.
  const at::Tensor g = grad.contiguous(), e = model_energy.to(energy.scalar_type()).contiguous();
  const at::Tensor inverse = inverse_masses.contiguous();
  cuda::VerletParams params{};
  params.atoms = velocities.size(0);
  params.state_float64 = velocities.scalar_type() == at::kDouble;
  params.model_float64 = grad.scalar_type() == at::kDouble;
  params.kick = kick;
  params.velocities = velocities.mutable_data_ptr();
  params.forces = forces.mutable_data_ptr();
  params.inverse_masses = inverse.const_data_ptr();
  params.energy = energy.mutable_data_ptr();
  params.grad = g.const_data_ptr();
  params.model_energy = e.const_data_ptr();
  check_launch(kVerletForcesKick, cuda::launch_verlet_forces_kick(params, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) {
  m.impl("verlet_kick_drift", &verlet_kick_drift_cuda);
  m.impl("verlet_forces_kick", &verlet_forces_kick_cuda);
}

}  // namespace mirage::ops
