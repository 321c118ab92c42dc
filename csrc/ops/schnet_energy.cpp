// mirage::schnet_energy, mirage::cfconv and mirage::radial_cfconv (with their backwards): checks,
// the CPU references and the Meta kernels.
#include "schnet_energy.h"

#include <cmath>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "../../cuda/filter_table.h"
#include "../../cuda/float_arena.h"
#include "checks.h"
#include "kinds.h"
#include "message.h"
#include "pair_order.h"
#include "radial_basis.h"

namespace mirage::ops {

EnergyOutputs reference_energy_outputs(const at::Tensor& energy, const at::Tensor& grad_vectors,
                                       const at::Tensor& pairs, int64_t atoms, at::ScalarType dtype) {
  const at::Tensor grad_positions = at::zeros({atoms, 3}, grad_vectors.options())
                                        .index_add_(0, pairs[1], grad_vectors)
                                        .index_add_(0, pairs[0], -grad_vectors);
  return {energy.to(dtype), grad_vectors.to(dtype), grad_positions.to(dtype)};
}

EnergyOutputs empty_energy_outputs(int64_t atoms, int64_t pairs, const at::TensorOptions& options) {
  return {at::empty({}, options), at::empty({pairs, 3}, options), at::empty({atoms, 3}, options)};
}

std::vector<std::string> split_activations(std::string_view activations) {
  std::vector<std::string> names;
  size_t start = 0;
  while (true) {
    const size_t comma = activations.find(',', start);
    names.emplace_back(activations.substr(start, comma == std::string_view::npos ? std::string_view::npos
                                                                                  : comma - start));
    if (comma == std::string_view::npos) return names;
    start = comma + 1;
  }
}

void check_energy_weight(std::string_view op, const at::Tensor& w, const std::string& name,
                         const at::Tensor& embedding, std::vector<int64_t> shape) {
  if (shape.size() == 1 && w.dim() == 1 && w.size(0) == 0) shape = {0};
  MIRAGE_CHECK(w.device() == embedding.device(), op, ": ", name, " must be on embedding's device (",
               embedding.device(), "), got ", w.device());
  MIRAGE_CHECK(w.scalar_type() == embedding.scalar_type(), op, ": ", name, " must have embedding's dtype (",
               embedding.scalar_type(), "), got ", w.scalar_type());
  MIRAGE_CHECK(w.sizes() == at::IntArrayRef(shape), op, ": ", name, " must have shape ", at::IntArrayRef(shape),
               shape.size() == 1 ? " (or [0]: no bias)" : "", ", got ", w.sizes());
}

int64_t energy_weight_rows(std::string_view op, const at::Tensor& w, const std::string& name) {
  MIRAGE_CHECK(w.dim() == 2, op, ": ", name, " must be 2-D, got shape ", w.sizes());
  return w.size(0);
}

namespace {

void check_embedding_and_cutoff(std::string_view op, const at::Tensor& embedding, double cutoff) {
  const auto dtype = embedding.scalar_type();
  MIRAGE_CHECK(dtype == at::kFloat || (dtype == at::kDouble && !embedding.is_cuda()), op,
               ": embedding must be float32 (or float64 off the GPU), got ", dtype, " on ", embedding.device());
  MIRAGE_CHECK(embedding.dim() == 2 && embedding.size(0) > 0 && embedding.size(1) > 0, op,
               ": embedding must have shape [Z, F] with Z, F >= 1, got ", embedding.sizes());
  check_cutoff(op, cutoff);
}

}  // namespace

void check_energy_inputs(std::string_view op, const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                         const at::Tensor& pairs, const at::Tensor& vectors, double cutoff) {
  check_embedding_and_cutoff(op, embedding, cutoff);
  const auto dtype = embedding.scalar_type();
  const auto same_device = [&](const at::Tensor& t, std::string_view name) {
    MIRAGE_CHECK(t.device() == embedding.device(), op, ": ", name, " must be on embedding's device (",
                 embedding.device(), "), got ", t.device());
  };
  same_device(atomic_numbers, "atomic_numbers");
  same_device(pairs, "pairs");
  same_device(vectors, "vectors");
  MIRAGE_CHECK(atomic_numbers.scalar_type() == at::kLong && atomic_numbers.dim() == 1, op,
               ": atomic_numbers must be a 1-D int64 tensor [N], got ", atomic_numbers.scalar_type(), " of shape ",
               atomic_numbers.sizes());
  MIRAGE_CHECK(pairs.scalar_type() == at::kLong && pairs.dim() == 2 && pairs.size(0) == 2, op,
               ": pairs must be an int64 tensor of shape [2, P], got ", pairs.scalar_type(), " of shape ",
               pairs.sizes());
  MIRAGE_CHECK(vectors.scalar_type() == dtype, op, ": vectors must have embedding's dtype (", dtype, "), got ",
               vectors.scalar_type());
  MIRAGE_CHECK(vectors.dim() == 2 && vectors.size(0) == pairs.size(1) && vectors.size(1) == 3, op,
               ": vectors must have shape [P, 3] = [", pairs.size(1), ", 3] (P from pairs), got ", vectors.sizes());
  MIRAGE_CHECK(atomic_numbers.size(0) > 0 || pairs.size(1) == 0, op,
               ": atomic_numbers is empty (N=0) but pairs has ", pairs.size(1), " pairs to index");
}

std::vector<std::string> check_activations(std::string_view op, std::string_view activations, int64_t count,
                                           std::string_view what) {
  std::vector<std::string> names = split_activations(activations);
  MIRAGE_CHECK(static_cast<int64_t>(names.size()) == count, op, ": activations must name ", count, " activations (",
               what, ") separated by commas, got \"", activations, "\"");
  for (const std::string& name : names) {
    bool known = false;
    for (std::string_view k : kEnergyActivations) known = known || name == k;
    MIRAGE_CHECK(known, op, ": activation \"", name, "\" in activations is not one of shifted_softplus, "
                 "softplus, silu, tanh, gelu, relu");
  }
  return names;
}

void check_energy_indices(std::string_view op, const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                          const at::Tensor& pairs) {
  const at::Tensor numbers = atomic_numbers.contiguous();
  const int64_t* z = numbers.const_data_ptr<int64_t>();
  for (int64_t a = 0; a < numbers.size(0); ++a)
    MIRAGE_CHECK(z[a] >= 0 && z[a] < embedding.size(0), op, ": atomic_numbers[", a, "] = ", z[a],
                 " is out of range for embedding's ", embedding.size(0), " rows");
  check_pair_indices(op, pairs.contiguous(), numbers.size(0));
}

at::Tensor reference_activation(const at::Tensor& v, const std::string& name) {
  if (name == "shifted_softplus") return at::softplus(v) - std::log(2.0);
  if (name == "softplus") return at::softplus(v);
  if (name == "silu") return at::silu(v);
  if (name == "tanh") return at::tanh(v);
  if (name == "gelu") return at::gelu(v);
  return at::relu(v);
}

at::Tensor reference_activation_grad(const at::Tensor& v, const std::string& name) {
  if (name == "shifted_softplus" || name == "softplus") return at::where(v > 20, at::ones_like(v), at::sigmoid(v));
  if (name == "silu") {
    const at::Tensor s = at::sigmoid(v);
    return s * (1 + v * (1 - s));
  }
  if (name == "tanh") return 1 - at::tanh(v).square();
  if (name == "gelu") return 0.5 * (1 + at::erf(v * M_SQRT1_2)) + v * at::exp(-0.5 * v.square()) / std::sqrt(2 * M_PI);
  return (v > 0).to(v.scalar_type());
}

namespace {

constexpr std::string_view kWeightNames[] = {"filter.0.weight", "filter.0.bias", "filter.2.weight",
                                             "filter.2.bias",   "in2f.weight",   "in2f.bias",
                                             "f2out.0.weight",  "f2out.0.bias",  "f2out.2.weight",
                                             "f2out.2.bias"};
constexpr std::string_view kReadoutNames[] = {"readout.0.weight", "readout.0.bias", "readout.2.weight",
                                              "readout.2.bias"};

std::string weight_name(int64_t index, int64_t interactions) {
  const int64_t readout = index - interactions * kSchnetWeightsPerInteraction;
  if (readout >= 0) return message("weights[", index, "] (", kReadoutNames[readout], ")");
  return message("weights[", index, "] (interactions.", index / kSchnetWeightsPerInteraction, ".",
                 kWeightNames[index % kSchnetWeightsPerInteraction], ")");
}

// The weights and activations (against embedding: its dtype, device and width), `op` naming the
// caller; the sizes, atoms and pairs 0.
SchnetShape check_schnet_weights(std::string_view op, const at::Tensor& embedding, int64_t num_rbf,
                                 at::TensorList weights, std::string_view activations) {
  const int64_t count = static_cast<int64_t>(weights.size());
  const int64_t interactions = (count - kEnergyReadoutWeights) / kSchnetWeightsPerInteraction;
  MIRAGE_CHECK(interactions >= 1 && interactions <= 8 &&
                   count == interactions * kSchnetWeightsPerInteraction + kEnergyReadoutWeights,
               op, ": weights must hold 10 tensors per interaction (1 to 8 of them) and 4 for the "
               "readout, got ", count);
  check_activations(op, activations, interactions + 2, "filter, one update per interaction, readout");
  const auto check_weight = [&](int64_t index, std::vector<int64_t> shape) {
    check_energy_weight(op, weights[index], weight_name(index, interactions), embedding, std::move(shape));
  };

  SchnetShape s{};
  s.interactions = interactions;
  s.embeddings = embedding.size(0);
  s.features = embedding.size(1);
  const at::Tensor& first = weights[0];
  MIRAGE_CHECK(first.dim() == 2, op, ": ", weight_name(0, interactions), " must be 2-D [H, R], got ", first.sizes());
  s.filter_hidden = first.size(0);
  s.rbf = first.size(1);
  MIRAGE_CHECK(num_rbf == s.rbf && num_rbf >= 1 && num_rbf <= kMaxTableRbf, op, ": num_rbf (", num_rbf,
               ") must be in [1, ", kMaxTableRbf, "] (the prepared tables grow with it) and equal the filters' input "
               "width (", s.rbf, ")");
  // The widths the other weights are checked against.
  const auto rows = [&](int64_t index) {
    return energy_weight_rows(op, weights[index], weight_name(index, interactions));
  };
  s.message_width = rows(2);
  s.update_hidden = rows(6);
  const int64_t r0 = interactions * kSchnetWeightsPerInteraction;
  s.readout_hidden = rows(r0);
  for (int64_t t = 0; t < interactions; ++t) {
    const int64_t b = t * kSchnetWeightsPerInteraction;
    check_weight(b, {s.filter_hidden, s.rbf});
    check_weight(b + 1, {s.filter_hidden});
    check_weight(b + 2, {s.message_width, s.filter_hidden});
    check_weight(b + 3, {s.message_width});
    check_weight(b + 4, {s.message_width, s.features});
    check_weight(b + 5, {s.message_width});
    check_weight(b + 6, {s.update_hidden, s.message_width});
    check_weight(b + 7, {s.update_hidden});
    check_weight(b + 8, {s.features, s.update_hidden});
    check_weight(b + 9, {s.features});
  }
  check_weight(r0, {s.readout_hidden, s.features});
  check_weight(r0 + 1, {s.readout_hidden});
  check_weight(r0 + 2, {1, s.readout_hidden});
  check_weight(r0 + 3, {1});
  MIRAGE_CHECK(s.message_width >= 1 && s.update_hidden >= 1 && s.readout_hidden >= 1 && s.filter_hidden >= 1,
               op, ": every Linear must have at least one output");
  return s;
}

// What the prepared tables need of the filter network.
void check_tables_possible(std::string_view op, const SchnetShape& s, std::string_view activations) {
  MIRAGE_CHECK(split_activations(activations).front() != "relu", op,
               ": the filter activation \"relu\" is not smooth, and the prepared tables interpolate the filters");
  MIRAGE_CHECK(s.message_width % 4 == 0, op, ": the prepared tables need a message width (filter.2's outputs) "
               "that is a multiple of 4, got ", s.message_width);
}

cuda::atomwise::SchnetPrepared prepared_layout(const SchnetShape& s) {
  return cuda::atomwise::schnet_prepared(s.interactions, s.rbf, s.embeddings, s.features, s.message_width,
                                         s.update_hidden, s.readout_hidden);
}

}  // namespace

int64_t schnet_prepared_size(const SchnetShape& s) {
  return prepared_layout(s).total;
}

namespace {

// The whole-model kernels' loops over a block's pairs and their features count in 32 bits; with
// one block (below sm_90) a block has every pair.
void check_index_range(std::string_view op, const SchnetShape& s) {
  // In double: the int64 product of large sizes could wrap past the bound.
  const double indexed = static_cast<double>(s.pairs) * std::max<int64_t>(s.message_width, 1) * s.interactions;
  MIRAGE_CHECK(indexed < static_cast<double>(int64_t{1} << 31), op,
               ": pairs x message width x interactions must stay below 2^31 (the kernels index them in 32 "
               "bits), got ", s.pairs, " x ", s.message_width, " x ", s.interactions);
}

// `prepared`, where given, for the weights of `s` (`op` names the caller).
void check_prepared(std::string_view op, const SchnetShape& s, const at::Tensor& embedding,
                    std::string_view activations, const std::optional<at::Tensor>& prepared) {
  if (!present(prepared)) return;
  check_tables_possible(op, s, activations);
  const int64_t size = schnet_prepared_size(s);
  MIRAGE_CHECK(prepared->dim() == 1 && prepared->size(0) == size && prepared->scalar_type() == embedding.scalar_type()
                   && prepared->device() == embedding.device(),
               op, ": prepared must be schnet_energy_prepare's output for this embedding and these weights, a 1-D ",
               embedding.scalar_type(), " tensor of ", size, " elements on ", embedding.device(), ", got ",
               prepared->scalar_type(), " of shape ", prepared->sizes(), " on ", prepared->device());
}

}  // namespace

SchnetShape check_schnet_energy(const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                                const at::Tensor& pairs, const at::Tensor& vectors, double cutoff,
                                int64_t num_rbf, at::TensorList weights, std::string_view activations,
                                const std::optional<at::Tensor>& prepared) {
  check_energy_inputs(kSchnetEnergy, atomic_numbers, embedding, pairs, vectors, cutoff);
  SchnetShape s = check_schnet_weights(kSchnetEnergy, embedding, num_rbf, weights, activations);
  s.atoms = atomic_numbers.size(0);
  s.pairs = pairs.size(1);
  check_index_range(kSchnetEnergy, s);
  check_prepared(kSchnetEnergy, s, embedding, activations, prepared);
  return s;
}

SchnetShape check_schnet_energy_all_pairs(const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                                          const at::Tensor& positions, double cutoff, int64_t num_rbf,
                                          at::TensorList weights, std::string_view activations,
                                          const std::optional<at::Tensor>& prepared,
                                          const std::optional<at::Tensor>& num_pairs) {
  constexpr std::string_view op = kSchnetEnergyAllPairs;
  check_embedding_and_cutoff(op, embedding, cutoff);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{atomic_numbers, "atomic_numbers"},
                                {positions, "positions"}})
    MIRAGE_CHECK(t.device() == embedding.device(), op, ": ", name, " must be on embedding's device (",
                 embedding.device(), "), got ", t.device());
  MIRAGE_CHECK(atomic_numbers.scalar_type() == at::kLong && atomic_numbers.dim() == 1, op,
               ": atomic_numbers must be a 1-D int64 tensor [N], got ", atomic_numbers.scalar_type(), " of shape ",
               atomic_numbers.sizes());
  const int64_t atoms = atomic_numbers.size(0);
  MIRAGE_CHECK(positions.scalar_type() == embedding.scalar_type(), op, ": positions must have embedding's dtype (",
               embedding.scalar_type(), "), got ", positions.scalar_type());
  MIRAGE_CHECK(positions.dim() == 2 && positions.size(0) == atoms && positions.size(1) == 3, op,
               ": positions must have shape [N, 3] = [", atoms, ", 3] (N from atomic_numbers), got ",
               positions.sizes());
  if (present(num_pairs)) {
    MIRAGE_CHECK(num_pairs->scalar_type() == at::kLong && num_pairs->numel() == 1 &&
                     num_pairs->device() == embedding.device(),
                 op, ": num_pairs must be a one-element int64 tensor on ", embedding.device(), ", got ",
                 num_pairs->scalar_type(), " of shape ", num_pairs->sizes(), " on ", num_pairs->device());
    check_apart(op, {{"num_pairs", &*num_pairs}},
                {{"atomic_numbers", &atomic_numbers}, {"positions", &positions}, {"embedding", &embedding}});
  }
  SchnetShape s = check_schnet_weights(op, embedding, num_rbf, weights, activations);
  // Every pair is searched (for molecules): N (N - 1) indexed in 32 bits, computed without wrapping.
  MIRAGE_CHECK(atoms <= 46341, op, ": atomic_numbers must have at most 46,341 atoms (every pair is searched and "
               "indexed in 32 bits), got N=", atoms);
  s.atoms = atoms;
  s.pairs = atoms * std::max<int64_t>(atoms - 1, 0);
  check_index_range(op, s);
  check_prepared(op, s, embedding, activations, prepared);
  return s;
}

