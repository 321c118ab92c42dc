// mirage's C++ API through LibTorch, and a TorchScript module that calls torch.ops.mirage
// loaded and run from C++. References are PyTorch's own composites.
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <type_traits>
#include <utility>

#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/script.h>

#include "catch_compat.h"
#include "mirage/mirage.h"

namespace {

void require_close(const at::Tensor& got, const at::Tensor& want, double tol) {
  INFO("max abs error " << (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>());
  REQUIRE(got.sizes() == want.sizes());
  REQUIRE(got.scalar_type() == want.scalar_type());
  REQUIRE(at::allclose(got.to(at::kDouble), want.to(at::kDouble), tol, tol));
}

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace

TEST_CASE("build_info names the version and the torch built against", "[api]") {
  const mirage::BuildInfo info = mirage::build_info();
  REQUIRE_FALSE(info.version.empty());
  REQUIRE(info.torch_version.find('.') != std::string::npos);
}

TEST_CASE("kernels are never reported overlapped off CUDA", "[api]") {
  REQUIRE_FALSE(mirage::overlapped_launches(c10::Device("cpu")));
}

TEST_CASE("group_norm matches at::group_norm + silu on CPU tensors", "[api]") {
  const at::Tensor x = at::randn({2, 12, 5, 7}).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor w = at::randn({12}), b = at::randn({12});
  const at::Tensor y = mirage::group_norm(x, 3, w, b, 1e-5, "silu");
  require_close(y, at::silu(at::group_norm(x, 3, w, b, 1e-5)), 1e-5);
  REQUIRE(y.is_contiguous(at::MemoryFormat::ChannelsLast));
}

TEST_CASE("layer_norm, add_layer_norm and geglu match PyTorch on CPU tensors", "[api]") {
  const at::Tensor x = at::randn({3, 4, 10}), r = at::randn({3, 4, 10});
  const at::Tensor w = at::randn({10}), b = at::randn({10});
  require_close(mirage::layer_norm(x, w, b), at::layer_norm(x, {10}, w, b), 1e-5);
  const auto [out, sum] = mirage::add_layer_norm(x, r, w, b);
  require_close(sum, x + r, 1e-6);
  require_close(out, at::layer_norm(x + r, {10}, w, b), 1e-5);
  const auto halves = x.chunk(2, -1);
  require_close(mirage::geglu(x, "tanh"), halves[0] * at::gelu(halves[1], "tanh"), 1e-5);
}

TEST_CASE("bias_act matches the PyTorch composite on CPU tensors", "[api]") {
  const at::Tensor x = at::randn({2, 6, 3, 5}).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor bias = at::randn({2, 6}), residual = at::randn({2, 6, 3, 5});
  const at::Tensor y = mirage::bias_act(x, bias, residual, "silu", 0.5);
  require_close(y, (at::silu(x + bias.reshape({2, 6, 1, 1})) + residual) * 0.5, 1e-5);
  REQUIRE(y.is_contiguous(at::MemoryFormat::ChannelsLast));
}

TEST_CASE("linear is F.linear plus the residual on CPU tensors", "[api]") {
  const at::Tensor x = at::randn({2, 3, 7}), weight = at::randn({5, 7}), bias = at::randn({5});
  const at::Tensor residual = at::randn({2, 3, 5});
  require_close(mirage::linear(x, weight, bias, residual), at::linear(x, weight, bias) + residual, 1e-5);
  require_close(mirage::linear(x, weight), at::matmul(x, weight.t()), 1e-5);
  REQUIRE(error_of([&] { mirage::linear(x, at::randn({5, 6})); }).find(
              "mirage::linear: weight must have shape [out_features, 7]") != std::string::npos);
}

TEST_CASE("subpixel_shuffle of the folded convolution is upsampling then the 3x3 convolution", "[api]") {
  const at::Tensor image = at::randn({2, 3, 4, 5}, at::kDouble), weight = at::randn({6, 3, 3, 3}, at::kDouble);
  const at::Tensor bias = at::randn({6}, at::kDouble);
  // The 2x2 kernel of output parity (p, q): taps[p] sums the 3x3 rows that read the same row.
  const at::Tensor taps = at::tensor({1., 0., 0., 0., 1., 1., 1., 1., 0., 0., 0., 1.}, at::kDouble).view({2, 2, 3});
  const at::Tensor folded = at::einsum("pay,qbx,oiyx->pqoiab", {taps, taps, weight}).reshape({24, 3, 2, 2});
  const at::Tensor parities = at::conv2d(image, folded, {}, 1, 1);
  const at::Tensor upsampled = at::upsample_nearest2d(image, {8, 10});
  require_close(mirage::subpixel_shuffle(parities, bias), at::conv2d(upsampled, weight, bias, 1, 1), 1e-10);
  REQUIRE(error_of([&] { mirage::subpixel_shuffle(at::randn({1, 6, 3, 3})); }).find(
              "mirage::subpixel_shuffle: x's channels must be a multiple of 4") != std::string::npos);
}

TEST_CASE("message passing ops match index_add / gather composites on CPU tensors", "[api]") {
  const at::Tensor pairs = at::randint(0, 7, {2, 40}, at::kLong);
  const at::Tensor i = pairs[0], j = pairs[1];
  const at::Tensor x = at::randn({7, 5}), filter = at::randn({40, 5}), b = at::randn({7, 5});
  require_close(mirage::message_passing(x, filter, pairs),
                at::zeros({7, 5}).index_add_(0, i, x.index_select(0, j) * filter), 1e-5);
  require_close(mirage::pair_product(x, b, pairs), x.index_select(0, i) * b.index_select(0, j), 1e-6);
  const at::Tensor phi = at::randn({7, 15}), w = at::randn({40, 15}), v = at::randn({7, 3, 5});
  const at::Tensor dir = at::randn({40, 3});
  const auto [scalar, vector] = mirage::vector_message_passing(phi, w, v, dir, pairs);
  const auto m = (phi.index_select(0, j) * w).split(5, -1);
  const at::Tensor dv = v.index_select(0, j) * m[1].unsqueeze(1) + m[2].unsqueeze(1) * dir.unsqueeze(2);
  require_close(scalar, at::zeros({7, 5}).index_add_(0, i, m[0]), 1e-5);
  require_close(vector, at::zeros({7, 3, 5}).index_add_(0, i, dv), 1e-5);
}

TEST_CASE("neighbor_list finds every pair brute force finds; radial_basis follows its formula", "[api]") {
  const at::Tensor positions = at::rand({12, 3}, at::kDouble) * 6.0;  // open boundaries
  const double cutoff = 3.0;
  const auto [pairs, shifts, distances, num_pairs] = mirage::neighbor_list(positions, cutoff);
  std::set<std::pair<int64_t, int64_t>> want, got;
  for (int64_t i = 0; i < 12; ++i)
    for (int64_t j = 0; j < 12; ++j)
      if (i != j && (positions[j] - positions[i]).norm().item<double>() < cutoff) want.insert({i, j});
  const int64_t count = num_pairs.item<int64_t>();
  REQUIRE(count == static_cast<int64_t>(want.size()));
  for (int64_t p = 0; p < count; ++p) got.insert({pairs[0][p].item<int64_t>(), pairs[1][p].item<int64_t>()});
  REQUIRE(got == want);
  const at::Tensor i = pairs[0].slice(0, 0, count), j = pairs[1].slice(0, 0, count);
  const at::Tensor d = distances.slice(0, 0, count);
  require_close(d, (positions.index_select(0, j) - positions.index_select(0, i)).norm(2, {1}), 1e-12);
  REQUIRE(shifts.slice(0, 0, count).abs().max().item<double>() == 0.0);
  REQUIRE(error_of([&] { mirage::neighbor_list(positions, -1.0); }).find(
              "mirage::neighbor_list: cutoff must be finite and > 0") != std::string::npos);

  // Gaussians at k * delta (delta = cutoff / (num - 1)) of width delta, times the cosine cutoff.
  const int64_t num = 5;
  const double delta = cutoff / (num - 1), pi = std::acos(-1.0);
  const at::Tensor column = d.unsqueeze(-1), centers = at::arange(num, at::kDouble) * delta;
  const at::Tensor basis = at::exp(-(column - centers).pow(2) / (2 * delta * delta)) * 0.5 *
                           (at::cos(pi * column / cutoff) + 1);
  require_close(mirage::radial_basis(d, "gaussian", num, cutoff, "cosine"), basis, 1e-12);
}

TEST_CASE("bad input raises c10::Error naming the op and the argument", "[api]") {
  const at::Tensor x = at::randn({2, 30, 4, 4});
  REQUIRE(error_of([&] { mirage::group_norm(x, 32); }).find(
              "mirage::group_norm: x must have C divisible by num_groups (C=30, num_groups=32)") !=
          std::string::npos);
  REQUIRE(error_of([&] { mirage::geglu(at::randn({2, 3})); }).find("mirage::geglu: x's last dimension must be even") !=
          std::string::npos);
  REQUIRE(error_of([&] { mirage::bias_act(x, at::randn({29})); }).find(
              "mirage::bias_act: bias must have shape [30] or [2, 30]") != std::string::npos);
  // An undefined tensor: the dispatcher alone would say "tensor does not have a device".
  REQUIRE(error_of([&] { mirage::linear(at::randn({2, 3}), at::Tensor()); }).find(
              "mirage::linear: weight must be a defined tensor, got an undefined one") != std::string::npos);
  REQUIRE(error_of([&] { mirage::sender_order(at::Tensor(), 3); }).find(
              "mirage::sender_order: pairs must be a defined tensor") != std::string::npos);
}

TEST_CASE("an undefined tensor for an optional argument is the same as none", "[api]") {
  // PyTorch's convention, which C++ callers rely on: at::Tensor() where an optional tensor goes.
  const at::Tensor none;
  const at::Tensor x = at::randn({2, 8, 3, 3});
  require_close(mirage::group_norm(x, 4, none, none), mirage::group_norm(x, 4), 0.0);
  require_close(mirage::bias_act(x, none, none, "silu"), mirage::bias_act(x, std::nullopt, std::nullopt, "silu"), 0.0);
  const at::Tensor rows = at::randn({5, 3}), weight = at::randn({4, 3});
  require_close(mirage::linear(rows, weight, none, none), mirage::linear(rows, weight), 0.0);
  const at::Tensor parities = at::randn({1, 8, 3, 3});
  require_close(mirage::subpixel_shuffle(parities, none), mirage::subpixel_shuffle(parities), 0.0);
  const at::Tensor positions = at::arange(18, at::kFloat).reshape({6, 3}) * 0.3;  // neighbors 1.56 apart
  const auto open = mirage::neighbor_list(positions, 2.0);
  const auto undefined = mirage::neighbor_list(positions, 2.0, none, none, none);
  require_close(std::get<3>(undefined), std::get<3>(open), 0.0);
  const at::Tensor pairs = std::get<0>(open).slice(1, 0, std::get<3>(open).item<int64_t>());
  REQUIRE(pairs.size(1) > 0);
  REQUIRE(mirage::sender_order(pairs, 6, none).equal(mirage::sender_order(pairs, 6)));  // int32 [0] this short
  require_close(std::get<0>(mirage::pair_vectors(positions, pairs, none, none)),
                std::get<0>(mirage::pair_vectors(positions, pairs)), 0.0);
  const int64_t P = pairs.size(1);
  const at::Tensor phi = at::randn({6, 15}), filter = at::randn({P, 15}), v = at::randn({6, 3, 5});
  const at::Tensor directions = at::randn({P, 3});
  require_close(std::get<1>(mirage::vector_message_passing(phi, filter, v, directions, pairs, none, none, none)),
                std::get<1>(mirage::vector_message_passing(phi, filter, v, directions, pairs)), 0.0);
  at::Tensor velocities = at::zeros({6, 3}), forces = at::zeros({6, 3}), energy = at::zeros({});
  mirage::verlet_forces_kick(velocities, forces, energy, at::ones({6, 3}), at::ones({}), at::ones({6}), 0.5, none, none);
  require_close(velocities, at::full({6, 3}, -0.5), 0.0);
  // Both kicks (-0.5 each from -0.5), then a drift of 2 from the origin: -3.
  at::Tensor state_positions = at::zeros({6, 3});
  const at::Tensor moved = mirage::verlet_forces_kick_drift(state_positions, velocities, forces, energy, at::ones({6, 3}),
                                                            at::ones({}), at::ones({6}), 0.5, 2.0);
  require_close(velocities, at::full({6, 3}, -1.5), 0.0);
  require_close(moved, at::full({6, 3}, -3.0), 0.0);
}

// A string where neighbor_list's `half` goes would convert to true without a word: the API refuses
// it at compile time (a deleted overload), while the spelled-out call compiles.
template <class... Args, class = decltype(mirage::neighbor_list(std::declval<Args>()...))>
std::true_type neighbor_list_takes(int);
template <class...>
std::false_type neighbor_list_takes(...);
static_assert(!decltype(neighbor_list_takes<at::Tensor, double, std::nullopt_t, std::nullopt_t, std::nullopt_t, int,
                                            const char*>(0))::value,
              "a method name where `half` goes must not compile");
static_assert(decltype(neighbor_list_takes<at::Tensor, double, std::nullopt_t, std::nullopt_t, std::nullopt_t, int,
                                           bool, const char*>(0))::value,
              "neighbor_list(positions, cutoff, cell, pbc, batch, max_pairs, half, method) compiles");

TEST_CASE("the capability queries answer no, not an error, for CUDA without a GPU", "[api]") {
  if (torch::cuda::is_available()) return;  // what they answer on a GPU is tested from Python
  const c10::Device cuda("cuda:0");
  REQUIRE_FALSE(mirage::cfconv_supported(20, 128, 128, cuda));
  REQUIRE_FALSE(mirage::radial_cfconv_supported(20, 128, 128, cuda));
  REQUIRE_FALSE(mirage::fused_filter_supported(128, 20, cuda));
  REQUIRE_FALSE(mirage::overlapped_launches(cuda));
}

TEST_CASE("a scripted module calling torch.ops.mirage runs from C++", "[torchscript]") {
  // tests/python/test_torchscript.py saves it; `make test` runs pytest first and sets this path.
  const char* path = std::getenv("MIRAGE_TORCHSCRIPT_MODULE");
  if (path == nullptr) MIRAGE_SKIP("MIRAGE_TORCHSCRIPT_MODULE is not set (run through `make test`)");
  INFO("module: " << path);
  REQUIRE(std::ifstream(path).good());
  torch::jit::Module module = torch::jit::load(path);
  const at::Tensor weight = module.attr("weight").toTensor(), bias = module.attr("bias").toTensor();
  const int64_t groups = module.attr("num_groups").toInt();
  const double eps = module.attr("eps").toDouble();
  const at::Tensor x = at::randn({2, weight.size(0), 6, 5}).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor y = module.forward({x}).toTensor();
  require_close(y, at::silu(at::group_norm(x, groups, weight, bias, eps)), 1e-5);
}
