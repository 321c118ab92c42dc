// The torch-free launchers of cuda/ against plain host references, on the GPU. Inputs are fresh
// random numbers every run (the seed is printed); outputs are poisoned with NaN before each launch.
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "geglu.cuh"
#include "group_norm.cuh"
#include "layer_norm.cuh"

namespace mc = mirage::cuda;

namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::mt19937& rng() {
  static std::mt19937 gen = [] {
    const unsigned seed = std::random_device{}();
    std::printf("test_kernels seed: %u\n", seed);
    return std::mt19937(seed);
  }();
  return gen;
}

std::vector<float> random_values(size_t n, float mean = 0.5f, float stddev = 2.0f) {
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<float> v(n);
  for (auto& e : v) e = dist(rng());
  return v;
}

// A device copy of host values in T (float or __half); `host` is updated to the rounded values.
template <typename T>
struct Device {
  T* ptr = nullptr;
  size_t n = 0;
  explicit Device(size_t count) : n(count) {
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n, 1) * sizeof(T)) == cudaSuccess);
    REQUIRE(cudaMemset(ptr, 0xFF, std::max<size_t>(n, 1) * sizeof(T)) == cudaSuccess);  // NaN
  }
  Device(std::vector<float>& host) : Device(host.size()) {
    std::vector<T> converted(n);
    for (size_t i = 0; i < n; ++i) {
      converted[i] = static_cast<T>(host[i]);
      host[i] = static_cast<float>(converted[i]);
    }
    REQUIRE(cudaMemcpy(ptr, converted.data(), n * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  ~Device() { cudaFree(ptr); }
  std::vector<float> read() const {
    std::vector<T> raw(n);
    REQUIRE(cudaMemcpy(raw.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    return std::vector<float>(raw.begin(), raw.end());
  }
};

void require_close(const std::vector<float>& got, const std::vector<double>& want, double atol,
                   double rtol) {
  REQUIRE(got.size() == want.size());
  size_t bad = 0, first_bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool ok = std::isfinite(got[i]) && std::abs(got[i] - want[i]) <= atol + rtol * std::abs(want[i]);
    if (!ok && bad++ == 0) first_bad = i;
  }
  INFO("mismatches: " << bad << " of " << got.size() << "; first at " << first_bad << ": got "
                      << (bad ? got[first_bad] : 0.0f) << ", want " << (bad ? want[first_bad] : 0.0));
  REQUIRE(bad == 0);
}

template <typename T>
constexpr mc::DType dtype_of() {
  return std::is_same_v<T, float> ? mc::DType::kFloat32 : mc::DType::kFloat16;
}

struct GroupNormCase {
  int64_t n, c, spatial, groups;
  bool channels_last;
  mc::Activation activation;
};

template <typename T>
void check_group_norm(const GroupNormCase& k, double tol) {
  const size_t numel = k.n * k.c * k.spatial;
  std::vector<float> x = random_values(numel), w = random_values(k.c, 1.0f, 0.5f),
                     b = random_values(k.c, 0.0f, 0.5f);
  Device<T> dx(x), dy(numel);
  Device<float> dw(w), db(b);
  const auto at = [&](int64_t n, int64_t c, int64_t s) {
    return k.channels_last ? (n * k.spatial + s) * k.c + c : (n * k.c + c) * k.spatial + s;
  };
  std::vector<double> want(numel);
  const int64_t cpg = k.c / k.groups;
  for (int64_t n = 0; n < k.n; ++n)
    for (int64_t g = 0; g < k.groups; ++g) {
      double mean = 0, var = 0;
      for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c)
        for (int64_t s = 0; s < k.spatial; ++s) mean += x[at(n, c, s)];
      mean /= cpg * k.spatial;
      for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c)
        for (int64_t s = 0; s < k.spatial; ++s) var += std::pow(x[at(n, c, s)] - mean, 2);
      const double rstd = 1.0 / std::sqrt(var / (cpg * k.spatial) + 1e-5);
      for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c)
        for (int64_t s = 0; s < k.spatial; ++s) {
          const double v = (x[at(n, c, s)] - mean) * rstd * w[c] + b[c];
          want[at(n, c, s)] = k.activation == mc::Activation::kSilu ? v / (1 + std::exp(-v)) : v;
        }
    }
  mc::GroupNormParams p{dx.ptr, dw.ptr, db.ptr, dy.ptr, k.n, k.c, k.spatial, k.groups, 1e-5f,
                        k.channels_last, k.activation, dtype_of<T>(), mc::DType::kFloat32};
  void* workspace = nullptr;
  const size_t bytes = mc::group_norm_workspace_bytes(p);
  REQUIRE(cudaMalloc(&workspace, std::max<size_t>(bytes, 1)) == cudaSuccess);
  REQUIRE(mc::launch_group_norm(p, workspace, nullptr) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  cudaFree(workspace);
  require_close(dy.read(), want, tol, tol);
}

}  // namespace