SchnetShape check_schnet_energy_prepare(const at::Tensor& embedding, double cutoff, int64_t num_rbf,
                                        at::TensorList weights, std::string_view activations) {
  check_embedding_and_cutoff(kSchnetEnergyPrepare, embedding, cutoff);
  const SchnetShape s = check_schnet_weights(kSchnetEnergyPrepare, embedding, num_rbf, weights, activations);
  check_tables_possible(kSchnetEnergyPrepare, s, activations);
  return s;
}

namespace {

// radial_cfconv's reference table and its filters (defined with that op's reference below).
at::Tensor table_filters(const at::Tensor& table, const at::Tensor& distances, double cutoff, bool slope);
at::Tensor reference_filter_table(const at::Tensor& weight1, const std::optional<at::Tensor>& bias1,
                                  const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
                                  std::string_view activation, std::string_view basis, double cutoff,
                                  std::string_view envelope);
// t in float64, or undefined where t is absent (defined below).
at::Tensor optional_f64(const std::optional<at::Tensor>& t);

// The first interaction's in2f of every embedding row in a prepared tensor, [Z, M].
at::Tensor prepared_first_h(const at::Tensor& prepared, const SchnetShape& s) {
  return prepared.narrow(0, prepared_layout(s).first_h, s.embeddings * s.message_width)
      .view({s.embeddings, s.message_width});
}

// Interaction t's table in a prepared tensor, [intervals, 6, M].
at::Tensor prepared_table(const at::Tensor& prepared, const SchnetShape& s, int64_t t) {
  const int64_t intervals = cuda::atomwise::schnet_table_intervals(s.rbf);
  const int64_t size = intervals * cuda::filter_table::kCoefficients * s.message_width;
  return prepared.narrow(0, t * size, size).reshape({intervals, cuda::filter_table::kCoefficients, s.message_width});
}

// The reference on checked inputs (shape s, indices in range): the forward, then its gradient
// written out layer by layer, in float64. Prepared, the filters (the cutoff in them) and their
// slopes come from its tables, and the first h from its rows by species.
EnergyOutputs schnet_energy_reference(const SchnetShape& s, const at::Tensor& atomic_numbers,
                                      const at::Tensor& embedding, const at::Tensor& pairs,
                                      const at::Tensor& vectors, double cutoff, int64_t num_rbf,
                                      at::TensorList weights, c10::string_view activations,
                                      const std::optional<at::Tensor>& prepared) {
  const bool tables = present(prepared);
  const std::vector<std::string> act = split_activations(activations);
  const at::Tensor idx = pairs.contiguous();

  const auto f64 = [](const at::Tensor& t) { return t.to(at::kDouble); };
  std::vector<at::Tensor> w;  // an absent bias ([0]) is undefined here, as at::linear takes it
  for (const at::Tensor& t : weights) w.push_back(t.numel() == 0 ? at::Tensor() : f64(t));
  const at::Tensor i = idx[0], j = idx[1];
  const at::Tensor v = f64(vectors);
  const at::Tensor d = v.norm(2, {1});
  const double half_angle = M_PI / (2 * cutoff);
  const at::Tensor inside = d < cutoff;
  const at::Tensor fcut = at::where(inside, at::cos(half_angle * d).square(), 0.0);
  const at::Tensor dfcut = at::where(inside, -half_angle * at::sin(2 * half_angle * d), 0.0);
  const double spacing = num_rbf > 1 ? cutoff / (num_rbf - 1) : cutoff;
  const at::Tensor zk = (d.unsqueeze(1) - at::arange(num_rbf, d.options()) * spacing) / spacing;
  const at::Tensor basis = at::exp(-0.5 * zk.square());  // [P, R]

  const int64_t T = s.interactions, r0 = T * kSchnetWeightsPerInteraction;
  const auto weight = [&](int64_t t, int64_t k) -> const at::Tensor& { return w[t * kSchnetWeightsPerInteraction + k]; };
  at::Tensor x = f64(embedding).index_select(0, atomic_numbers);
  // filter: the filters before the cutoff, or (tables) the prepared ones, the cutoff in them.
  std::vector<at::Tensor> filter_pre, filter, h, q;
  const at::Tensor per_pair_cutoff = tables ? at::ones_like(fcut) : fcut;
  for (int64_t t = 0; t < T; ++t) {
    if (tables) {
      filter.push_back(table_filters(prepared_table(*prepared, s, t), d, cutoff, false));
    } else {
      filter_pre.push_back(at::linear(basis, weight(t, 0), weight(t, 1)));
      filter.push_back(at::linear(reference_activation(filter_pre[t], act[0]), weight(t, 2), weight(t, 3)));
    }
    h.push_back(tables && t == 0 ? f64(prepared_first_h(*prepared, s)).index_select(0, atomic_numbers)
                                 : at::linear(x, weight(t, 4), weight(t, 5)));
    const at::Tensor messages = at::zeros_like(h[t]).index_add_(0, i, h[t].index_select(0, j) * filter[t] *
                                                                          per_pair_cutoff.unsqueeze(1));
    q.push_back(at::linear(messages, weight(t, 6), weight(t, 7)));
    x = x + at::linear(reference_activation(q[t], act[t + 1]), weight(t, 8), weight(t, 9));
  }
  const at::Tensor r = at::linear(x, w[r0], w[r0 + 1]);
  const at::Tensor energy = at::linear(reference_activation(r, act[T + 1]), w[r0 + 2], w[r0 + 3]).sum();

  at::Tensor grad_x = at::matmul(reference_activation_grad(r, act[T + 1]) * w[r0 + 2], w[r0]);
  at::Tensor grad_basis = at::zeros_like(basis), grad_fcut = at::zeros_like(d), grad_table = at::zeros_like(d);
  for (int64_t t = T - 1; t >= 0; --t) {
    const at::Tensor grad_q = at::matmul(grad_x, weight(t, 8)) * reference_activation_grad(q[t], act[t + 1]);
    const at::Tensor grad_m = at::matmul(grad_q, weight(t, 6)).index_select(0, i);  // per pair
    const at::Tensor grad_w = grad_m * h[t].index_select(0, j);
    const at::Tensor grad_h =
        at::zeros_like(h[t]).index_add_(0, j, grad_m * filter[t] * per_pair_cutoff.unsqueeze(1));
    if (tables) {
      grad_table = grad_table + (grad_w * table_filters(prepared_table(*prepared, s, t), d, cutoff, true)).sum(1);
    } else {
      grad_fcut = grad_fcut + (grad_w * filter[t]).sum(1);
      const at::Tensor grad_pre = at::matmul(grad_w * fcut.unsqueeze(1), weight(t, 2)) *
                                  reference_activation_grad(filter_pre[t], act[0]);
      grad_basis = grad_basis + at::matmul(grad_pre, weight(t, 0));
    }
    grad_x = grad_x + at::matmul(grad_h, weight(t, 4));
  }
  const at::Tensor grad_d = (grad_basis * basis * (-zk / spacing)).sum(1) + grad_fcut * dfcut + grad_table;
  const at::Tensor grad_vectors = at::where(d > 0, grad_d / d, 0.0).unsqueeze(1) * v;
  return reference_energy_outputs(energy, grad_vectors, idx, s.atoms, embedding.scalar_type());
}

EnergyOutputs schnet_energy_cpu(const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                                const at::Tensor& pairs, const at::Tensor& vectors,
                                double cutoff, int64_t num_rbf, at::TensorList weights,
                                c10::string_view activations,
                                const std::optional<at::Tensor>& prepared) {
  const SchnetShape s = check_schnet_energy(atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights,
                                            activations, prepared);
  check_energy_indices(kSchnetEnergy, atomic_numbers, embedding, pairs);
  return schnet_energy_reference(s, atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights, activations,
                                 prepared);
}

// Every pair (i, j), i != j, of `atoms` atoms, [2, N (N - 1)], in the CUDA kernel's order.
at::Tensor all_pairs(int64_t atoms, const at::TensorOptions& options) {
  const int64_t others = std::max<int64_t>(atoms - 1, 0);
  const at::Tensor i = at::arange(atoms, options).repeat_interleave(others);
  const at::Tensor k = at::arange(others, options).repeat({atoms});
  return at::stack({i, k + (k >= i).to(at::kLong)});
}

// schnet_energy on all_pairs: the CPU reference is schnet_energy's (its checks made here, under
// this op's name). num_pairs gets the pairs within the cutoff, or -1 where a position is not
// finite.
std::tuple<at::Tensor, at::Tensor> schnet_energy_all_pairs_cpu(
    const at::Tensor& atomic_numbers, const at::Tensor& embedding, const at::Tensor& positions, double cutoff,
    int64_t num_rbf, at::TensorList weights, c10::string_view activations, const std::optional<at::Tensor>& prepared,
    const std::optional<at::Tensor>& num_pairs) {
  const SchnetShape s = check_schnet_energy_all_pairs(atomic_numbers, embedding, positions, cutoff, num_rbf, weights,
                                                      activations, prepared, num_pairs);
  const at::Tensor pairs = all_pairs(s.atoms, atomic_numbers.options());
  check_energy_indices(kSchnetEnergyAllPairs, atomic_numbers, embedding, pairs);
  const at::Tensor vectors = positions.index_select(0, pairs[1]) - positions.index_select(0, pairs[0]);
  auto [energy, grad_vectors, grad_positions] = schnet_energy_reference(
      s, atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights, activations, prepared);
  if (present(num_pairs)) {
    const bool finite = positions.isfinite().all().item<bool>();
    num_pairs->fill_(finite ? (vectors.norm(2, {1}) < cutoff).sum().item<int64_t>() : -1);
  }
  return {energy, grad_positions};
}

std::tuple<at::Tensor, at::Tensor> schnet_energy_all_pairs_meta(
    const at::Tensor& atomic_numbers, const at::Tensor& embedding, const at::Tensor& positions, double cutoff,
    int64_t num_rbf, at::TensorList weights, c10::string_view activations, const std::optional<at::Tensor>& prepared,
    const std::optional<at::Tensor>& num_pairs) {
  const SchnetShape s = check_schnet_energy_all_pairs(atomic_numbers, embedding, positions, cutoff, num_rbf, weights,
                                                      activations, prepared, num_pairs);
  return {at::empty({}, embedding.options()), at::empty({s.atoms, 3}, embedding.options())};
}

EnergyOutputs schnet_energy_meta(const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                                 const at::Tensor& pairs, const at::Tensor& vectors,
                                 double cutoff, int64_t num_rbf, at::TensorList weights,
                                 c10::string_view activations,
                                 const std::optional<at::Tensor>& prepared) {
  const SchnetShape s = check_schnet_energy(atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights,
                                            activations, prepared);
  return empty_energy_outputs(s.atoms, s.pairs, embedding.options());
}

// The tables and the first h by the float64 reference (rounded to embedding's dtype once), the
// weights transposed by ATen, in cuda/float_arena.h's layout.
at::Tensor schnet_energy_prepare_cpu(const at::Tensor& embedding, double cutoff, int64_t num_rbf,
                                     at::TensorList weights, c10::string_view activations) {
  const SchnetShape s = check_schnet_energy_prepare(embedding, cutoff, num_rbf, weights, activations);
  const std::string filter_activation = split_activations(activations).front();
  at::Tensor prepared = at::zeros({schnet_prepared_size(s)}, embedding.options());
  const auto bias = [](const at::Tensor& b) { return b.numel() == 0 ? std::nullopt : std::optional<at::Tensor>(b); };
  const int64_t T = s.interactions;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = t * kSchnetWeightsPerInteraction;
    prepared_table(prepared, s, t).copy_(reference_filter_table(weights[b], bias(weights[b + 1]), weights[b + 2],
                                                                 bias(weights[b + 3]), filter_activation, "gaussian",
                                                                 cutoff, "cosine"));
  }
  using namespace cuda::atomwise;
  const cuda::atomwise::SchnetTransposed l =
      schnet_transposed(T, s.features, s.message_width, s.update_hidden, s.readout_hidden);
  at::Tensor transposed = prepared.narrow(0, prepared_layout(s).transposed, l.total);
  const auto put = [&](int64_t offset, const at::Tensor& w) {
    transposed.narrow(0, offset, w.numel()).copy_(w.t().reshape(-1));
  };
  put(l.readout1, weights[T * kSchnetWeightsPerInteraction]);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = t * kSchnetWeightsPerInteraction;
    put(l.f2out2 + t * padded_matrix(s.update_hidden, s.features), weights[b + 8]);
    put(l.f2out1 + t * padded_matrix(s.message_width, s.update_hidden), weights[b + 6]);
    if (t > 0) put(l.in2f + (t - 1) * padded_matrix(s.features, s.message_width), weights[b + 4]);
  }
  prepared_first_h(prepared, s).copy_(at::linear(embedding.to(at::kDouble), weights[4].to(at::kDouble),
                                                 optional_f64(bias(weights[5]))));
  return prepared;
}

