// mirage::painn_energy: checks, the CPU reference and the Meta kernel.
#include <cmath>
#include <iterator>
#include <limits>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "message.h"
#include "schnet_energy.h"

namespace mirage::ops {
namespace {

constexpr std::string_view kWeightNames[] = {"phi.0.weight", "phi.0.bias",   "phi.2.weight", "phi.2.bias",
                                             "filter.weight", "filter.bias", "U.weight",     "V.weight",
                                             "mlp.0.weight",  "mlp.0.bias",  "mlp.2.weight", "mlp.2.bias"};
constexpr std::string_view kReadoutNames[] = {"readout.0.weight", "readout.0.bias", "readout.2.weight",
                                              "readout.2.bias"};
static_assert(std::size(kWeightNames) == kPainnWeightsPerInteraction);

std::string weight_name(int64_t index, int64_t interactions) {
  const int64_t readout = index - interactions * kPainnWeightsPerInteraction;
  if (readout >= 0) return message("weights[", index, "] (", kReadoutNames[readout], ")");
  return message("weights[", index, "] (interaction ", index / kPainnWeightsPerInteraction, ": ",
                 kWeightNames[index % kPainnWeightsPerInteraction], ")");
}

}  // namespace

PainnShape check_painn_energy(const at::Tensor& atomic_numbers, const at::Tensor& embedding, const at::Tensor& pairs,
                              const at::Tensor& vectors, double cutoff, int64_t num_rbf, at::TensorList weights,
                              std::string_view activations, double norm_eps) {
  check_energy_inputs(kPainnEnergy, atomic_numbers, embedding, pairs, vectors, cutoff);
  MIRAGE_CHECK(std::isfinite(norm_eps) && norm_eps > 0, kPainnEnergy, ": norm_eps must be finite and > 0, got ",
               norm_eps);
  const int64_t count = static_cast<int64_t>(weights.size());
  const int64_t interactions = (count - kEnergyReadoutWeights) / kPainnWeightsPerInteraction;
  MIRAGE_CHECK(interactions >= 1 && interactions <= 8 &&
                   count == interactions * kPainnWeightsPerInteraction + kEnergyReadoutWeights,
               kPainnEnergy, ": weights must hold 12 tensors per interaction (1 to 8 of them) and 4 for the "
               "readout, got ", count);
  check_activations(kPainnEnergy, activations, 2 * interactions + 1,
                    "one for phi per interaction, one for the update per interaction, the readout's");
  PainnShape s{};
  s.atoms = atomic_numbers.size(0);
  s.pairs = pairs.size(1);
  s.interactions = interactions;
  s.features = embedding.size(1);
  s.rbf = num_rbf;
  const int64_t F = s.features, r0 = interactions * kPainnWeightsPerInteraction;
  // The widths the other weights are checked against.
  const auto rows = [&](int64_t index) {
    return energy_weight_rows(kPainnEnergy, weights[index], weight_name(index, interactions));
  };
  s.phi_hidden = rows(0);
  s.update_hidden = rows(8);
  s.readout_hidden = rows(r0);
  MIRAGE_CHECK(num_rbf >= 1, kPainnEnergy, ": num_rbf must be >= 1, got ", num_rbf);
  const auto check = [&](int64_t index, std::vector<int64_t> shape) {
    check_energy_weight(kPainnEnergy, weights[index], weight_name(index, interactions), embedding, std::move(shape));
  };
  for (int64_t t = 0; t < interactions; ++t) {
    const int64_t b = t * kPainnWeightsPerInteraction;
    check(b, {s.phi_hidden, F});
    check(b + 1, {s.phi_hidden});
    check(b + 2, {3 * F, s.phi_hidden});
    check(b + 3, {3 * F});
    check(b + 4, {3 * F, num_rbf});
    check(b + 5, {3 * F});
    check(b + 6, {F, F});
    check(b + 7, {F, F});
    check(b + 8, {s.update_hidden, 2 * F});
    check(b + 9, {s.update_hidden});
    check(b + 10, {3 * F, s.update_hidden});
    check(b + 11, {3 * F});
  }
  check(r0, {s.readout_hidden, F});
  check(r0 + 1, {s.readout_hidden});
  check(r0 + 2, {1, s.readout_hidden});
  check(r0 + 3, {1});
  MIRAGE_CHECK(s.phi_hidden >= 1 && s.update_hidden >= 1 && s.readout_hidden >= 1, kPainnEnergy,
               ": every Linear must have at least one output");
  return s;
}

namespace {

// The reference: the forward, then its gradient written out layer by layer, in float64. Pairs at
// or beyond the cutoff are left out (they add exactly nothing; their gradient is 0), as on CUDA.
EnergyOutputs painn_energy_cpu(const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                               const at::Tensor& pairs, const at::Tensor& vectors, double cutoff,
                               int64_t num_rbf, at::TensorList weights,
                               c10::string_view activations, double norm_eps) {
  const PainnShape s = check_painn_energy(atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights,
                                          activations, norm_eps);
  const std::vector<std::string> act = split_activations(activations);
  check_energy_indices(kPainnEnergy, atomic_numbers, embedding, pairs);
  const auto f64 = [](const at::Tensor& t) { return t.to(at::kDouble); };
  std::vector<at::Tensor> w;  // an absent bias ([0]) is undefined here, as at::linear takes it
  for (const at::Tensor& t : weights) w.push_back(t.numel() == 0 ? at::Tensor() : f64(t));
  const int64_t T = s.interactions, F = s.features, r0 = T * kPainnWeightsPerInteraction;
  const auto weight = [&](int64_t t, int64_t k) -> const at::Tensor& { return w[t * kPainnWeightsPerInteraction + k]; };

  const at::Tensor all_vectors = f64(vectors), all_d = all_vectors.norm(2, {1});
  const at::Tensor kept = (~((all_d >= cutoff) & (all_d <= std::numeric_limits<double>::max()))).nonzero().squeeze(1);
  const at::Tensor idx = pairs.index_select(1, kept), i = idx[0], j = idx[1];
  const at::Tensor vec = all_vectors.index_select(0, kept), d = all_d.index_select(0, kept);
  const at::Tensor direction = vec / d.unsqueeze(1);  // [P, 3]
  const at::Tensor inside = d < cutoff;
  const at::Tensor fcut = at::where(inside, 0.5 * (at::cos(M_PI * d / cutoff) + 1), 0.0).unsqueeze(1);
  const at::Tensor dfcut = at::where(inside, -0.5 * M_PI / cutoff * at::sin(M_PI * d / cutoff), 0.0).unsqueeze(1);
  const at::Tensor frequency = at::arange(1, num_rbf + 1, d.options()) * (M_PI / cutoff);
  const at::Tensor angle = d.unsqueeze(1) * frequency;
  const double scale = std::sqrt(2.0 / cutoff);
  const at::Tensor basis = scale * at::sin(angle) / d.unsqueeze(1);  // [P, R]
  const at::Tensor basis_slope = scale * (frequency * at::cos(angle) * d.unsqueeze(1) - at::sin(angle)) /
                                 d.square().unsqueeze(1);

  const int64_t N = s.atoms;
  at::Tensor sc = f64(embedding).index_select(0, atomic_numbers);
  at::Tensor v = at::zeros({N, 3, F}, sc.options());
  std::vector<at::Tensor> pre1, phi, lin, v_in, uv, vv, norm, pre2, a;
  const auto split = [&](const at::Tensor& x, int64_t k) { return x.narrow(-1, k * F, F); };
  for (int64_t t = 0; t < T; ++t) {
    pre1.push_back(at::linear(sc, weight(t, 0), weight(t, 1)));
    phi.push_back(at::linear(reference_activation(pre1[t], act[t]), weight(t, 2), weight(t, 3)));
    lin.push_back(at::linear(basis, weight(t, 4), weight(t, 5)));  // the filter before the cutoff
    const at::Tensor x = phi[t].index_select(0, j) * lin[t] * fcut;
    v_in.push_back(v);
    sc = sc + at::zeros_like(sc).index_add_(0, i, split(x, 0));
    const at::Tensor dv = v.index_select(0, j) * split(x, 1).unsqueeze(1) + split(x, 2).unsqueeze(1) * direction.unsqueeze(2);
    v = v + at::zeros_like(v).index_add_(0, i, dv);
    uv.push_back(at::matmul(v, weight(t, 6).t()));
    vv.push_back(at::matmul(v, weight(t, 7).t()));
    norm.push_back(at::sqrt(vv[t].square().sum(1) + norm_eps));
    pre2.push_back(at::linear(at::cat({sc, norm[t]}, 1), weight(t, 8), weight(t, 9)));
    a.push_back(at::linear(reference_activation(pre2[t], act[T + t]), weight(t, 10), weight(t, 11)));
    v = v + split(a[t], 0).unsqueeze(1) * uv[t];
    sc = sc + split(a[t], 1) * (uv[t] * vv[t]).sum(1) + split(a[t], 2);
  }
  const at::Tensor r = at::linear(sc, w[r0], w[r0 + 1]);
  const at::Tensor energy = at::linear(reference_activation(r, act[2 * T]), w[r0 + 2], w[r0 + 3]).sum();

  at::Tensor gs = at::matmul(reference_activation_grad(r, act[2 * T]) * w[r0 + 2], w[r0]);
  at::Tensor gv = at::zeros_like(v);
  at::Tensor grad_d = at::zeros_like(d), grad_direction = at::zeros_like(direction);
  for (int64_t t = T - 1; t >= 0; --t) {
    // The gated update, then the MLP and |V v|, then U v and V v.
    const at::Tensor a_vv = split(a[t], 0).unsqueeze(1), a_sv = split(a[t], 1).unsqueeze(1);
    const at::Tensor grad_a = at::cat({(gv * uv[t]).sum(1), gs * (uv[t] * vv[t]).sum(1), gs}, 1);
    const at::Tensor grad_pre2 = at::matmul(grad_a, weight(t, 10)) * reference_activation_grad(pre2[t], act[T + t]);
    const at::Tensor grad_z = at::matmul(grad_pre2, weight(t, 8));
    const at::Tensor grad_uv = gs.unsqueeze(1) * a_sv * vv[t] + gv * a_vv;
    const at::Tensor grad_vv = gs.unsqueeze(1) * a_sv * uv[t] + (grad_z.narrow(1, F, F) / norm[t]).unsqueeze(1) * vv[t];
    gv = gv + at::matmul(grad_uv, weight(t, 6)) + at::matmul(grad_vv, weight(t, 7));
    gs = gs + grad_z.narrow(1, 0, F);
    // The messages: x = phi[j] * lin * fcut split into (x_s, x_vv, x_vs).
    const at::Tensor gs_i = gs.index_select(0, i), gv_i = gv.index_select(0, i);  // [P, F], [P, 3, F]
    const at::Tensor grad_x = at::cat({gs_i, (gv_i * v_in[t].index_select(0, j)).sum(1),
                                       (gv_i * direction.unsqueeze(2)).sum(1)}, 1);
    const at::Tensor phi_j = phi[t].index_select(0, j), x = phi_j * lin[t] * fcut;
    const at::Tensor grad_phi = at::zeros_like(phi[t]).index_add_(0, j, grad_x * lin[t] * fcut);
    const at::Tensor lin_slope = at::matmul(basis_slope, weight(t, 4).t());
    grad_d = grad_d + (grad_x * phi_j * (dfcut * lin[t] + fcut * lin_slope)).sum(1);
    grad_direction = grad_direction + (gv_i * split(x, 2).unsqueeze(1)).sum(2);
    gv = gv + at::zeros_like(gv).index_add_(0, j, gv_i * split(x, 1).unsqueeze(1));
    const at::Tensor grad_pre1 = at::matmul(grad_phi, weight(t, 2)) * reference_activation_grad(pre1[t], act[t]);
    gs = gs + at::matmul(grad_pre1, weight(t, 0));
  }
  const at::Tensor along = (grad_direction * direction).sum(1, true);
  const at::Tensor grad_kept = grad_d.unsqueeze(1) * direction + (grad_direction - along * direction) / d.unsqueeze(1);
  const at::Tensor grad_vectors = at::zeros_like(all_vectors).index_copy_(0, kept, grad_kept);
  return reference_energy_outputs(energy, grad_vectors, pairs, s.atoms, embedding.scalar_type());
}

EnergyOutputs painn_energy_meta(const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                                const at::Tensor& pairs, const at::Tensor& vectors,
                                double cutoff, int64_t num_rbf, at::TensorList weights,
                                c10::string_view activations, double norm_eps) {
  const PainnShape s = check_painn_energy(atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights,
                                          activations, norm_eps);
  return empty_energy_outputs(s.atoms, s.pairs, embedding.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) { m.impl("painn_energy", &painn_energy_cpu); }
TORCH_LIBRARY_IMPL(mirage, Meta, m) { m.impl("painn_energy", &painn_energy_meta); }

}  // namespace mirage::ops
