// Every mirage operator schema, in one list. Kernels register per dispatch key in ops/,
// autograd.cpp and autocast.cpp.
#include <torch/library.h>

TORCH_LIBRARY(mirage, m) {
  m.def("group_norm(Tensor x, int num_groups, Tensor? weight=None, Tensor? bias=None, "
        "float eps=1e-05, str activation=\"none\") -> Tensor");
  m.def("layer_norm(Tensor x, Tensor? weight=None, Tensor? bias=None, float eps=1e-05) -> Tensor");
  m.def("add_layer_norm(Tensor x, Tensor residual, Tensor? weight=None, Tensor? bias=None, "
        "float eps=1e-05) -> (Tensor out, Tensor sum)");
  m.def("geglu(Tensor x, str approximate=\"none\") -> Tensor");
  // A convolution's epilogue in one pass: (activation(x + bias) + residual) * scale.
  m.def("bias_act(Tensor x, Tensor? bias=None, Tensor? residual=None, str activation=\"none\", "
        "float scale=1.0) -> Tensor");
  // input_activation(x) @ weight^T + bias + residual, the bias and residual added in the matmul's
  // epilogue.
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None, "
        "str input_activation=\"none\") -> Tensor");
  // Nearest 2x upsampling + 3x3 convolution in sub-pixel form: interleaves the four parities of
  // a 2x2 convolution's output x [N, 4C, H+1, W+1] into [N, C, 2H, 2W] and adds the bias.
  m.def("subpixel_shuffle(Tensor x, Tensor? bias=None) -> Tensor");
  // Force fields (docs/ops.md): a fixed-capacity neighbor list, a fused radial basis, and message
  // passing over the pairs with its gather-product companion (each one's gradient is the other).
  m.def("neighbor_list(Tensor positions, float cutoff, Tensor? cell=None, Tensor? pbc=None, "
        "Tensor? batch=None, int max_pairs=-1, bool half=False, str method=\"auto\") -> "
        "(Tensor pairs, Tensor shifts, Tensor distances, Tensor num_pairs)");
  // The pairs' indices grouped by sender (int32 [P]; [0] for lists too short for it to pay), for
  // the ops below whose backward scatters onto the senders: formed once per pair list and passed
  // to each of them as `sender_order` instead of each backward sorting the list again. With
  // num_pairs (neighbor_list's), the padding past it comes last.
  m.def("sender_order(Tensor pairs, int num_nodes, Tensor? num_pairs=None) -> Tensor");
  // The pair vectors positions[j] - positions[i] + shifts and their lengths; the backward is an op
  // of its own (a scatter onto the atoms: the forces' last step).
  m.def("pair_vectors(Tensor positions, Tensor pairs, Tensor? shifts=None, Tensor? sender_order=None) -> "
        "(Tensor vectors, Tensor distances)");
  m.def("pair_vectors_backward(Tensor? grad_vectors, Tensor? grad_distances, Tensor positions, Tensor pairs, "
        "Tensor? shifts=None, Tensor? sender_order=None) -> Tensor");
  m.def("radial_basis(Tensor distances, str kind, int num, float cutoff, str cutoff_fn) -> Tensor");
  // radial_basis' gradient in distances, fused (forces); differentiable in turn.
  m.def("radial_basis_backward(Tensor grad, Tensor distances, str kind, int num, float cutoff, "
        "str cutoff_fn) -> Tensor");
  m.def("message_passing(Tensor x, Tensor filter, Tensor pairs) -> Tensor");
  m.def("pair_product(Tensor a, Tensor b, Tensor pairs) -> Tensor");
  // PaiNN's scalar/vector messages; its backward is an op of its own (the forces' hot path). With
  // filter_weight, `filter` is the basis its Linear maps to the filter (formed in the kernel);
  // grad_filter is then the basis' gradient.
  m.def("vector_message_passing(Tensor x, Tensor filter, Tensor vectors, Tensor directions, "
        "Tensor pairs, Tensor? filter_weight=None, Tensor? sender_order=None, Tensor? num_pairs=None) -> "
        "(Tensor scalar, Tensor vector)");
  m.def("vector_message_passing_backward(Tensor grad_scalar, Tensor grad_vector, Tensor x, "
        "Tensor filter, Tensor vectors, Tensor directions, Tensor pairs, Tensor? filter_weight=None, "
        "Tensor? sender_order=None, Tensor? num_pairs=None) -> (Tensor grad_x, Tensor grad_filter, "
        "Tensor grad_vectors, Tensor grad_directions)");
  // PaiNN's update block around its MLP (cuda/painn_update.cuh): the MLP's input [s, |V v|] and
  // the gated update of s and v; each backward is an op of its own (the forces' hot path).
  m.def("painn_update_input(Tensor s, Tensor vv, float eps) -> Tensor");
  m.def("painn_update_input_backward(Tensor grad, Tensor vv, float eps) -> Tensor");
  m.def("painn_update(Tensor s, Tensor v, Tensor uv, Tensor vv, Tensor a) -> (Tensor s_out, "
        "Tensor v_out)");
  m.def("painn_update_backward(Tensor grad_s, Tensor grad_v, Tensor uv, Tensor vv, Tensor a) -> "
        "(Tensor grad_uv, Tensor grad_vv, Tensor grad_a)");
  // A whole SchNet energy and its gradient in the pair vectors and the positions, in one kernel
  // (small systems).
  // weights: 10 tensors per interaction then 4 for the readout; activations: comma-separated.
  // prepared: schnet_energy_prepare's output for these weights (filter tables, transposed weights),
  // which spares each call the work of forming them.
  m.def("schnet_energy(Tensor atomic_numbers, Tensor embedding, Tensor pairs, Tensor vectors, "
        "float cutoff, int num_rbf, Tensor[] weights, str activations, Tensor? prepared=None) -> (Tensor energy, "
        "Tensor grad_vectors, Tensor grad_positions)");
  // The same on every pair of an open system (no pair list: the search is in the kernel), its
  // gradient in the positions; num_pairs, if given, gets the pairs within the cutoff (-1 for
  // positions that are not finite), as neighbor_list's count.
  m.def("schnet_energy_all_pairs(Tensor atomic_numbers, Tensor embedding, Tensor positions, float cutoff, "
        "int num_rbf, Tensor[] weights, str activations, Tensor? prepared=None, Tensor(a!)? num_pairs=None) -> "
        "(Tensor energy, Tensor grad_positions)");
  m.def("schnet_energy_prepare(Tensor embedding, float cutoff, int num_rbf, Tensor[] weights, str activations) "
        "-> Tensor");
  // A whole PaiNN energy and its gradient in the pair vectors and the positions, in one kernel
  // (small systems).
  // weights: 12 tensors per interaction then 4 for the readout; activations: comma-separated.
  m.def("painn_energy(Tensor atomic_numbers, Tensor embedding, Tensor pairs, Tensor vectors, "
        "float cutoff, int num_rbf, Tensor[] weights, str activations, float norm_eps) -> (Tensor energy, "
        "Tensor grad_vectors, Tensor grad_positions)");
  // SchNet's continuous-filter convolution with its filter network fused in (larger systems):
  // out = sum over pairs of x[j] * (W2 act(W1 basis + b1) + b2) * envelope; also returns the
  // filters (before the envelope), which its backward reads. tf32: the CUDA products round their
  // operands to TF32 once instead of splitting them into two TF32 parts (float32 accuracy).
  m.def("cfconv(Tensor x, Tensor basis, Tensor envelope, Tensor pairs, Tensor weight1, Tensor? bias1, "
        "Tensor weight2, Tensor? bias2, str activation, bool tf32=False, Tensor? sender_order=None, "
        "Tensor? num_pairs=None) -> (Tensor out, Tensor filters)");
  m.def("cfconv_backward(Tensor grad, Tensor x, Tensor basis, Tensor envelope, Tensor pairs, Tensor filters, "
        "Tensor weight1, Tensor? bias1, Tensor weight2, str activation, bool tf32=False, "
        "Tensor? sender_order=None, Tensor? num_pairs=None) -> (Tensor grad_x, Tensor grad_basis, "
        "Tensor grad_envelope)");
  // cfconv with the filters a function of the distance (radial_basis' `basis` functions, R from
  // weight1, times the `envelope` cutoff function), read from a table of the network that the
  // forward builds and returns (its backward reads it): passes over the pairs with no products.
  m.def("radial_cfconv(Tensor x, Tensor distances, Tensor pairs, Tensor weight1, Tensor? bias1, Tensor weight2, "
        "Tensor? bias2, str activation, str basis, float cutoff, str envelope, Tensor? sender_order=None) -> "
        "(Tensor out, Tensor table)");
  m.def("radial_cfconv_backward(Tensor grad, Tensor x, Tensor distances, Tensor pairs, Tensor table, float cutoff, "
        "Tensor? sender_order=None) -> (Tensor grad_x, Tensor grad_distances)");
  // Velocity-Verlet updates of an MD state in place (mirage.ff.md; one kernel each): a kick of the
  // velocities by the forces and a drift of the positions, returning the positions in `dtype` for
  // the model; and the model's gradient taken as the state's forces (-grad) and energy, then a kick
  // (and the model's neighbor-pair count folded into its running [max, min]).
  m.def("verlet_kick_drift(Tensor(a!) positions, Tensor(b!) velocities, Tensor forces, Tensor inverse_masses, "
        "float kick, float drift, ScalarType dtype=float) -> Tensor");
  m.def("verlet_forces_kick(Tensor(a!) velocities, Tensor(b!) forces, Tensor(c!) energy, Tensor grad, "
        "Tensor model_energy, Tensor inverse_masses, float kick, Tensor? pair_count=None, "
        "Tensor(d!)? pair_count_range=None) -> ()");
  // The two above in one kernel, forces_kick's kick then kick_drift's with the same factor: the end
  // of one step and the start of the next (mirage.ff.md between the steps of a replay).
  m.def("verlet_forces_kick_drift(Tensor(a!) positions, Tensor(b!) velocities, Tensor(c!) forces, Tensor(d!) energy, "
        "Tensor grad, Tensor model_energy, Tensor inverse_masses, float kick, float drift, ScalarType dtype=float, "
        "Tensor? pair_count=None, Tensor(e!)? pair_count_range=None) -> Tensor");
}