at::Tensor schnet_energy_prepare_meta(const at::Tensor& embedding, double cutoff, int64_t num_rbf,
                                      at::TensorList weights, c10::string_view activations) {
  return at::empty({schnet_prepared_size(check_schnet_energy_prepare(embedding, cutoff, num_rbf, weights, activations))},
                   embedding.options());
}

// x: float32 (or float64 off the GPU), [N, M]; pairs: int64 [2, P] on x's device. Returns N, P, M.
CfconvShape check_messages(std::string_view op, const at::Tensor& x, const at::Tensor& pairs) {
  const auto dtype = x.scalar_type();
  MIRAGE_CHECK(dtype == at::kFloat || (dtype == at::kDouble && !x.is_cuda()), op,
               ": x must be float32 (or float64 off the GPU), got ", dtype, " on ", x.device());
  MIRAGE_CHECK(x.dim() == 2, op, ": x must be 2-D [N, M], got shape ", x.sizes());
  MIRAGE_CHECK(pairs.device() == x.device(), op, ": pairs must be on x's device (", x.device(), "), got ",
               pairs.device());
  MIRAGE_CHECK(pairs.scalar_type() == at::kLong && pairs.dim() == 2 && pairs.size(0) == 2, op,
               ": pairs must be an int64 tensor of shape [2, P], got ", pairs.scalar_type(), " of shape ",
               pairs.sizes());
  CfconvShape s{};
  s.nodes = x.size(0);
  s.width = x.size(1);
  s.pairs = pairs.size(1);
  MIRAGE_CHECK(s.nodes > 0 || s.pairs == 0, op, ": x has no rows (N=0) for pairs to index (P=", s.pairs, ")");
  return s;
}

