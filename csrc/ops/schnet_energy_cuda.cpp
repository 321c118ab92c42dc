// mirage::schnet_energy on CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../cuda/schnet_energy.cuh"
#include "cuda_utils.h"
#include "schnet_energy.h"

namespace mirage::ops {
namespace {

cuda::Activation kernel_activation(const std::string& name) {
  if (name == "shifted_softplus") return cuda::Activation::kShiftedSoftplus;
  if (name == "softplus") return cuda::Activation::kSoftplus;
  if (name == "silu") return cuda::Activation::kSilu;
  if (name == "tanh") return cuda::Activation::kTanh;
  if (name == "gelu") return cuda::Activation::kGelu;
  return cuda::Activation::kRelu;  // the checks admit nothing else
}

std::tuple<at::Tensor, at::Tensor> schnet_energy_cuda(const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                                                      const at::Tensor& pairs, const at::Tensor& vectors,
                                                      double cutoff, int64_t num_rbf, at::TensorList weights,
                                                      c10::string_view activations) {
  const SchnetShape s = check_schnet_energy(atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights,
                                            activations);
  const c10::cuda::CUDAGuard guard(embedding.device());
  at::Tensor energy = at::zeros({}, embedding.options());
  at::Tensor grad_vectors = at::empty({s.pairs, 3}, embedding.options());
  if (s.atoms == 0) return {energy, grad_vectors};  // then there are no pairs either (checked)

  std::vector<at::Tensor> held;  // contiguous copies live until the launch is queued
  const auto ptr = [&held](const at::Tensor& t) -> const float* {
    if (t.numel() == 0) return nullptr;  // an absent bias
    held.push_back(t.contiguous());
    return held.back().const_data_ptr<float>();
  };
  const at::Tensor z = atomic_numbers.contiguous(), idx = pairs.contiguous();
  cuda::SchnetEnergyParams p{};
  p.atomic_numbers = z.const_data_ptr<int64_t>();
  p.embedding = ptr(embedding);
  p.pairs = idx.const_data_ptr<int64_t>();
  p.vectors = ptr(vectors);
  p.energy = energy.mutable_data_ptr<float>();
  p.grad_vectors = grad_vectors.mutable_data_ptr<float>();
  p.num_atoms = s.atoms;
  p.num_pairs = s.pairs;
  p.num_embeddings = embedding.size(0);
  p.num_rbf = static_cast<int>(s.rbf);
  p.filter_hidden = static_cast<int>(s.filter_hidden);
  p.message_width = static_cast<int>(s.message_width);
  p.features = static_cast<int>(s.features);
  p.update_hidden = static_cast<int>(s.update_hidden);
  p.readout_hidden = static_cast<int>(s.readout_hidden);
  p.num_interactions = static_cast<int>(s.interactions);
  p.cutoff = static_cast<float>(cutoff);
  const std::vector<std::string> names = split_activations(activations);
  p.filter_activation = kernel_activation(names.front());
  p.readout_activation = kernel_activation(names.back());
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
  const int64_t r0 = s.interactions * kSchnetWeightsPerInteraction;
  p.readout1_w = ptr(weights[r0]);
  p.readout1_b = ptr(weights[r0 + 1]);
  p.readout2_w = ptr(weights[r0 + 2]);
  p.readout2_b = ptr(weights[r0 + 3]);
  // From the caching allocator (graph-safe); the kernel initializes what it reads.
  const at::Tensor workspace = at::empty({static_cast<int64_t>(cuda::schnet_energy_workspace_bytes(p))},
                                         embedding.options().dtype(at::kByte));
  p.workspace = workspace.mutable_data_ptr();
  check_launch(kSchnetEnergy, cuda::launch_schnet_energy(p, c10::cuda::getCurrentCUDAStream()));
  return {energy, grad_vectors};
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) { m.impl("schnet_energy", &schnet_energy_cuda); }

}  // namespace mirage::ops
