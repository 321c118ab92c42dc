// mirage::verlet_kick_drift, mirage::verlet_forces_kick and mirage::verlet_forces_kick_drift:
// checks, CPU references and Meta kernels. The state is updated in place, so that an MD loop
// captured in a CUDA graph keeps it in the same buffers from replay to replay (mirage.ff.md); each
// op is one kernel on the GPU where the same steps in PyTorch ops take three to six.
#include "verlet.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "message.h"

namespace mirage::ops {
namespace {

bool is_float32_or_64(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kDouble; }

// A state tensor the op writes in place must be contiguous (the kernels index it flat).
void check_contiguous(std::string_view op, std::string_view arg, const at::Tensor& t) {
  MIRAGE_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous (it is updated in place), got strides ",
               t.strides());
}

// The state tensor the others are measured against: [N, 3] float32/float64, contiguous.
void check_state(std::string_view op, std::string_view arg, const at::Tensor& t) {
  MIRAGE_CHECK(is_float32_or_64(t.scalar_type()), op, ": ", arg, " must be float32 or float64, got ",
               t.scalar_type());
  MIRAGE_CHECK(t.dim() == 2 && t.size(1) == 3, op, ": ", arg, " must be [N, 3], got ", t.sizes());
  check_contiguous(op, arg, t);
}

// A step's scale, finite in the state's dtype: NaN or an infinity would write NaN over the whole
// state, in place (a float32 state's kernels and references take the scale as a float32, which
// 1e39 overflows).
void check_finite(std::string_view op, std::string_view arg, double value, const at::Tensor& state) {
  const bool float32 = state.scalar_type() == at::kFloat;
  MIRAGE_CHECK(float32 ? finite_as_float32(value) : std::isfinite(value), op, ": ", arg, " must be finite",
               float32 ? " as a float32 (the state's dtype)" : "", ", got ", value);
}

void check_inverse_masses(std::string_view op, const at::Tensor& inverse_masses, std::string_view owner,
                          const at::Tensor& state) {
  const int64_t n = state.size(0);
  MIRAGE_CHECK(inverse_masses.device() == state.device(), op, ": inverse_masses must be on ", owner, " device (",
               state.device(), "), got ", inverse_masses.device());
  MIRAGE_CHECK(inverse_masses.scalar_type() == state.scalar_type(), op, ": inverse_masses must have ", owner,
               " dtype (", state.scalar_type(), "), got ", inverse_masses.scalar_type());
  const bool shaped = (inverse_masses.dim() == 1 && inverse_masses.size(0) == n) ||
                      (inverse_masses.dim() == 2 && inverse_masses.size(0) == n && inverse_masses.size(1) == 1);
  MIRAGE_CHECK(shaped, op, ": inverse_masses must be [N] or [N, 1] with N = ", n, ", got ", inverse_masses.sizes());
}

// The references: PyTorch ops in the state's dtype, as mirage.ff.md wrote the steps before. A kick
// of 0 leaves the velocities alone (0 * Inf would make them NaN): mirage.ff.md takes its first
// forces with one.
at::Tensor kick_drift(at::Tensor& positions, at::Tensor& velocities, const at::Tensor& forces,
                      const at::Tensor& inverse_masses, double kick, double drift, at::ScalarType dtype) {
  if (kick != 0.0) velocities.addcmul_(forces, inverse_masses.reshape({-1, 1}), kick);
  positions.add_(velocities, drift);
  return positions.to(dtype, /*non_blocking=*/false, /*copy=*/true);
}

void forces_kick(at::Tensor& velocities, at::Tensor& forces, at::Tensor& energy, const at::Tensor& grad,
                 const at::Tensor& model_energy, const at::Tensor& inverse_masses, double kick,
                 const std::optional<at::Tensor>& pair_count, const std::optional<at::Tensor>& pair_count_range) {
  forces.copy_(grad.neg());
  energy.copy_(model_energy.reshape({}));
  if (kick != 0.0) velocities.addcmul_(forces, inverse_masses.reshape({-1, 1}), kick);
  if (present(pair_count)) {
    const at::Tensor count = pair_count->reshape({1});
    at::Tensor high = pair_count_range->narrow(0, 0, 1), low = pair_count_range->narrow(0, 1, 1);
    high.copy_(at::maximum(high, count));
    low.copy_(at::minimum(low, count));
  }
}

at::Tensor verlet_kick_drift_cpu(at::Tensor& positions, at::Tensor& velocities, const at::Tensor& forces,
                                 const at::Tensor& inverse_masses, double kick, double drift, at::ScalarType dtype) {
  check_verlet_kick_drift(positions, velocities, forces, inverse_masses, kick, drift, dtype);
  return kick_drift(positions, velocities, forces, inverse_masses, kick, drift, dtype);
}

void verlet_forces_kick_cpu(at::Tensor& velocities, at::Tensor& forces, at::Tensor& energy, const at::Tensor& grad,
                            const at::Tensor& model_energy, const at::Tensor& inverse_masses, double kick,
                            const std::optional<at::Tensor>& pair_count,
                            const std::optional<at::Tensor>& pair_count_range) {
  check_verlet_forces_kick(velocities, forces, energy, grad, model_energy, inverse_masses, kick, pair_count,
                           pair_count_range);
  forces_kick(velocities, forces, energy, grad, model_energy, inverse_masses, kick, pair_count, pair_count_range);
}

at::Tensor verlet_forces_kick_drift_cpu(at::Tensor& positions, at::Tensor& velocities, at::Tensor& forces,
                                        at::Tensor& energy, const at::Tensor& grad, const at::Tensor& model_energy,
                                        const at::Tensor& inverse_masses, double kick, double drift,
                                        at::ScalarType dtype, const std::optional<at::Tensor>& pair_count,
                                        const std::optional<at::Tensor>& pair_count_range) {
  check_verlet_forces_kick_drift(positions, velocities, forces, energy, grad, model_energy, inverse_masses, kick,
                                 drift, dtype, pair_count, pair_count_range);
  forces_kick(velocities, forces, energy, grad, model_energy, inverse_masses, kick, pair_count, pair_count_range);
  return kick_drift(positions, velocities, forces, inverse_masses, kick, drift, dtype);
}

at::Tensor verlet_kick_drift_meta(at::Tensor& positions, at::Tensor& velocities, const at::Tensor& forces,
                                  const at::Tensor& inverse_masses, double kick, double drift, at::ScalarType dtype) {
  check_verlet_kick_drift(positions, velocities, forces, inverse_masses, kick, drift, dtype);
  return at::empty(positions.sizes(), positions.options().dtype(dtype));
}

void verlet_forces_kick_meta(at::Tensor& velocities, at::Tensor& forces, at::Tensor& energy, const at::Tensor& grad,
                             const at::Tensor& model_energy, const at::Tensor& inverse_masses, double kick,
                             const std::optional<at::Tensor>& pair_count,
                             const std::optional<at::Tensor>& pair_count_range) {
  check_verlet_forces_kick(velocities, forces, energy, grad, model_energy, inverse_masses, kick, pair_count,
                           pair_count_range);
}

at::Tensor verlet_forces_kick_drift_meta(at::Tensor& positions, at::Tensor& velocities, at::Tensor& forces,
                                         at::Tensor& energy, const at::Tensor& grad, const at::Tensor& model_energy,
                                         const at::Tensor& inverse_masses, double kick, double drift,
                                         at::ScalarType dtype, const std::optional<at::Tensor>& pair_count,
                                         const std::optional<at::Tensor>& pair_count_range) {
  check_verlet_forces_kick_drift(positions, velocities, forces, energy, grad, model_energy, inverse_masses, kick,
                                 drift, dtype, pair_count, pair_count_range);
  return at::empty(positions.sizes(), positions.options().dtype(dtype));
}

}  // namespace

