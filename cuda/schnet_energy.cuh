// mirage::schnet_energy: a whole SchNet energy and its gradient in the pair vectors, in two
// kernels, for small systems (docs/ops.md). float32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

constexpr int kSchnetMaxInteractions = 8;

// One interaction's parameters, nn.Linear layout ([out, in] weights, [out] biases), contiguous;
// a null bias is zero.
struct SchnetInteraction {
  const float *filter1_w, *filter1_b;  // [H, R], [H]
  const float *filter2_w, *filter2_b;  // [M, H], [M]
  const float *in2f_w, *in2f_b;        // [M, F], [M]
  const float *f2out1_w, *f2out1_b;    // [K, M], [K]
  const float *f2out2_w, *f2out2_b;    // [F, K], [F]
  Activation update_activation;        // between f2out's two Linears
};

struct SchnetEnergyParams {
  const int64_t* atomic_numbers;  // [N]
  const float* embedding;         // [Z, F]
  const int64_t* pairs;           // [2, P]: pairs[0] receives the message, pairs[1] sends it
  const float* vectors;           // [P, 3]: r_j - r_i (+ shift); |v| >= cutoff adds nothing
  float* energy;                  // [1]
  float* grad_vectors;            // [P, 3]: d energy / d vectors
  float* grad_positions;          // [N, 3]: d energy / d positions through the vectors r_j - r_i
  void* workspace;                // schnet_energy_workspace_bytes, 16-byte aligned
  int64_t num_atoms, num_pairs, num_embeddings;
  int num_rbf, filter_hidden, message_width, features, update_hidden, readout_hidden;
  int num_interactions;
  float cutoff;                    // Gaussian centers k * cutoff / (R - 1), width the spacing
  Activation filter_activation;    // between the filter's two Linears
  Activation readout_activation;   // between the readout's two Linears
  SchnetInteraction interactions[kSchnetMaxInteractions];
  const float *readout1_w, *readout1_b;  // [Kr, F], [Kr]
  const float *readout2_w, *readout2_b;  // [1, Kr], [1]
  // launch_schnet_prepare's output for this embedding and these weights, or null. With it the op
  // is one kernel: each block reads its pairs' filters and their slopes (the cutoff included) from
  // the prepared tables, its atoms' first h by species and the backward's transposed weights from
  // it. Without it a first kernel forms the filters and the transposed weights every call.
  const float* prepared;
  // All pairs of an open system instead of a pair list (schnet_energy_all_pairs): positions [N, 3]
  // set, pairs and vectors null, num_pairs N (N - 1), pair e = i (N - 1) + k atom i receiving from
  // atom k + (k >= i) (atom_products.cuh's pair_atoms), grad_vectors a [P, 3] buffer nobody reads. found_pairs
  // [1], or null: the pairs within the cutoff, -1 where a position is not finite, as
  // neighbor_list counts them. Null positions: the pair list.
  const float* positions;
  int64_t* found_pairs;
};

size_t schnet_energy_workspace_bytes(const SchnetEnergyParams& params);

// Needs num_atoms >= 1. Out-of-range atomic numbers or pair indices give NaN outputs.
cudaError_t launch_schnet_energy(const SchnetEnergyParams& params, cudaStream_t stream);

// What a prepared launch reads (the embedding, the weights, the filter activation, cutoff and
// basis of `params`; its atoms and pairs are not used), laid out as float_arena.h's
// SchnetPrepared: each interaction's filter network as radial_cfconv's table (filter_table.h,
// Gaussians, the cosine cutoff included), the atom-wise weights transposed, and the first in2f
// of every embedding row. Tables need M % 4 == 0 and a smooth filter activation
// (schnet_prepare_supported); the caller checks.
bool schnet_prepare_supported(const SchnetEnergyParams& params);
cudaError_t launch_schnet_prepare(const SchnetEnergyParams& params, float* prepared, cudaStream_t stream);

}  // namespace mirage::cuda
