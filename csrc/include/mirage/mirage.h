// mirage's public C++ API for LibTorch users. Every function calls the registered operator
// through the dispatcher, so autograd, autocast and device dispatch behave as from Python.
// Link against libmirage (CMake target mirage::mirage); loading the library registers the ops,
// so TorchScript modules that call torch.ops.mirage.* run from C++ too.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <ATen/Tensor.h>

namespace mirage {

struct BuildInfo {
  std::string version;         // mirage's version
  std::string torch_version;   // the torch it was built against
  std::string cuda_version;    // the CUDA toolkit it was built with, "" when CPU-only
  std::vector<std::string> cuda_archs;  // compiled GPU architectures, e.g. "90a"
};

BuildInfo build_info();

// Whether mirage::cfconv (registered as torch.ops.mirage.cfconv) runs a filter network of R inputs,
// H hidden units and M outputs on `device` (false for sizes below 1): on the CPU always; on CUDA
// when H == M is 64 or 128,
// R <= 64 and the GPU has TF32 tensor cores and the kernels' shared memory (147-205 KiB per block
// at width 128, 63-105 KiB at width 64, growing with R).
bool cfconv_supported(int64_t num_rbf, int64_t hidden, int64_t width, const c10::Device& device);

// Whether mirage::radial_cfconv runs a filter network of these sizes on `device` (false for sizes
// below 1 or R above 1,024, the filter table's bound): on the CPU otherwise always; on CUDA for M a
// multiple of 4 where its table kernel's shared memory (about 216 (R + H) + 45,000
// bytes) fits the device's.
bool radial_cfconv_supported(int64_t num_rbf, int64_t hidden, int64_t width, const c10::Device& device);

// Whether vector_message_passing's CUDA kernels form a float32 filter of 3F columns (F =
// features) from a basis of K columns on `device` themselves (F % 4 == 0, K <= 32, the weight in
// shared memory), given 16-byte aligned rows; otherwise a GEMM forms it first. False off CUDA.
bool fused_filter_supported(int64_t features, int64_t basis, const c10::Device& device);

// Whether mirage's kernels are launched overlapped on `device` (programmatic dependent launch, each
// kernel scheduled while the one ahead finishes; docs/ops.md): on compute capability 9.0 and later,
// unless the environment sets MIRAGE_OVERLAP_LAUNCHES=0 when the library first launches. False off CUDA.
bool overlapped_launches(const c10::Device& device);

// Whether the whole-model force-field ops (schnet_energy, painn_energy) run as a thread-block
// cluster on `device` (compute capability 9.0 and later, unless the environment sets
// MIRAGE_CLUSTER_LIMIT=1) rather than as one block. False off CUDA.
bool whole_model_clusters(const c10::Device& device);

// GroupNorm over (N, C, *) input, NCHW or channels-last, output in the input's layout;
// activation is "none" or "silu" (applied after the affine).
at::Tensor group_norm(const at::Tensor& x, int64_t num_groups,
                      const std::optional<at::Tensor>& weight = std::nullopt,
                      const std::optional<at::Tensor>& bias = std::nullopt, double eps = 1e-5,
                      std::string_view activation = "none");

// LayerNorm over the last dimension.
at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight = std::nullopt,
                      const std::optional<at::Tensor>& bias = std::nullopt, double eps = 1e-5);

// Pre-norm residual step: returns (layer_norm(x + residual), x + residual).
std::tuple<at::Tensor, at::Tensor> add_layer_norm(
    const at::Tensor& x, const at::Tensor& residual,
    const std::optional<at::Tensor>& weight = std::nullopt,
    const std::optional<at::Tensor>& bias = std::nullopt, double eps = 1e-5);

// a * gelu(b) with [a, b] = x.chunk(2, -1); approximate is "none" or "tanh".
at::Tensor geglu(const at::Tensor& x, std::string_view approximate = "none");

// A convolution's epilogue in one pass over (N, C, *) x, NCHW or channels-last, output in x's
// layout: (activation(x + bias) + residual) * scale. bias is [C] or [N, C]; activation is "none",
// "silu", "gelu", "gelu_tanh" or "relu".
at::Tensor bias_act(const at::Tensor& x, const std::optional<at::Tensor>& bias = std::nullopt,
                    const std::optional<at::Tensor>& residual = std::nullopt,
                    std::string_view activation = "none", double scale = 1.0);

