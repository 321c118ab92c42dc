// mirage::painn_energy: a whole PaiNN energy and its gradient in the pair vectors in two launches,
// for small systems (docs/ops.md). float32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "common.cuh"

namespace mirage::cuda {

constexpr int kPainnMaxInteractions = 8;
// The most basis functions the CUDA kernel takes: a pair's two basis rows fill a block's 32 KB of
// dynamic shared memory (launch_painn_energy).
constexpr int kPainnMaxRbf = 4096;

// One interaction's parameters, nn.Linear layout ([out, in] weights, [out] biases), contiguous;
// a null bias is zero. F features, H phi's hidden width, K the update MLP's, R basis functions.
struct PainnInteraction {
  const float *phi1_w, *phi1_b;      // [H, F], [H]
  const float *phi2_w, *phi2_b;      // [3F, H], [3F]
  const float *filter_w, *filter_b;  // [3F, R], [3F]
  const float *u_w, *v_w;            // [F, F] each, no bias
  const float *mlp1_w, *mlp1_b;      // [K, 2F], [K]
  const float *mlp2_w, *mlp2_b;      // [3F, K], [3F]
  Activation phi_activation, update_activation;
};

struct PainnEnergyParams {
  const int64_t* atomic_numbers;  // [N]
  const float* embedding;         // [Z, F]
  const int64_t* pairs;           // [2, P]: pairs[0] receives the message, pairs[1] sends it
  const float* vectors;           // [P, 3]: r_j - r_i (+ shift); |v| >= cutoff adds nothing
  float* energy;                  // [1]
  float* grad_vectors;            // [P, 3]: d energy / d vectors
  float* grad_positions;          // [N, 3]: d energy / d positions through the vectors r_j - r_i
  void* workspace;                // painn_energy_workspace_bytes, 16-byte aligned
  int64_t num_atoms, num_pairs, num_embeddings;
  int num_rbf, features, phi_hidden, update_hidden, readout_hidden;
  int num_interactions;
  float cutoff;    // sinc basis sqrt(2 / c) sin(n pi d / c) / d, n = 1..R; cosine cutoff
  float norm_eps;  // |V v| = sqrt(sum over xyz of (V v)^2 + norm_eps)
  Activation readout_activation;
  PainnInteraction interactions[kPainnMaxInteractions];
  const float *readout1_w, *readout1_b;  // [Kr, F], [Kr]
  const float *readout2_w, *readout2_b;  // [1, Kr], [1]
};

size_t painn_energy_workspace_bytes(const PainnEnergyParams& params);

// Needs num_atoms >= 1. Out-of-range atomic numbers or pair indices give NaN outputs.
cudaError_t launch_painn_energy(const PainnEnergyParams& params, cudaStream_t stream);

// painn_split.cu: the same model with its features split over one cluster of 16 blocks, every
// weight in shared memory (small molecules on sm_90; sizes divisible by 16). launch_painn_energy
// takes it where it applies; it needs no workspace. Launches it and returns the launch's status
// where it applies, nothing where it does not.
std::optional<cudaError_t> try_launch_painn_split(const PainnEnergyParams& params, cudaStream_t stream);

}  // namespace mirage::cuda
