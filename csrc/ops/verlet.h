// mirage::verlet_kick_drift, mirage::verlet_forces_kick and mirage::verlet_forces_kick_drift
// (the two in one): checks shared by the CPU, Meta and CUDA kernels.
#pragma once

#include <string_view>

#include <ATen/core/Tensor.h>

namespace mirage::ops {

inline constexpr std::string_view kVerletKickDrift = "mirage::verlet_kick_drift";
inline constexpr std::string_view kVerletForcesKick = "mirage::verlet_forces_kick";
inline constexpr std::string_view kVerletForcesKickDrift = "mirage::verlet_forces_kick_drift";

// positions and velocities: the state, [N, 3] float32/float64, contiguous (updated in place);
// forces: [N, 3], inverse_masses: [N] or [N, 1], both in the state's dtype and on its device;
// kick and drift: finite; dtype: float32 or float64. `op` names the op in the errors.
void check_verlet_kick_drift(const at::Tensor& positions, const at::Tensor& velocities, const at::Tensor& forces,
                             const at::Tensor& inverse_masses, double kick, double drift, at::ScalarType dtype,
                             std::string_view op = kVerletKickDrift);

// velocities and forces: the state, [N, 3] float32/float64, contiguous (updated in place);
// energy: [] in their dtype (written); grad: [N, 3] float32 or float64 and model_energy: one
// floating-point element (bfloat16 under autocast, say), on the state's device; inverse_masses
// and kick as above; pair_count (one int64) and pair_count_range ([2] int64, contiguous, updated in place)
// both None or both on the state's device.
void check_verlet_forces_kick(const at::Tensor& velocities, const at::Tensor& forces, const at::Tensor& energy,
                              const at::Tensor& grad, const at::Tensor& model_energy,
                              const at::Tensor& inverse_masses, double kick,
                              const std::optional<at::Tensor>& pair_count,
                              const std::optional<at::Tensor>& pair_count_range,
                              std::string_view op = kVerletForcesKick);

// Both of the above, and positions apart from the tensors forces_kick reads and writes.
void check_verlet_forces_kick_drift(const at::Tensor& positions, const at::Tensor& velocities, const at::Tensor& forces,
                                    const at::Tensor& energy, const at::Tensor& grad, const at::Tensor& model_energy,
                                    const at::Tensor& inverse_masses, double kick, double drift,
                                    at::ScalarType dtype, const std::optional<at::Tensor>& pair_count,
                                    const std::optional<at::Tensor>& pair_count_range);

}  // namespace mirage::ops