// t on x's device with x's dtype.
void check_like_x(std::string_view op, const at::Tensor& t, std::string_view name, const at::Tensor& x) {
  MIRAGE_CHECK(t.device() == x.device(), op, ": ", name, " must be on x's device (", x.device(), "), got ",
               t.device());
  MIRAGE_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype (", x.scalar_type(),
               "), got ", t.scalar_type());
}

// The filter network's weights and activation (R and H into s).
void check_filter_network(std::string_view op, const at::Tensor& x, const at::Tensor& weight1,
                          const std::optional<at::Tensor>& bias1, const at::Tensor& weight2,
                          const std::optional<at::Tensor>& bias2, std::string_view activation, CfconvShape& s) {
  check_like_x(op, weight1, "weight1", x);
  check_like_x(op, weight2, "weight2", x);
  MIRAGE_CHECK(weight1.dim() == 2 && weight1.size(0) >= 1 && weight1.size(1) >= 1, op,
               ": weight1 must be 2-D [H, R] with H, R >= 1, got shape ", weight1.sizes());
  s.hidden = weight1.size(0);
  s.rbf = weight1.size(1);
  MIRAGE_CHECK(weight2.dim() == 2 && weight2.size(0) == s.width && weight2.size(1) == s.hidden, op,
               ": weight2 must have shape [M, H] = [", s.width, ", ", s.hidden, "] (M from x, H from weight1), got ",
               weight2.sizes());
  const auto check_bias = [&](const std::optional<at::Tensor>& b, std::string_view name, int64_t size) {
    if (!present(b)) return;
    check_like_x(op, *b, name, x);
    MIRAGE_CHECK(b->dim() == 1 && b->size(0) == size, op, ": ", name, " must have shape [", size, "], got ",
                 b->sizes());
  };
  check_bias(bias1, "bias1", s.hidden);
  check_bias(bias2, "bias2", s.width);
  bool known = false;
  for (std::string_view k : kEnergyActivations) known = known || activation == k;
  MIRAGE_CHECK(known, op, ": activation \"", activation, "\" is not one of shifted_softplus, softplus, silu, "
               "tanh, gelu, relu");
}

}  // namespace