// input_activation(x) @ weight^T + bias + residual for x [..., K], weight [N, K], bias [N],
// residual [..., N], one dtype for all; summed in float32 and rounded once (on CUDA: one cuBLASLt
// matmul whose epilogue adds bias and residual, or for up to 8 rows one kernel of mirage's own).
// input_activation is "none", "silu", "gelu", "gelu_tanh" or "relu".
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias = std::nullopt,
                  const std::optional<at::Tensor>& residual = std::nullopt,
                  std::string_view input_activation = "none");

// conv3x3(nearest_2x(image)) + bias in sub-pixel form: given x = conv2d(image, w2, padding=1)
// with w2 the 3x3 kernel folded into one 2x2 kernel per output parity ([4C, Cin, 2, 2], parity
// 2p + q major; docs/ops.md), returns out[n, c, 2i+p, 2j+q] = x[n, (2p+q)C + c, i+p, j+q] +
// bias[c]. x is [N, 4C, H+1, W+1]; out [N, C, 2H, 2W] is channels-last.
at::Tensor subpixel_shuffle(const at::Tensor& x, const std::optional<at::Tensor>& bias = std::nullopt);

// Pairs (i, j, image) with |r_j - r_i + shift| < cutoff, in fixed-capacity outputs:
// (pairs [2, P] int64, shifts [P, 3], distances [P], num_pairs [1] int64 = the true count).
// max_pairs = -1 means N * (N - 1); method is "auto", "direct" or "cell_list" (CUDA search).
// See docs/ops.md for padding, order and the periodic conventions.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> neighbor_list(
    const at::Tensor& positions, double cutoff, const std::optional<at::Tensor>& cell = std::nullopt,
    const std::optional<at::Tensor>& pbc = std::nullopt,
    const std::optional<at::Tensor>& batch = std::nullopt, int64_t max_pairs = -1,
    bool half = false, std::string_view method = "auto");
// A method name where `half` goes (neighbor_list(x, cutoff, {}, {}, {}, -1, "cell_list")) would
// convert to half = true without a word: such a call does not compile.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> neighbor_list(
    const at::Tensor& positions, double cutoff, const std::optional<at::Tensor>& cell,
    const std::optional<at::Tensor>& pbc, const std::optional<at::Tensor>& batch, int64_t max_pairs,
    const char* half, std::string_view method = "auto") = delete;

// [*, num] = basis(distances) * cutoff_fn(distances); kind "gaussian", "bessel" or "none" (1: the
// cutoff function alone), cutoff_fn "cosine", "polynomial" or "none".
at::Tensor radial_basis(const at::Tensor& distances, std::string_view kind, int64_t num,
                        double cutoff, std::string_view cutoff_fn);

// out[i] = sum over pairs p with pairs[0, p] == i of x[pairs[1, p]] * filter[p]: SchNet's
// continuous-filter convolution. x [N, F], filter [P, F], pairs [2, P] int64 -> [N, F].
at::Tensor message_passing(const at::Tensor& x, const at::Tensor& filter, const at::Tensor& pairs);

// out[p] = a[pairs[0, p]] * b[pairs[1, p]]: a, b [N, F] -> [P, F] (message_passing's gradient
// with respect to the filter).
at::Tensor pair_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& pairs);

// The pairs' indices grouped by sender: int32 [P] for pair lists long enough for a backward to
// walk them that way (P >= 8192), int32 [0] for shorter ones. Formed once per pair list and
// passed as `sender_order` to vector_message_passing and pair_vectors (and torch.ops.mirage.cfconv
// and radial_cfconv), whose backwards would otherwise each sort the same list again. num_pairs:
// neighbor_list's count ([1] int64), which puts the padding past it last (what cfconv's num_pairs
// needs), or none.
at::Tensor sender_order(const at::Tensor& pairs, int64_t num_nodes,
                        const std::optional<at::Tensor>& num_pairs = std::nullopt);