TEST_CASE("launch_group_norm matches the host reference", "[group_norm]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  const auto silu = mc::Activation::kSilu, none = mc::Activation::kNone;
  // Small groups (one block each), wide NCHW groups, and channels-last tiles, odd sizes included.
  const GroupNormCase cases[] = {
      {2, 32, 49, 8, false, silu},    {2, 32, 49, 8, true, none},     {3, 6, 1, 3, true, silu},
      {1, 320, 4096, 32, false, silu}, {1, 320, 4096, 32, true, silu}, {2, 96, 769, 32, true, none},
      {2, 2048, 300, 1, true, silu},   {1, 12, 20001, 4, false, none},
      {1, 64, 8192, 8, true, silu},    // the Hopper cluster path where there is one
  };
  for (const auto& k : cases) {
    INFO("N=" << k.n << " C=" << k.c << " HW=" << k.spatial << " G=" << k.groups
              << " channels_last=" << k.channels_last);
    check_group_norm<float>(k, 2e-4);
    check_group_norm<__half>(k, 2e-2);
  }
}

TEST_CASE("launch_layer_norm matches the host reference", "[layer_norm]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  for (const int64_t dim : {1, 7, 320, 769, 1280, 5000}) {
    for (const bool with_residual : {false, true}) {
      INFO("dim=" << dim << " residual=" << with_residual);
      const int64_t rows = 37;
      std::vector<float> x = random_values(rows * dim), r = random_values(rows * dim),
                         w = random_values(dim, 1.0f, 0.5f), b = random_values(dim, 0.0f, 0.5f);
      Device<float> dx(x), dr(r), dw(w), db(b), dy(rows * dim), dsum(rows * dim);
      std::vector<double> want(rows * dim), want_sum(rows * dim);
      for (int64_t i = 0; i < rows; ++i) {
        double mean = 0, var = 0;
        for (int64_t j = 0; j < dim; ++j) {
          want_sum[i * dim + j] = static_cast<float>(x[i * dim + j] + (with_residual ? r[i * dim + j] : 0.0f));
          mean += want_sum[i * dim + j];
        }
        mean /= dim;
        for (int64_t j = 0; j < dim; ++j) var += std::pow(want_sum[i * dim + j] - mean, 2);
        const double rstd = 1.0 / std::sqrt(var / dim + 1e-5);
        for (int64_t j = 0; j < dim; ++j)
          want[i * dim + j] = (want_sum[i * dim + j] - mean) * rstd * w[j] + b[j];
      }
      mc::LayerNormParams p{dx.ptr, with_residual ? dr.ptr : nullptr, dw.ptr, db.ptr, dy.ptr,
                            with_residual ? dsum.ptr : nullptr, rows, dim, 1e-5f,
                            mc::DType::kFloat32, mc::DType::kFloat32};
      REQUIRE(mc::launch_layer_norm(p, nullptr) == cudaSuccess);
      REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
      require_close(dy.read(), want, 2e-4, 2e-4);
      if (with_residual) require_close(dsum.read(), want_sum, 0, 0);
    }
  }
}

TEST_CASE("launch_geglu matches the host reference", "[geglu]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  for (const int64_t half : {1, 333, 1280}) {
    for (const auto approx : {mc::GeluApprox::kNone, mc::GeluApprox::kTanh}) {
      INFO("half=" << half << " tanh=" << (approx == mc::GeluApprox::kTanh));
      const int64_t rows = 9;
      std::vector<float> x = random_values(rows * 2 * half);
      Device<float> dx(x), dy(rows * half);
      std::vector<double> want(rows * half);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < half; ++j) {
          const double a = x[i * 2 * half + j], g = x[i * 2 * half + half + j];
          const double gelu = approx == mc::GeluApprox::kTanh
                                  ? 0.5 * g * (1 + std::tanh(std::sqrt(2 / M_PI) * (g + 0.044715 * g * g * g)))
                                  : 0.5 * g * (1 + std::erf(g / std::sqrt(2.0)));
          want[i * half + j] = a * gelu;
        }
      mc::GegluParams p{dx.ptr, dy.ptr, rows, half, approx, mc::DType::kFloat32};
      REQUIRE(mc::launch_geglu(p, nullptr) == cudaSuccess);
      REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
      require_close(dy.read(), want, 1e-5, 1e-5);
    }
  }
}
