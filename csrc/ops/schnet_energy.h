// mirage::schnet_energy, mirage::painn_energy and mirage::cfconv: checks and shapes shared by the CPU,
// Meta and CUDA kernels.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

namespace mirage::ops {

inline constexpr std::string_view kSchnetEnergy = "mirage::schnet_energy";
inline constexpr std::string_view kSchnetEnergyPrepare = "mirage::schnet_energy_prepare";
inline constexpr std::string_view kSchnetEnergyAllPairs = "mirage::schnet_energy_all_pairs";
// The whole-model ops' (schnet_energy, painn_energy) activations between two Linears, by the
// names mirage.ff.fused.ACTIVATIONS uses.
inline constexpr std::string_view kEnergyActivations[] = {"shifted_softplus", "softplus", "silu",
                                                          "tanh", "gelu", "relu"};
// Tensors per interaction in schnet_energy's `weights`: filter.0 (w, b), filter.2 (w, b),
// in2f (w, b), f2out.0 (w, b), f2out.2 (w, b). Both whole-model ops' `weights` end with the
// readout's four: readout.0 (w, b), readout.2 (w, b).
inline constexpr int64_t kSchnetWeightsPerInteraction = 10;
// Radial functions a filter table takes at most (radial_cfconv, the prepared SchNet tables): its
// pieces grow with them (cuda/filter_table.h's intervals_for): 2^17 pieces at 1,024 Bessel functions,
// whose CPU reference holds the basis at every piece end in float64 (3.2 GB).
inline constexpr int64_t kMaxTableRbf = 1024;
inline constexpr int64_t kEnergyReadoutWeights = 4;

struct SchnetShape {
  int64_t atoms, pairs, interactions, embeddings;
  int64_t rbf, filter_hidden, message_width, features, update_hidden, readout_hidden;
};

// Checks every argument (not the index values) and returns the sizes.
SchnetShape check_schnet_energy(const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                                const at::Tensor& pairs, const at::Tensor& vectors, double cutoff,
                                int64_t num_rbf, at::TensorList weights, std::string_view activations,
                                const std::optional<at::Tensor>& prepared);
// schnet_energy_all_pairs' arguments (num_pairs: a [1] int64 tensor on the positions' device, or
// absent); pairs is N (N - 1).
SchnetShape check_schnet_energy_all_pairs(const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                                          const at::Tensor& positions, double cutoff, int64_t num_rbf,
                                          at::TensorList weights, std::string_view activations,
                                          const std::optional<at::Tensor>& prepared,
                                          const std::optional<at::Tensor>& num_pairs);
// schnet_energy_prepare's arguments, the weights' sizes (atoms and pairs 0). Tables need a smooth
// filter activation and a message width that is a multiple of 4.
SchnetShape check_schnet_energy_prepare(const at::Tensor& embedding, double cutoff, int64_t num_rbf,
                                        at::TensorList weights, std::string_view activations);
// The length of schnet_energy_prepare's output for these sizes (cuda/float_arena.h's layout).
int64_t schnet_prepared_size(const SchnetShape& s);

// The whole-model ops' outputs: the energy, its gradient in the pair vectors [P, 3] and in the
// positions [N, 3] (the vectors' gradient onto their atoms: + the sender's, - the receiver's).
using EnergyOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
// From the CPU references' float64 energy and vector gradient, in `dtype`.
EnergyOutputs reference_energy_outputs(const at::Tensor& energy, const at::Tensor& grad_vectors,
                                       const at::Tensor& pairs, int64_t atoms, at::ScalarType dtype);
// The Meta kernels'.
EnergyOutputs empty_energy_outputs(int64_t atoms, int64_t pairs, const at::TensorOptions& options);

// `activations` ("filter,update_0,...,update_{T-1},readout") split at the commas.
std::vector<std::string> split_activations(std::string_view activations);

// Shared by the whole-model ops (schnet_energy, painn_energy), `op` naming the caller in errors:
// the inputs every one takes (not the index values); a Linear's weight `name` ([out, in]; a bias
// [out], or [0] for none) on embedding's device and dtype; `count` activation names (`what`
// they are) from kEnergyActivations, returned split; the index values (the CPU kernels).
void check_energy_inputs(std::string_view op, const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                         const at::Tensor& pairs, const at::Tensor& vectors, double cutoff);
void check_energy_weight(std::string_view op, const at::Tensor& w, const std::string& name,
                         const at::Tensor& embedding, std::vector<int64_t> shape);
// The rows of a weight whose rows are a width the others are checked against; it must be 2-D.
int64_t energy_weight_rows(std::string_view op, const at::Tensor& w, const std::string& name);
std::vector<std::string> check_activations(std::string_view op, std::string_view activations, int64_t count,
                                           std::string_view what);
void check_energy_indices(std::string_view op, const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                          const at::Tensor& pairs);
// The CPU references' activations and their derivatives, by name.
at::Tensor reference_activation(const at::Tensor& v, const std::string& name);
at::Tensor reference_activation_grad(const at::Tensor& v, const std::string& name);

inline constexpr std::string_view kPainnEnergy = "mirage::painn_energy";
// Tensors per interaction in painn_energy's `weights`: phi.0 (w, b), phi.2 (w, b), filter (w, b),
// U.weight, V.weight, mlp.0 (w, b), mlp.2 (w, b); then the readout's four, as schnet_energy's.
inline constexpr int64_t kPainnWeightsPerInteraction = 12;

struct PainnShape {
  int64_t atoms, pairs, interactions;
  int64_t rbf, features, phi_hidden, update_hidden, readout_hidden;
};

// Checks every argument of painn_energy (not the index values) and returns the sizes.
PainnShape check_painn_energy(const at::Tensor& atomic_numbers, const at::Tensor& embedding, const at::Tensor& pairs,
                              const at::Tensor& vectors, double cutoff, int64_t num_rbf, at::TensorList weights,
                              std::string_view activations, double norm_eps);

// mirage::cfconv and mirage::cfconv_backward, SchNet's interaction for larger systems.
inline constexpr std::string_view kCfconv = "mirage::cfconv";
inline constexpr std::string_view kCfconvBackward = "mirage::cfconv_backward";

struct CfconvShape {
  int64_t nodes, pairs, rbf, hidden, width;  // N, P, R, H, M
};

// Checks every argument shared by the two ops (not the index values) and returns the sizes;
// sender_order and num_pairs as pair_order.h says.
CfconvShape check_cfconv(std::string_view op, const at::Tensor& x, const at::Tensor& basis,
                         const at::Tensor& envelope, const at::Tensor& pairs, const at::Tensor& weight1,
                         const std::optional<at::Tensor>& bias1, const at::Tensor& weight2,
                         const std::optional<at::Tensor>& bias2, std::string_view activation,
                         const std::optional<at::Tensor>& sender_order, const std::optional<at::Tensor>& num_pairs);

// The backward's own arguments: grad [N, M] and filters [P, M], as x.
void check_cfconv_backward(const at::Tensor& grad, const at::Tensor& filters, const at::Tensor& x,
                           const CfconvShape& s);

// mirage::radial_cfconv and its backward: cfconv with the filters a function of the distance,
// read from a table of the filter network built per call (cuda/filter_table.h, docs/ops.md).
inline constexpr std::string_view kRadialCfconv = "mirage::radial_cfconv";
inline constexpr std::string_view kRadialCfconvBackward = "mirage::radial_cfconv_backward";

// Every argument but the index values; `basis`, `cutoff` and `envelope` as radial_basis takes
// its kind, cutoff and cutoff_fn, less what a table cannot take (relu, no basis, no envelope).
CfconvShape check_radial_cfconv(const at::Tensor& x, const at::Tensor& distances, const at::Tensor& pairs,
                                const at::Tensor& weight1, const std::optional<at::Tensor>& bias1,
                                const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
                                std::string_view activation, std::string_view basis, double cutoff,
                                std::string_view envelope, const std::optional<at::Tensor>& sender_order);
// The backward's arguments (R and H unset in the result); table [intervals, 6, M] as the forward
// returns it.
CfconvShape check_radial_cfconv_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& distances,
                                         const at::Tensor& pairs, const at::Tensor& table, double cutoff,
                                         const std::optional<at::Tensor>& sender_order);

}  // namespace mirage::ops
