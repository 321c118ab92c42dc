// mirage::schnet_energy: checks and shapes shared by the CPU, Meta and CUDA kernels.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

namespace mirage::ops {

inline constexpr std::string_view kSchnetEnergy = "mirage::schnet_energy";
// The activations between two Linears, by the names mirage.ff.fused.ACTIVATIONS uses.
inline constexpr std::string_view kSchnetActivations[] = {"shifted_softplus", "softplus", "silu",
                                                          "tanh", "gelu", "relu"};
// Tensors per interaction in `weights`: filter.0 (w, b), filter.2 (w, b), in2f (w, b),
// f2out.0 (w, b), f2out.2 (w, b); then the readout's four: readout.0 (w, b), readout.2 (w, b).
inline constexpr int64_t kSchnetWeightsPerInteraction = 10;
inline constexpr int64_t kSchnetReadoutWeights = 4;

struct SchnetShape {
  int64_t atoms, pairs, interactions;
  int64_t rbf, filter_hidden, message_width, features, update_hidden, readout_hidden;
};

// Checks every argument (not the index values) and returns the sizes.
SchnetShape check_schnet_energy(const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                                const at::Tensor& pairs, const at::Tensor& vectors, double cutoff,
                                int64_t num_rbf, at::TensorList weights, std::string_view activations);

// `activations` ("filter,update_0,...,update_{T-1},readout") split at the commas.
std::vector<std::string> split_activations(std::string_view activations);

}  // namespace mirage::ops