void check_verlet_kick_drift(const at::Tensor& positions, const at::Tensor& velocities, const at::Tensor& forces,
                             const at::Tensor& inverse_masses, double kick, double drift, at::ScalarType dtype,
                             std::string_view op) {
  check_state(op, "positions", positions);
  check_like(op, "velocities", velocities, "positions'", positions, "[N, 3]", positions.sizes());
  check_contiguous(op, "velocities", velocities);
  check_like(op, "forces", forces, "positions'", positions, "[N, 3]", positions.sizes());
  check_inverse_masses(op, inverse_masses, "positions'", positions);
  check_finite(op, "kick", kick, positions);
  check_finite(op, "drift", drift, positions);
  MIRAGE_CHECK(is_float32_or_64(dtype), op, ": dtype must be float32 or float64, got ", dtype);
  check_apart(op, {{"positions", &positions}, {"velocities", &velocities}},
              {{"forces", &forces}, {"inverse_masses", &inverse_masses}});
}

void check_verlet_forces_kick(const at::Tensor& velocities, const at::Tensor& forces, const at::Tensor& energy,
                              const at::Tensor& grad, const at::Tensor& model_energy,
                              const at::Tensor& inverse_masses, double kick,
                              const std::optional<at::Tensor>& pair_count,
                              const std::optional<at::Tensor>& pair_count_range, std::string_view op) {
  check_state(op, "velocities", velocities);
  check_like(op, "forces", forces, "velocities'", velocities, "[N, 3]", velocities.sizes());
  check_contiguous(op, "forces", forces);
  check_like(op, "energy", energy, "velocities'", velocities, "[]", {});
  MIRAGE_CHECK(grad.device() == velocities.device(), op, ": grad must be on velocities' device (",
               velocities.device(), "), got ", grad.device());
  MIRAGE_CHECK(is_float32_or_64(grad.scalar_type()), op, ": grad must be float32 or float64, got ",
               grad.scalar_type());
  MIRAGE_CHECK(grad.sizes() == velocities.sizes(), op, ": grad must have velocities' shape ", velocities.sizes(),
               ", got ", grad.sizes());
  MIRAGE_CHECK(model_energy.device() == velocities.device(), op, ": model_energy must be on velocities' device (",
               velocities.device(), "), got ", model_energy.device());
  MIRAGE_CHECK(at::isFloatingType(model_energy.scalar_type()), op, ": model_energy must be floating point, got ",
               model_energy.scalar_type());
  MIRAGE_CHECK(model_energy.numel() == 1, op, ": model_energy must have one element, got shape ",
               model_energy.sizes());
  check_inverse_masses(op, inverse_masses, "velocities'", velocities);
  check_finite(op, "kick", kick, velocities);
  MIRAGE_CHECK(present(pair_count) == present(pair_count_range), op,
               ": pair_count and pair_count_range must both be given or both be None");
  check_apart(op, {{"velocities", &velocities}, {"forces", &forces}, {"energy", &energy}},
              {{"grad", &grad}, {"model_energy", &model_energy}, {"inverse_masses", &inverse_masses}});
  if (!present(pair_count)) return;
  for (const auto& [arg, t] :
       {std::pair{"pair_count", *pair_count}, std::pair{"pair_count_range", *pair_count_range}}) {
    MIRAGE_CHECK(t.device() == velocities.device(), op, ": ", arg, " must be on velocities' device (",
                 velocities.device(), "), got ", t.device());
    MIRAGE_CHECK(t.scalar_type() == at::kLong, op, ": ", arg, " must be int64, got ", t.scalar_type());
  }
  MIRAGE_CHECK(pair_count->numel() == 1, op, ": pair_count must have one element, got shape ", pair_count->sizes());
  MIRAGE_CHECK(pair_count_range->dim() == 1 && pair_count_range->size(0) == 2, op,
               ": pair_count_range must be [2] ([max, min], updated in place), got ", pair_count_range->sizes());
  check_contiguous(op, "pair_count_range", *pair_count_range);
  // One thread folds the count while the others update the state: none may overlap.
  check_apart(op, {{"velocities", &velocities}, {"forces", &forces}, {"energy", &energy},
                   {"pair_count_range", &*pair_count_range}},
              {{"pair_count", &*pair_count}});
  check_apart(op, {{"pair_count_range", &*pair_count_range}},
              {{"grad", &grad}, {"model_energy", &model_energy}, {"inverse_masses", &inverse_masses}});
}