// PaiNN's messages: with m = x[j] * filter split into (s, vv, vs) parts of F features,
// scalar[i] = sum m_s and vector[i, c] = sum vectors[j, c] * m_vv + m_vs * directions[p, c].
// x [N, 3F], filter [P, 3F], vectors [N, 3, F], directions [P, 3] -> ([N, F], [N, 3, F]).
// With filter_weight [3F, K], `filter` is a basis [P, K] and the filter is filter @ filter_weight^T
// (formed inside the kernel: PaiNN's filter Linear). sender_order: sender_order(pairs, N,
// num_pairs), or none. num_pairs: neighbor_list's count ([1] int64), whose padding (the pairs past
// it) is then skipped (no messages, zero gradients), or none.
std::tuple<at::Tensor, at::Tensor> vector_message_passing(
    const at::Tensor& x, const at::Tensor& filter, const at::Tensor& vectors, const at::Tensor& directions,
    const at::Tensor& pairs, const std::optional<at::Tensor>& filter_weight = std::nullopt,
    const std::optional<at::Tensor>& sender_order = std::nullopt,
    const std::optional<at::Tensor>& num_pairs = std::nullopt);

// vectors[p] = positions[j] - positions[i] + shifts[p] and distances[p] = |vectors[p]| for
// (i, j) = (pairs[0, p], pairs[1, p]): positions [N, 3] float32, pairs [2, P] int64, shifts
// [P, 3] or none -> ([P, 3], [P]). sender_order: sender_order(pairs, N), or none.
std::tuple<at::Tensor, at::Tensor> pair_vectors(const at::Tensor& positions, const at::Tensor& pairs,
                                                const std::optional<at::Tensor>& shifts = std::nullopt,
                                                const std::optional<at::Tensor>& sender_order = std::nullopt);

// PaiNN's update block around its MLP. The MLP's input: [s, sqrt(sum_c vv[:, c]^2 + eps)],
// s [N, F], vv [N, 3, F] -> [N, 2F].
at::Tensor painn_update_input(const at::Tensor& s, const at::Tensor& vv, double eps);

// The gated update, with a = (a_vv, a_sv, a_ss) [N, 3F] the MLP's output:
// s_out = s + a_ss + a_sv * sum_c uv[:, c] * vv[:, c], v_out = v + a_vv * uv;
// s [N, F], v, uv, vv [N, 3, F] -> ([N, F], [N, 3, F]).
std::tuple<at::Tensor, at::Tensor> painn_update(const at::Tensor& s, const at::Tensor& v,
                                                const at::Tensor& uv, const at::Tensor& vv,
                                                const at::Tensor& a);

// Velocity-Verlet updates of an MD state in place (what mirage.ff.md runs, one kernel each).
// positions, velocities [N, 3] float32/float64, contiguous; forces [N, 3] and inverse_masses [N]
// or [N, 1] in their dtype. verlet_kick_drift: velocities += kick * forces * inverse_masses (not
// when kick is 0), then positions += drift * velocities; returns the new positions in `dtype`
// (float32 or float64).
at::Tensor verlet_kick_drift(at::Tensor& positions, at::Tensor& velocities, const at::Tensor& forces,
                             const at::Tensor& inverse_masses, double kick, double drift,
                             at::ScalarType dtype = at::kFloat);

// forces = -grad and energy = model_energy (grad [N, 3] float32 or float64, model_energy one
// floating-point element: the model's), then velocities += kick * forces * inverse_masses; energy
// is [] in the state's dtype. With pair_count (one int64: the model's neighbor-pair count) and
// pair_count_range ([2] int64, contiguous), both or neither, on the state's device, also
// range = [max(range[0], count), min(range[1], count)].
void verlet_forces_kick(at::Tensor& velocities, at::Tensor& forces, at::Tensor& energy, const at::Tensor& grad,
                        const at::Tensor& model_energy, const at::Tensor& inverse_masses, double kick,
                        const std::optional<at::Tensor>& pair_count = std::nullopt,
                        const std::optional<at::Tensor>& pair_count_range = std::nullopt);

// verlet_forces_kick, then verlet_kick_drift with the same kick, in one kernel (the end of one
// step and the start of the next); grad must be in `dtype`. Returns the new positions in `dtype`.
at::Tensor verlet_forces_kick_drift(at::Tensor& positions, at::Tensor& velocities, at::Tensor& forces,
                                    at::Tensor& energy, const at::Tensor& grad, const at::Tensor& model_energy,
                                    const at::Tensor& inverse_masses, double kick, double drift,
                                    at::ScalarType dtype = at::kFloat,
                                    const std::optional<at::Tensor>& pair_count = std::nullopt,
                                    const std::optional<at::Tensor>& pair_count_range = std::nullopt);

}  // namespace mirage
