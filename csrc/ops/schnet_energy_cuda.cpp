// mirage::schnet_energy, mirage::painn_energy, mirage::cfconv and mirage::radial_cfconv (with their
// backwards) on CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../cuda/cfconv.cuh"
#include "../../cuda/filter_table.h"
#include "../../cuda/painn_energy.cuh"
#include "../../cuda/schnet_energy.cuh"
#include "checks.h"
#include "cuda_utils.h"
#include "pair_order.h"
#include "schnet_energy.h"

namespace mirage::ops {
namespace {

// t as a contiguous tensor whose data is 16-byte aligned (the kernels move rows as float4): a
// copy only for a view that starts at an odd offset.
at::Tensor aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return is_16_byte_aligned(c) ? c : c.clone();
}

// Float inputs' device pointers for a launch: contiguous copies where needed, kept alive until the
// launch is queued; an empty tensor (an absent bias) gives null.
class HeldInputs {
 public:
  const float* operator()(const at::Tensor& t) {
    if (t.numel() == 0) return nullptr;
    held_.push_back(t.contiguous());
    return held_.back().const_data_ptr<float>();
  }

 private:
  std::vector<at::Tensor> held_;
};

// What the whole-model ops' wrappers share: the outputs, the common fields of their kernel
// parameters (the readout: the last four weights and the last activation), contiguous copies of
// the inputs (alive until the launch is queued; `fill` gets the function that makes them, for the
// interactions' weights, and the activations by name), the workspace and the launch. `pairs`
// [2, P] and `vectors` [P, 3], or both undefined for every pair of an open system, P = N (N - 1)
// (schnet_energy_all_pairs: its fill sets the positions).
template <class Params, class Fill>
EnergyOutputs run_energy(std::string_view op, int64_t atoms, int64_t num_pairs, const at::Tensor& atomic_numbers,
                         const at::Tensor& embedding, const at::Tensor& pairs,
                         const at::Tensor& vectors, double cutoff, at::TensorList weights,
                         std::string_view activations, Fill fill,
                         size_t (*workspace_bytes)(const Params&),
                         cudaError_t (*launch)(const Params&, cudaStream_t)) {
  const c10::cuda::CUDAGuard guard(embedding.device());
  at::Tensor grad_vectors = at::empty({num_pairs, 3}, embedding.options());
  at::Tensor grad_positions = at::empty({atoms, 3}, embedding.options());
  // No atoms: no pairs either (checked), and the energy is 0; otherwise the kernel writes it.
  if (atoms == 0) return {at::zeros({}, embedding.options()), grad_vectors, grad_positions};
  at::Tensor energy = at::empty({}, embedding.options());

  HeldInputs ptr;
  const at::Tensor z = atomic_numbers.contiguous(), idx = pairs.defined() ? pairs.contiguous() : at::Tensor();
  Params p{};
  p.atomic_numbers = z.const_data_ptr<int64_t>();
  p.embedding = ptr(embedding);
  p.pairs = idx.defined() ? idx.const_data_ptr<int64_t>() : nullptr;
  p.vectors = vectors.defined() ? ptr(vectors) : nullptr;
  p.energy = energy.mutable_data_ptr<float>();
  p.grad_vectors = grad_vectors.mutable_data_ptr<float>();
  p.grad_positions = grad_positions.mutable_data_ptr<float>();
  p.num_atoms = atoms;
  p.num_pairs = num_pairs;
  p.num_embeddings = embedding.size(0);
  p.cutoff = static_cast<float>(cutoff);
  const std::vector<std::string> names = split_activations(activations);
  p.readout_activation = kernel_activation(names.back());
  const int64_t r0 = static_cast<int64_t>(weights.size()) - kEnergyReadoutWeights;
  p.readout1_w = ptr(weights[r0]);
  p.readout1_b = ptr(weights[r0 + 1]);
  p.readout2_w = ptr(weights[r0 + 2]);
  p.readout2_b = ptr(weights[r0 + 3]);
  fill(p, ptr, names);
  const at::Tensor workspace = workspace_for(workspace_bytes(p), embedding);  // the kernel initializes what it reads
  p.workspace = workspace.mutable_data_ptr();
  check_launch(op, launch(p, c10::cuda::getCurrentCUDAStream()));
  return {energy, grad_vectors, grad_positions};
}

// schnet_energy's kernel parameters from the weights (all but the readout's, which run_energy
// fills).
void fill_schnet(cuda::SchnetEnergyParams& p, const SchnetShape& s, at::TensorList weights, HeldInputs& ptr,
                 const std::vector<std::string>& names) {
  p.num_rbf = static_cast<int>(s.rbf);
  p.filter_hidden = static_cast<int>(s.filter_hidden);
  p.message_width = static_cast<int>(s.message_width);
  p.features = static_cast<int>(s.features);
  p.update_hidden = static_cast<int>(s.update_hidden);
  p.readout_hidden = static_cast<int>(s.readout_hidden);
  p.num_interactions = static_cast<int>(s.interactions);
  p.filter_activation = kernel_activation(names.front());
  for (int64_t t = 0; t < s.interactions; ++t) {
    const int64_t b = t * kSchnetWeightsPerInteraction;
    cuda::SchnetInteraction& layer = p.interactions[t];
    layer.filter1_w = ptr(weights[b]);
    layer.filter1_b = ptr(weights[b + 1]);
    layer.filter2_w = ptr(weights[b + 2]);
    layer.filter2_b = ptr(weights[b + 3]);
    layer.in2f_w = ptr(weights[b + 4]);
    layer.in2f_b = ptr(weights[b + 5]);
    layer.f2out1_w = ptr(weights[b + 6]);
    layer.f2out1_b = ptr(weights[b + 7]);
    layer.f2out2_w = ptr(weights[b + 8]);
    layer.f2out2_b = ptr(weights[b + 9]);
    layer.update_activation = kernel_activation(names[t + 1]);
  }
}

EnergyOutputs schnet_energy_cuda(const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                                 const at::Tensor& pairs, const at::Tensor& vectors,
                                 double cutoff, int64_t num_rbf, at::TensorList weights,
                                 c10::string_view activations,
                                 const std::optional<at::Tensor>& prepared) {
  const SchnetShape s = check_schnet_energy(atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights,
                                            activations, prepared);
  const at::Tensor tables = present(prepared) ? aligned(*prepared) : at::Tensor();  // read as float4s
  const auto fill = [&](cuda::SchnetEnergyParams& p, HeldInputs& ptr, const std::vector<std::string>& names) {
    fill_schnet(p, s, weights, ptr, names);
    p.prepared = tables.defined() ? ptr(tables) : nullptr;
  };
  return run_energy(kSchnetEnergy, s.atoms, s.pairs, atomic_numbers, embedding, pairs, vectors, cutoff, weights,
                    activations, fill, &cuda::schnet_energy_workspace_bytes, &cuda::launch_schnet_energy);
}

std::tuple<at::Tensor, at::Tensor> schnet_energy_all_pairs_cuda(
    const at::Tensor& atomic_numbers, const at::Tensor& embedding, const at::Tensor& positions, double cutoff,
    int64_t num_rbf, at::TensorList weights, c10::string_view activations, const std::optional<at::Tensor>& prepared,
    const std::optional<at::Tensor>& num_pairs) {
  const SchnetShape s = check_schnet_energy_all_pairs(atomic_numbers, embedding, positions, cutoff, num_rbf, weights,
                                                      activations, prepared, num_pairs);
  const at::Tensor tables = present(prepared) ? aligned(*prepared) : at::Tensor();  // read as float4s
  // The count is written in place by the kernel (the model's buffer: no copy a call); one element,
  // so contiguous.
  const bool count = present(num_pairs);
  const auto fill = [&](cuda::SchnetEnergyParams& p, HeldInputs& ptr, const std::vector<std::string>& names) {
    fill_schnet(p, s, weights, ptr, names);
    p.prepared = tables.defined() ? ptr(tables) : nullptr;
    p.positions = ptr(positions);
    p.found_pairs = count ? num_pairs->mutable_data_ptr<int64_t>() : nullptr;
  };
  auto [energy, grad_vectors, grad_positions] =
      run_energy(kSchnetEnergyAllPairs, s.atoms, s.pairs, atomic_numbers, embedding, at::Tensor(), at::Tensor(), cutoff,
                 weights, activations, fill, &cuda::schnet_energy_workspace_bytes, &cuda::launch_schnet_energy);
  if (count && s.atoms == 0) num_pairs->zero_();  // no launch
  return {energy, grad_positions};
}

at::Tensor schnet_energy_prepare_cuda(const at::Tensor& embedding, double cutoff, int64_t num_rbf,
                                      at::TensorList weights, c10::string_view activations) {
  const SchnetShape s = check_schnet_energy_prepare(embedding, cutoff, num_rbf, weights, activations);
  const c10::cuda::CUDAGuard guard(embedding.device());
  HeldInputs ptr;
  cuda::SchnetEnergyParams p{};
  fill_schnet(p, s, weights, ptr, split_activations(activations));
  p.embedding = ptr(embedding);
  p.num_embeddings = s.embeddings;
  p.readout1_w = ptr(weights[s.interactions * kSchnetWeightsPerInteraction]);
  p.cutoff = static_cast<float>(cutoff);
  MIRAGE_CHECK(cuda::schnet_prepare_supported(p), kSchnetEnergyPrepare,
               ": the table kernel must fit the device's shared memory (about 216 (R + H) + 45,000 bytes: "
               "radial_cfconv's); got R=", s.rbf, ", H=", s.filter_hidden, " on ", embedding.device());
  // Zeros: the padding between the transposed matrices too, as on the CPU.
  at::Tensor prepared = at::zeros({schnet_prepared_size(s)}, embedding.options());
  check_launch(kSchnetEnergyPrepare,
               cuda::launch_schnet_prepare(p, prepared.mutable_data_ptr<float>(), c10::cuda::getCurrentCUDAStream()));
  return prepared;
}

EnergyOutputs painn_energy_cuda(const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                                const at::Tensor& pairs, const at::Tensor& vectors, double cutoff,
                                int64_t num_rbf, at::TensorList weights,
                                c10::string_view activations, double norm_eps) {
  const PainnShape s = check_painn_energy(atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights,
                                          activations, norm_eps);
  MIRAGE_CHECK(s.rbf <= cuda::kPainnMaxRbf, kPainnEnergy, ": num_rbf must be <= ", cuda::kPainnMaxRbf,
               " on CUDA (a pair's basis rows in a block's shared memory), got ", s.rbf);
  const auto fill = [&](cuda::PainnEnergyParams& p, HeldInputs& ptr, const std::vector<std::string>& names) {
    p.num_rbf = static_cast<int>(s.rbf);
    p.features = static_cast<int>(s.features);
    p.phi_hidden = static_cast<int>(s.phi_hidden);
    p.update_hidden = static_cast<int>(s.update_hidden);
    p.readout_hidden = static_cast<int>(s.readout_hidden);
    p.num_interactions = static_cast<int>(s.interactions);
    p.norm_eps = static_cast<float>(norm_eps);
    for (int64_t t = 0; t < s.interactions; ++t) {
      const int64_t b = t * kPainnWeightsPerInteraction;
      cuda::PainnInteraction& layer = p.interactions[t];
      layer.phi1_w = ptr(weights[b]);
      layer.phi1_b = ptr(weights[b + 1]);
      layer.phi2_w = ptr(weights[b + 2]);
      layer.phi2_b = ptr(weights[b + 3]);
      layer.filter_w = ptr(weights[b + 4]);
      layer.filter_b = ptr(weights[b + 5]);
      layer.u_w = ptr(weights[b + 6]);
      layer.v_w = ptr(weights[b + 7]);
      layer.mlp1_w = ptr(weights[b + 8]);
      layer.mlp1_b = ptr(weights[b + 9]);
      layer.mlp2_w = ptr(weights[b + 10]);
      layer.mlp2_b = ptr(weights[b + 11]);
      layer.phi_activation = kernel_activation(names[t]);
      layer.update_activation = kernel_activation(names[s.interactions + t]);
    }
  };
  return run_energy(kPainnEnergy, s.atoms, s.pairs, atomic_numbers, embedding, pairs, vectors, cutoff, weights,
                    activations, fill, &cuda::painn_energy_workspace_bytes, &cuda::launch_painn_energy);
}


// The filter network for the kernels; `held` keeps the contiguous copies alive until the launch.
cuda::CfconvWeights cfconv_weights(std::string_view op, const CfconvShape& s, const at::Tensor& weight1,
                                   const std::optional<at::Tensor>& bias1, const at::Tensor& weight2,
                                   const std::optional<at::Tensor>& bias2, c10::string_view activation, bool tf32,
                                   std::vector<at::Tensor>& held) {
  MIRAGE_CHECK(cuda::cfconv_supported(s.rbf, s.hidden, s.width), op,
               ": the CUDA kernels take a filter network with H == M, 64 or 128 wide, and R <= 64 basis "
               "functions, on a GPU with TF32 tensor cores and the shared memory per block they need (147-205 KiB at "
               "width 128, 63-105 KiB at width 64, growing with R); "
               "got R=", s.rbf, ", H=", s.hidden, ", M=", s.width, " (use mirage::message_passing with the filters "
               "computed by PyTorch otherwise)");
  MIRAGE_CHECK(s.nodes < INT32_MAX, op, ": at most 2^31 - 2 nodes on CUDA, got ", s.nodes);
  const auto ptr = [&held](const at::Tensor& t) {
    held.push_back(aligned(t));
    return held.back().const_data_ptr<float>();
  };
  cuda::CfconvWeights w{};
  w.w1 = ptr(weight1);
  w.b1 = present(bias1) ? ptr(*bias1) : nullptr;
  w.w2 = ptr(weight2);
  w.b2 = present(bias2) ? ptr(*bias2) : nullptr;
  w.num_rbf = static_cast<int>(s.rbf);
  w.width = static_cast<int>(s.width);
  w.activation = kernel_activation(std::string(activation));
  w.tf32 = tf32;
  return w;
}

std::tuple<at::Tensor, at::Tensor> cfconv_cuda(const at::Tensor& x, const at::Tensor& basis,
                                               const at::Tensor& envelope, const at::Tensor& pairs,
                                               const at::Tensor& weight1, const std::optional<at::Tensor>& bias1,
                                               const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
                                               c10::string_view activation, bool tf32,
                                               const std::optional<at::Tensor>& sender_order /*its backward's*/,
                                               const std::optional<at::Tensor>& num_pairs) {
  const CfconvShape s = check_cfconv(kCfconv, x, basis, envelope, pairs, weight1, bias1, weight2, bias2, activation,
                                     sender_order, num_pairs);
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<at::Tensor> held;
  cuda::CfconvParams p{};
  p.weights = cfconv_weights(kCfconv, s, weight1, bias1, weight2, bias2, activation, tf32, held);
  const at::Tensor xc = aligned(x), basis_c = basis.contiguous(), envelope_c = envelope.contiguous();
  const at::Tensor idx = pairs.contiguous(), count = contiguous_or_undefined(num_pairs);
  at::Tensor out = at::empty({s.nodes, s.width}, x.options());
  at::Tensor filters = at::empty({s.pairs, s.width}, x.options());
  const at::Tensor invalid = at::empty({1}, x.options().dtype(at::kInt));  // zeroed on the stream
  p.x = xc.const_data_ptr<float>();
  p.basis = basis_c.const_data_ptr<float>();
  p.envelope = envelope_c.const_data_ptr<float>();
  p.pairs = idx.const_data_ptr<int64_t>();
  p.out = out.mutable_data_ptr<float>();
  p.filters = filters.mutable_data_ptr<float>();
  p.invalid = invalid.mutable_data_ptr<int>();
  p.live_pairs = static_cast<const int64_t*>(data_or_null(count));
  p.num_nodes = s.nodes;
  p.num_pairs = s.pairs;
  check_launch(kCfconv, cuda::launch_cfconv(p, c10::cuda::getCurrentCUDAStream()));
  return {out, filters};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cfconv_backward_cuda(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& basis, const at::Tensor& envelope,
    const at::Tensor& pairs, const at::Tensor& filters, const at::Tensor& weight1,
    const std::optional<at::Tensor>& bias1, const at::Tensor& weight2, c10::string_view activation, bool tf32,
    const std::optional<at::Tensor>& sender_order, const std::optional<at::Tensor>& num_pairs) {
  const CfconvShape s = check_cfconv(kCfconvBackward, x, basis, envelope, pairs, weight1, bias1, weight2,
                                     std::nullopt, activation, sender_order, num_pairs);
  check_cfconv_backward(grad, filters, x, s);
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<at::Tensor> held;
  cuda::CfconvBackwardParams p{};
  p.weights = cfconv_weights(kCfconvBackward, s, weight1, bias1, weight2, std::nullopt, activation, tf32, held);
  const at::Tensor grad_c = aligned(grad), xc = aligned(x), filters_c = aligned(filters);
  const at::Tensor basis_c = basis.contiguous(), envelope_c = envelope.contiguous(), idx = pairs.contiguous();
  const at::Tensor order = given_sender_order(sender_order), count = contiguous_or_undefined(num_pairs);
  at::Tensor grad_x = at::empty({s.nodes, s.width}, x.options());
  at::Tensor grad_basis = at::empty({s.pairs, s.rbf}, x.options());
  at::Tensor grad_envelope = at::empty({s.pairs}, x.options());
  const at::Tensor invalid = at::empty({1}, x.options().dtype(at::kInt));
  p.grad = grad_c.const_data_ptr<float>();
  p.x = xc.const_data_ptr<float>();
  p.basis = basis_c.const_data_ptr<float>();
  p.envelope = envelope_c.const_data_ptr<float>();
  p.pairs = idx.const_data_ptr<int64_t>();
  p.filters = filters_c.const_data_ptr<float>();
  p.grad_x = grad_x.mutable_data_ptr<float>();
  p.grad_basis = grad_basis.mutable_data_ptr<float>();
  p.grad_envelope = grad_envelope.mutable_data_ptr<float>();
  p.invalid = invalid.mutable_data_ptr<int>();
  p.sender_order = static_cast<const int*>(data_or_null(order));
  p.live_pairs = static_cast<const int64_t*>(data_or_null(count));
  p.num_nodes = s.nodes;
  p.num_pairs = s.pairs;
  const at::Tensor workspace =
      workspace_for(cuda::cfconv_backward_workspace_bytes(s.nodes, s.pairs, p.sender_order != nullptr), x);
  check_launch(kCfconvBackward,
               cuda::launch_cfconv_backward(p, workspace.mutable_data_ptr(), c10::cuda::getCurrentCUDAStream()));
  return {grad_x, grad_basis, grad_envelope};
}

// What both passes of radial_cfconv take: the sizes' check, the pairs and distances, the table.
cuda::RadialCfconvParams radial_pass(std::string_view op, const CfconvShape& s, const at::Tensor& distances,
                                     const at::Tensor& pairs, const at::Tensor& table, double cutoff,
                                     const at::Tensor& invalid, std::vector<at::Tensor>& held) {
  MIRAGE_CHECK(s.width % 4 == 0, op, ": the CUDA kernels take M (x's columns) a multiple of 4, got ", s.width);
  MIRAGE_CHECK(s.nodes < INT32_MAX, op, ": at most 2^31 - 2 nodes on CUDA, got ", s.nodes);
  cuda::RadialCfconvParams p{};
  held.push_back(distances.contiguous());
  p.distances = held.back().const_data_ptr<float>();
  held.push_back(pairs.contiguous());
  p.pairs = held.back().const_data_ptr<int64_t>();
  p.table = table.const_data_ptr<float>();
  p.intervals = table.size(0);
  p.cutoff = static_cast<float>(cutoff);
  p.invalid = invalid.mutable_data_ptr<int>();
  p.num_nodes = s.nodes;
  p.num_pairs = s.pairs;
  p.width = s.width;
  return p;
}

std::tuple<at::Tensor, at::Tensor> radial_cfconv_cuda(
    const at::Tensor& x, const at::Tensor& distances, const at::Tensor& pairs, const at::Tensor& weight1,
    const std::optional<at::Tensor>& bias1, const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
    c10::string_view activation, c10::string_view basis, double cutoff, c10::string_view envelope,
    const std::optional<at::Tensor>& sender_order /*its backward's*/) {
  const CfconvShape s = check_radial_cfconv(x, distances, pairs, weight1, bias1, weight2, bias2, activation, basis,
                                            cutoff, envelope, sender_order);
  const c10::cuda::CUDAGuard guard(x.device());
  MIRAGE_CHECK(cuda::radial_cfconv_supported(s.rbf, s.hidden, s.width), kRadialCfconv,
               ": the CUDA kernels take M (x's columns) a multiple of 4 and a network whose table kernel fits the "
               "device's shared memory (about 216 (R + H) + 45,000 bytes); got R=", s.rbf, ", H=", s.hidden,
               ", M=", s.width, " on ", x.device());
  std::vector<at::Tensor> held;
  const auto weight = [&held](const at::Tensor& t) {
    held.push_back(t.contiguous());
    return held.back().const_data_ptr<float>();
  };
  cuda::FilterTableParams t{};
  t.w1 = weight(weight1);
  t.b1 = present(bias1) ? weight(*bias1) : nullptr;
  t.w2 = weight(weight2);
  t.b2 = present(bias2) ? weight(*bias2) : nullptr;
  t.num_rbf = static_cast<int>(s.rbf);
  t.hidden = static_cast<int>(s.hidden);
  t.width = static_cast<int>(s.width);
  t.activation = kernel_activation(activation);
  t.basis = kernel_basis(basis);
  t.envelope = kernel_cutoff_fn(envelope);
  t.cutoff = static_cast<float>(cutoff);
  t.intervals = cuda::filter_table::intervals_for(t.basis, s.rbf);
  at::Tensor table = at::empty({t.intervals, cuda::filter_table::kCoefficients, s.width}, x.options());
  t.table = table.mutable_data_ptr<float>();
  at::Tensor out = at::empty({s.nodes, s.width}, x.options());
  const at::Tensor invalid = at::empty({1}, x.options().dtype(at::kInt));  // zeroed on the stream
  const at::Tensor xc = aligned(x);
  cuda::RadialCfconvParams p = radial_pass(kRadialCfconv, s, distances, pairs, table, cutoff, invalid, held);
  p.rows = xc.const_data_ptr<float>();
  p.out = out.mutable_data_ptr<float>();
  check_launch(kRadialCfconv, cuda::launch_radial_cfconv(t, p, c10::cuda::getCurrentCUDAStream()));
  return {out, table};
}

std::tuple<at::Tensor, at::Tensor> radial_cfconv_backward_cuda(const at::Tensor& grad, const at::Tensor& x,
                                                               const at::Tensor& distances, const at::Tensor& pairs,
                                                               const at::Tensor& table, double cutoff,
                                                               const std::optional<at::Tensor>& sender_order) {
  const CfconvShape s = check_radial_cfconv_backward(grad, x, distances, pairs, table, cutoff, sender_order);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor grad_c = aligned(grad), xc = aligned(x), table_c = aligned(table);
  const at::Tensor order = given_sender_order(sender_order);
  at::Tensor grad_x = at::empty({s.nodes, s.width}, x.options());
  at::Tensor grad_distances = at::empty({s.pairs}, x.options());
  const at::Tensor invalid = at::empty({1}, x.options().dtype(at::kInt));
  std::vector<at::Tensor> held;
  cuda::RadialCfconvParams p =
      radial_pass(kRadialCfconvBackward, s, distances, pairs, table_c, cutoff, invalid, held);
  p.rows = grad_c.const_data_ptr<float>();
  p.x = xc.const_data_ptr<float>();
  p.out = grad_x.mutable_data_ptr<float>();
  p.grad_distances = grad_distances.mutable_data_ptr<float>();
  p.sender_order = static_cast<const int*>(data_or_null(order));
  const at::Tensor workspace =
      workspace_for(cuda::cfconv_backward_workspace_bytes(s.nodes, s.pairs, p.sender_order != nullptr), x);
  check_launch(kRadialCfconvBackward, cuda::launch_radial_cfconv_backward(p, workspace.mutable_data_ptr(),
                                                                          c10::cuda::getCurrentCUDAStream()));
  return {grad_x, grad_distances};
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) {
  m.impl("radial_cfconv", &radial_cfconv_cuda);
  m.impl("radial_cfconv_backward", &radial_cfconv_backward_cuda);
  m.impl("schnet_energy", &schnet_energy_cuda);
  m.impl("schnet_energy_all_pairs", &schnet_energy_all_pairs_cuda);
  m.impl("schnet_energy_prepare", &schnet_energy_prepare_cuda);
  m.impl("painn_energy", &painn_energy_cuda);
  m.impl("cfconv", &cfconv_cuda);
  m.impl("cfconv_backward", &cfconv_backward_cuda);
}

}  // namespace mirage::ops