CfconvShape check_cfconv(std::string_view op, const at::Tensor& x, const at::Tensor& basis,
                         const at::Tensor& envelope, const at::Tensor& pairs, const at::Tensor& weight1,
                         const std::optional<at::Tensor>& bias1, const at::Tensor& weight2,
                         const std::optional<at::Tensor>& bias2, std::string_view activation,
                         const std::optional<at::Tensor>& sender_order, const std::optional<at::Tensor>& num_pairs) {
  CfconvShape s = check_messages(op, x, pairs);
  check_filter_network(op, x, weight1, bias1, weight2, bias2, activation, s);
  check_like_x(op, basis, "basis", x);
  check_like_x(op, envelope, "envelope", x);
  MIRAGE_CHECK(basis.dim() == 2 && basis.size(0) == s.pairs && basis.size(1) == s.rbf, op,
               ": basis must have shape [P, R] = [", s.pairs, ", ", s.rbf, "] (P from pairs, R from weight1), got ",
               basis.sizes());
  MIRAGE_CHECK(envelope.dim() == 1 && envelope.size(0) == s.pairs, op, ": envelope must have shape [P] = [",
               s.pairs, "], got ", envelope.sizes());
  check_pair_count(op, num_pairs, pairs);
  check_sender_order(op, sender_order, pairs, num_pairs);
  return s;
}
void check_cfconv_backward(const at::Tensor& grad, const at::Tensor& filters, const at::Tensor& x,
                           const CfconvShape& s) {
  check_like_x(kCfconvBackward, grad, "grad", x);
  check_like_x(kCfconvBackward, filters, "filters", x);
  MIRAGE_CHECK(grad.sizes() == x.sizes(), kCfconvBackward, ": grad must have x's shape ", x.sizes(), ", got ",
               grad.sizes());
  MIRAGE_CHECK(filters.dim() == 2 && filters.size(0) == s.pairs && filters.size(1) == s.width, kCfconvBackward,
               ": filters must have shape [P, M] = [", s.pairs, ", ", s.width, "], got ", filters.sizes());
}