void check_verlet_forces_kick_drift(const at::Tensor& positions, const at::Tensor& velocities, const at::Tensor& forces,
                                    const at::Tensor& energy, const at::Tensor& grad, const at::Tensor& model_energy,
                                    const at::Tensor& inverse_masses, double kick, double drift,
                                    at::ScalarType dtype, const std::optional<at::Tensor>& pair_count,
                                    const std::optional<at::Tensor>& pair_count_range) {
  constexpr std::string_view op = kVerletForcesKickDrift;
  check_verlet_kick_drift(positions, velocities, forces, inverse_masses, kick, drift, dtype, op);
  check_verlet_forces_kick(velocities, forces, energy, grad, model_energy, inverse_masses, kick, pair_count,
                           pair_count_range, op);
  // One kernel reads grad and writes the positions for the model: in the model's one dtype.
  MIRAGE_CHECK(grad.scalar_type() == dtype, op, ": grad must have dtype's dtype (the model's, ", dtype, "), got ",
               grad.scalar_type());
  check_apart(op, {{"positions", &positions}},
              {{"energy", &energy}, {"grad", &grad}, {"model_energy", &model_energy}});
  if (present(pair_count))
    check_apart(op, {{"positions", &positions}},
                {{"pair_count", &*pair_count}, {"pair_count_range", &*pair_count_range}});
}

TORCH_LIBRARY_IMPL(mirage, CPU, m) {
  m.impl("verlet_kick_drift", &verlet_kick_drift_cpu);
  m.impl("verlet_forces_kick", &verlet_forces_kick_cpu);
  m.impl("verlet_forces_kick_drift", &verlet_forces_kick_drift_cpu);
}
TORCH_LIBRARY_IMPL(mirage, Meta, m) {
  m.impl("verlet_kick_drift", &verlet_kick_drift_meta);
  m.impl("verlet_forces_kick", &verlet_forces_kick_meta);
  m.impl("verlet_forces_kick_drift", &verlet_forces_kick_drift_meta);
}

}  // namespace mirage::ops