CfconvShape check_radial_cfconv(const at::Tensor& x, const at::Tensor& distances, const at::Tensor& pairs,
                                const at::Tensor& weight1, const std::optional<at::Tensor>& bias1,
                                const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
                                std::string_view activation, std::string_view basis, double cutoff,
                                std::string_view envelope, const std::optional<at::Tensor>& sender_order) {
  constexpr std::string_view op = kRadialCfconv;
  CfconvShape s = check_messages(op, x, pairs);
  check_filter_network(op, x, weight1, bias1, weight2, bias2, activation, s);
  MIRAGE_CHECK(activation != "relu", op, ": activation \"relu\" is not smooth, and the filters' table "
               "interpolates them (cfconv takes it)");
  MIRAGE_CHECK(s.rbf <= kMaxTableRbf, op, ": weight1 must have at most ", kMaxTableRbf, " columns R (the radial "
               "functions: the filters' table grows with them), got R=", s.rbf);
  check_like_x(op, distances, "distances", x);
  MIRAGE_CHECK(distances.dim() == 1 && distances.size(0) == s.pairs, op, ": distances must have shape [P] = [",
               s.pairs, "] (P from pairs), got ", distances.sizes());
  MIRAGE_CHECK(basis == "gaussian" || basis == "bessel", op, ": basis must be \"gaussian\" or \"bessel\", got \"",
               basis, "\"");
  check_radial_basis(distances, basis, s.rbf, cutoff, envelope, op);  // the envelope's name, the cutoff
  MIRAGE_CHECK(envelope != "none", op, ": envelope must be \"cosine\" or \"polynomial\" (the filters' table "
               "covers [0, cutoff), where they must vanish), got \"none\"");
  check_sender_order(op, sender_order, pairs);
  return s;
}

CfconvShape check_radial_cfconv_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& distances,
                                         const at::Tensor& pairs, const at::Tensor& table, double cutoff,
                                         const std::optional<at::Tensor>& sender_order) {
  constexpr std::string_view op = kRadialCfconvBackward;
  const CfconvShape s = check_messages(op, x, pairs);
  check_like_x(op, grad, "grad", x);
  MIRAGE_CHECK(grad.sizes() == x.sizes(), op, ": grad must have x's shape ", x.sizes(), ", got ", grad.sizes());
  check_like_x(op, distances, "distances", x);
  MIRAGE_CHECK(distances.dim() == 1 && distances.size(0) == s.pairs, op, ": distances must have shape [P] = [",
               s.pairs, "] (P from pairs), got ", distances.sizes());
  check_like_x(op, table, "table", x);
  MIRAGE_CHECK(table.dim() == 3 && table.size(0) >= 1 && table.size(1) == cuda::filter_table::kCoefficients &&
                   table.size(2) == s.width,
               op, ": table must have shape [intervals, 6, M] = [*, 6, ", s.width, "] (radial_cfconv's), got ",
               table.sizes());
  check_cutoff(op, cutoff);
  check_sender_order(op, sender_order, pairs);
  return s;
}

namespace {

at::Tensor optional_f64(const std::optional<at::Tensor>& t) {
  return present(t) ? t->to(at::kDouble) : at::Tensor();
}

// Per-pair values of the walked pairs, zeros appended for the skipped padding: [P, ...].
at::Tensor padded(const at::Tensor& walked, int64_t P) {
  std::vector<int64_t> tail(walked.sizes().begin(), walked.sizes().end());
  tail[0] = P - walked.size(0);
  return at::cat({walked, at::zeros(tail, walked.options())});
}

// The references, in float64 from the definitions (docs/ops.md).
std::tuple<at::Tensor, at::Tensor> cfconv_cpu(const at::Tensor& x, const at::Tensor& basis, const at::Tensor& envelope,
                                              const at::Tensor& pairs, const at::Tensor& weight1,
                                              const std::optional<at::Tensor>& bias1, const at::Tensor& weight2,
                                              const std::optional<at::Tensor>& bias2, c10::string_view activation,
                                              bool /*tf32: the reference is float64*/,
    const std::optional<at::Tensor>& sender_order /*the reference sums in its own order*/,
    const std::optional<at::Tensor>& num_pairs) {
  const CfconvShape s = check_cfconv(kCfconv, x, basis, envelope, pairs, weight1, bias1, weight2, bias2, activation,
                                     sender_order, num_pairs);
  const int64_t walked = walked_pairs_on_cpu(num_pairs, s.pairs);  // the rest is padding: skipped
  const at::Tensor idx = pairs.narrow(1, 0, walked).contiguous();
  check_pair_indices(kCfconv, idx, s.nodes);
  const std::string act(activation);
  const at::Tensor pre =
      at::linear(basis.narrow(0, 0, walked).to(at::kDouble), weight1.to(at::kDouble), optional_f64(bias1));
  const at::Tensor filters = at::linear(reference_activation(pre, act), weight2.to(at::kDouble), optional_f64(bias2));
  const at::Tensor messages = x.to(at::kDouble).index_select(0, idx[1]) * filters *
                              envelope.narrow(0, 0, walked).to(at::kDouble).unsqueeze(1);
  const at::Tensor out = at::zeros({s.nodes, s.width}, messages.options()).index_add_(0, idx[0], messages);
  return {out.to(x.scalar_type()), padded(filters, s.pairs).to(x.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cfconv_backward_cpu(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& basis, const at::Tensor& envelope,
    const at::Tensor& pairs, const at::Tensor& filters, const at::Tensor& weight1,
    const std::optional<at::Tensor>& bias1, const at::Tensor& weight2, c10::string_view activation,
    bool /*tf32: the reference is float64*/,
    const std::optional<at::Tensor>& sender_order /*the reference sums in its own order*/,
    const std::optional<at::Tensor>& num_pairs) {
  const CfconvShape s = check_cfconv(kCfconvBackward, x, basis, envelope, pairs, weight1, bias1, weight2,
                                     std::nullopt, activation, sender_order, num_pairs);
  check_cfconv_backward(grad, filters, x, s);
  const int64_t walked = walked_pairs_on_cpu(num_pairs, s.pairs);  // the rest is padding: zero gradients
  const at::Tensor idx = pairs.narrow(1, 0, walked).contiguous();
  check_pair_indices(kCfconvBackward, idx, s.nodes);
  const at::Tensor f = filters.narrow(0, 0, walked).to(at::kDouble);
  const at::Tensor e = envelope.narrow(0, 0, walked).to(at::kDouble).unsqueeze(1);
  const at::Tensor grad_i = grad.to(at::kDouble).index_select(0, idx[0]);
  const at::Tensor grad_filter = grad_i * x.to(at::kDouble).index_select(0, idx[1]);
  const at::Tensor grad_x = at::zeros({s.nodes, s.width}, f.options()).index_add_(0, idx[1], grad_i * f * e);
  const at::Tensor grad_envelope = (grad_filter * f).sum(1);
  const at::Tensor w1 = weight1.to(at::kDouble);
  const at::Tensor pre = at::linear(basis.narrow(0, 0, walked).to(at::kDouble), w1, optional_f64(bias1));
  const at::Tensor grad_pre =
      at::matmul(grad_filter * e, weight2.to(at::kDouble)) * reference_activation_grad(pre, std::string(activation));
  const at::Tensor grad_basis = at::matmul(grad_pre, w1);
  const auto dtype = x.scalar_type();
  return {grad_x.to(dtype), padded(grad_basis, s.pairs).to(dtype), padded(grad_envelope, s.pairs).to(dtype)};
}

std::tuple<at::Tensor, at::Tensor> cfconv_meta(const at::Tensor& x, const at::Tensor& basis,
                                               const at::Tensor& envelope, const at::Tensor& pairs,
                                               const at::Tensor& weight1, const std::optional<at::Tensor>& bias1,
                                               const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
                                               c10::string_view activation, bool /*tf32*/,
                                               const std::optional<at::Tensor>& sender_order,
                                               const std::optional<at::Tensor>& num_pairs) {
  const CfconvShape s = check_cfconv(kCfconv, x, basis, envelope, pairs, weight1, bias1, weight2, bias2, activation,
                                     sender_order, num_pairs);
  return {at::empty({s.nodes, s.width}, x.options()), at::empty({s.pairs, s.width}, x.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cfconv_backward_meta(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& basis, const at::Tensor& envelope,
    const at::Tensor& pairs, const at::Tensor& filters, const at::Tensor& weight1,
    const std::optional<at::Tensor>& bias1, const at::Tensor& weight2, c10::string_view activation,
    bool /*tf32*/, const std::optional<at::Tensor>& sender_order, const std::optional<at::Tensor>& num_pairs) {
  const CfconvShape s = check_cfconv(kCfconvBackward, x, basis, envelope, pairs, weight1, bias1, weight2,
                                     std::nullopt, activation, sender_order, num_pairs);
  check_cfconv_backward(grad, filters, x, s);
  return {at::empty({s.nodes, s.width}, x.options()), at::empty({s.pairs, s.rbf}, x.options()),
          at::empty({s.pairs}, x.options())};
}

// radial_cfconv's table (cuda/filter_table.h), float64: the basis, activation and envelope jets
// of cuda/jets.h at the pieces' ends, the network's products by ATen, each piece's quintic.
at::Tensor reference_filter_table(const at::Tensor& weight1, const std::optional<at::Tensor>& bias1,
                                  const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
                                  std::string_view activation, std::string_view basis, double cutoff,
                                  std::string_view envelope) {
  using namespace cuda::filter_table;
  using namespace cuda::jets;
  const int64_t H = weight1.size(0), R = weight1.size(1), M = weight2.size(0);
  const int64_t intervals = intervals_for(kernel_basis(basis), R), ends = intervals + 1;
  const double width = cutoff / static_cast<double>(intervals);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  at::Tensor b = at::empty({3, ends, R}, f64);  // the basis and its two derivatives at the ends
  auto bv = b.accessor<double, 3>();
  for (int64_t e = 0; e < ends; ++e)
    for (int64_t r = 0; r < R; ++r) {
      const Jet j = basis_jet(kernel_basis(basis), static_cast<int>(r), static_cast<int>(R), e * width, cutoff);
      bv[0][e][r] = j.v;
      bv[1][e][r] = j.d1;
      bv[2][e][r] = j.d2;
    }
  const at::Tensor w1 = weight1.to(at::kDouble);
  const at::Tensor z = at::linear(b[0], w1, optional_f64(bias1)), t = at::matmul(b[1], w1.t());
  const at::Tensor u = at::matmul(b[2], w1.t());
  at::Tensor a = at::empty({3, ends, H}, f64);  // act(z) and its two derivatives in d
  auto av = a.accessor<double, 3>();
  const auto zv = z.accessor<double, 2>(), tv = t.accessor<double, 2>(), uv = u.accessor<double, 2>();
  for (int64_t e = 0; e < ends; ++e)
    for (int64_t h = 0; h < H; ++h) {
      const Jet j = activation_jet(kernel_activation(activation), zv[e][h]);
      av[0][e][h] = j.v;
      av[1][e][h] = j.d1 * tv[e][h];
      av[2][e][h] = j.d2 * tv[e][h] * tv[e][h] + j.d1 * uv[e][h];
    }
  at::Tensor f = at::matmul(a, weight2.to(at::kDouble).t());  // [3, ends, M]
  if (present(bias2)) f[0] += bias2->to(at::kDouble);
  at::Tensor table = at::empty({intervals, kCoefficients, M}, f64);
  auto out = table.accessor<double, 3>();
  const auto fv = f.accessor<double, 3>();
  for (int64_t m = 0; m < M; ++m) {
    Jet left{};
    for (int64_t e = 0; e < ends; ++e) {
      const Jet right = times({fv[0][e][m], fv[1][e][m], fv[2][e][m]},
                              envelope_jet(kernel_cutoff_fn(envelope), e * width, cutoff));
      if (e > 0) {
        double c[kCoefficients];
        quintic(left, right, width, c);
        for (int q = 0; q < kCoefficients; ++q) out[e - 1][q][m] = c[q];
      }
      left = right;
    }
  }
  return table;
}

// The table's filters [P, M] at the distances (kSlope: their derivative in d), float64: 0 at and
// past the cutoff, NaN at negative and NaN distances (as the CUDA kernels).
at::Tensor table_filters(const at::Tensor& table, const at::Tensor& distances, double cutoff, bool slope) {
  const int64_t intervals = table.size(0);
  const at::Tensor d = distances.to(at::kDouble);
  const at::Tensor past = (d >= cutoff).unsqueeze(1), invalid = (~(d >= 0)).unsqueeze(1);
  const at::Tensor u = at::where(d >= 0, d, 0.0) * (intervals / cutoff);
  const at::Tensor piece = u.floor().clamp(0, intervals - 1);
  const at::Tensor s = (u - piece).unsqueeze(1);
  const at::Tensor c = table.to(at::kDouble).index_select(0, piece.to(at::kLong));  // [P, 6, M]
  at::Tensor f = at::zeros_like(c.select(1, 0));
  for (int64_t q = cuda::filter_table::kCoefficients - 1; q >= (slope ? 1 : 0); --q) {
    f = f * s + c.select(1, q) * (slope ? static_cast<double>(q) : 1.0);
  }
  if (slope) f = f * (intervals / cutoff);
  return at::where(invalid, NAN, at::where(past, 0.0, f));
}

std::tuple<at::Tensor, at::Tensor> radial_cfconv_cpu(
    const at::Tensor& x, const at::Tensor& distances, const at::Tensor& pairs, const at::Tensor& weight1,
    const std::optional<at::Tensor>& bias1, const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
    c10::string_view activation, c10::string_view basis, double cutoff, c10::string_view envelope,
    const std::optional<at::Tensor>& sender_order /*the reference sums in its own order*/) {
  const CfconvShape s =
      check_radial_cfconv(x, distances, pairs, weight1, bias1, weight2, bias2, activation, basis, cutoff, envelope,
                          sender_order);
  const at::Tensor idx = pairs.contiguous();
  check_pair_indices(kRadialCfconv, idx, s.nodes);
  const at::Tensor table = reference_filter_table(weight1, bias1, weight2, bias2, activation, basis, cutoff, envelope);
  const at::Tensor messages =
      x.to(at::kDouble).index_select(0, idx[1]) * table_filters(table, distances, cutoff, false);
  const at::Tensor out = at::zeros({s.nodes, s.width}, messages.options()).index_add_(0, idx[0], messages);
  return {out.to(x.scalar_type()), table.to(x.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> radial_cfconv_backward_cpu(const at::Tensor& grad, const at::Tensor& x,
                                                              const at::Tensor& distances, const at::Tensor& pairs,
                                                              const at::Tensor& table, double cutoff,
                                                              const std::optional<at::Tensor>& sender_order) {
  const CfconvShape s = check_radial_cfconv_backward(grad, x, distances, pairs, table, cutoff, sender_order);
  const at::Tensor idx = pairs.contiguous();
  check_pair_indices(kRadialCfconvBackward, idx, s.nodes);
  const at::Tensor grad_i = grad.to(at::kDouble).index_select(0, idx[0]);
  const at::Tensor grad_x = at::zeros({s.nodes, s.width}, grad_i.options())
                                .index_add_(0, idx[1], grad_i * table_filters(table, distances, cutoff, false));
  const at::Tensor grad_distances =
      (grad_i * x.to(at::kDouble).index_select(0, idx[1]) * table_filters(table, distances, cutoff, true)).sum(1);
  return {grad_x.to(x.scalar_type()), grad_distances.to(x.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> radial_cfconv_meta(
    const at::Tensor& x, const at::Tensor& distances, const at::Tensor& pairs, const at::Tensor& weight1,
    const std::optional<at::Tensor>& bias1, const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
    c10::string_view activation, c10::string_view basis, double cutoff, c10::string_view envelope,
    const std::optional<at::Tensor>& sender_order) {
  const CfconvShape s =
      check_radial_cfconv(x, distances, pairs, weight1, bias1, weight2, bias2, activation, basis, cutoff, envelope,
                          sender_order);
  const int64_t intervals = cuda::filter_table::intervals_for(kernel_basis(basis), s.rbf);
  return {at::empty({s.nodes, s.width}, x.options()),
          at::empty({intervals, cuda::filter_table::kCoefficients, s.width}, x.options())};
}

std::tuple<at::Tensor, at::Tensor> radial_cfconv_backward_meta(const at::Tensor& grad, const at::Tensor& x,
                                                               const at::Tensor& distances, const at::Tensor& pairs,
                                                               const at::Tensor& table, double cutoff,
                                                               const std::optional<at::Tensor>& sender_order) {
  const CfconvShape s = check_radial_cfconv_backward(grad, x, distances, pairs, table, cutoff, sender_order);
  return {at::empty({s.nodes, s.width}, x.options()), at::empty({s.pairs}, x.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) {
  m.impl("schnet_energy", &schnet_energy_cpu);
  m.impl("schnet_energy_all_pairs", &schnet_energy_all_pairs_cpu);
  m.impl("schnet_energy_prepare", &schnet_energy_prepare_cpu);
  m.impl("radial_cfconv", &radial_cfconv_cpu);
  m.impl("radial_cfconv_backward", &radial_cfconv_backward_cpu);
  m.impl("cfconv", &cfconv_cpu);
  m.impl("cfconv_backward", &cfconv_backward_cpu);
}
TORCH_LIBRARY_IMPL(mirage, Meta, m) {
  m.impl("schnet_energy", &schnet_energy_meta);
  m.impl("schnet_energy_all_pairs", &schnet_energy_all_pairs_meta);
  m.impl("schnet_energy_prepare", &schnet_energy_prepare_meta);
  m.impl("cfconv", &cfconv_meta);
  m.impl("cfconv_backward", &cfconv_backward_meta);
  m.impl("radial_cfconv", &radial_cfconv_meta);
  m.impl("radial_cfconv_backward", &radial_cfconv_backward_meta);
}

}  // namespace mirage::ops
