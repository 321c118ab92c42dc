// The torch-free launchers of cuda/ against plain host references, on the GPU. Inputs are fresh
// random numbers every run (the seed is printed); outputs are poisoned with NaN before each launch.
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "catch_compat.h"
#include "bias_act.cuh"
#include "cfconv.cuh"
#include "geglu.cuh"
#include "group_norm.cuh"
#include "layer_norm.cuh"
#include "linear.cuh"
#include "message_passing.cuh"
#include "neighbor_list.cuh"
#include "painn_update.cuh"
#include "pair_order.cuh"
#include "pair_vectors.cuh"
#include "radial_basis.cuh"
#include "subpixel_shuffle.cuh"
#include "verlet.cuh"
#include "vector_message_passing.cuh"

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

template <typename T>
void check_bias_act(int64_t n, int64_t c, int64_t spatial, bool channels_last, bool per_sample,
                    double tol) {
  INFO("n=" << n << " c=" << c << " spatial=" << spatial << " channels_last=" << channels_last
            << " per_sample=" << per_sample << " half=" << (!std::is_same_v<T, float>));
  const int64_t numel = n * c * spatial;
  std::vector<float> x = random_values(numel), residual = random_values(numel),
                     bias = random_values(per_sample ? n * c : c);
  Device<T> dx(x), dr(residual), dy(numel);
  Device<float> db(bias);
  const float scale = 0.75f;
  std::vector<double> want(numel);
  for (int64_t i = 0; i < numel; ++i) {
    const int64_t ch = channels_last ? i % c : (i / spatial) % c, sample = i / (c * spatial);
    const double v = double(x[i]) + bias[(per_sample ? sample * c : 0) + ch];
    want[i] = (v / (1.0 + std::exp(-v)) + residual[i]) * scale;  // silu
  }
  mc::BiasActParams p{dx.ptr, db.ptr, dr.ptr, dy.ptr, n, c, spatial, channels_last, per_sample,
                      mc::Activation::kSilu, scale, dtype_of<T>(), mc::DType::kFloat32};
  REQUIRE(mc::launch_bias_act(p, nullptr) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  require_close(dy.read(), want, tol, tol);
}

TEST_CASE("launch_bias_act matches the host reference", "[bias_act]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  for (const bool channels_last : {false, true}) {
    for (const bool per_sample : {false, true}) {
      check_bias_act<float>(2, 24, 48, channels_last, per_sample, 1e-5);  // 16-byte vectors
      check_bias_act<float>(3, 5, 7, channels_last, per_sample, 1e-5);    // scalar path
      check_bias_act<__half>(2, 40, 64, channels_last, per_sample, 4e-3);
    }
  }
}

namespace {

// A device copy of host values of any type, read back as they are (indices, flags, counts).
template <typename T>
struct Raw {
  T* ptr = nullptr;
  size_t n = 0;
  explicit Raw(size_t count, int fill_byte = 0xFF) : n(count) {
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n, 1) * sizeof(T)) == cudaSuccess);
    REQUIRE(cudaMemset(ptr, fill_byte, std::max<size_t>(n, 1) * sizeof(T)) == cudaSuccess);
  }
  explicit Raw(const std::vector<T>& host) : Raw(host.size()) {
    if (n > 0)
      REQUIRE(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  ~Raw() { cudaFree(ptr); }
  std::vector<T> read() const {
    std::vector<T> host(n);
    if (n > 0)
      REQUIRE(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    return host;
  }
};

double radial_basis_reference(mc::RadialBasisKind kind, mc::CutoffFn fn, int64_t num, int64_t k,
                              double d, double c) {
  double basis;
  if (kind == mc::RadialBasisKind::kGaussian) {
    const double spacing = num > 1 ? c / (num - 1) : c;
    basis = std::exp(-0.5 * std::pow((d - k * spacing) / spacing, 2));
  } else {
    const double n = (k + 1) * M_PI / c;
    basis = std::sqrt(2 / c) * (d == 0 ? n : std::sin(n * d) / d);
  }
  if (fn == mc::CutoffFn::kNone) return basis;
  if (d >= c) return 0.0;
  const double x = d / c;
  const double env = fn == mc::CutoffFn::kCosine
                         ? 0.5 * (std::cos(M_PI * x) + 1)
                         : 1 - 28 * std::pow(x, 6) + 48 * std::pow(x, 7) - 21 * std::pow(x, 8);
  return basis * env;
}

// d/dd of radial_basis_reference, from the analytic derivatives of basis and envelope.
double radial_basis_derivative_reference(mc::RadialBasisKind kind, mc::CutoffFn fn, int64_t num,
                                         int64_t k, double d, double c) {
  double basis, slope;
  if (kind == mc::RadialBasisKind::kGaussian) {
    const double spacing = num > 1 ? c / (num - 1) : c;
    const double z = (d - k * spacing) / spacing;
    basis = std::exp(-0.5 * z * z);
    slope = -z / spacing * basis;
  } else {
    const double n = (k + 1) * M_PI / c;
    basis = std::sqrt(2 / c) * (d == 0 ? n : std::sin(n * d) / d);
    slope = d == 0 ? 0.0 : std::sqrt(2 / c) * (n * std::cos(n * d) / d - std::sin(n * d) / (d * d));
  }
  if (fn == mc::CutoffFn::kNone) return slope;
  if (d >= c) return 0.0;
  const double x = d / c;
  const double env = fn == mc::CutoffFn::kCosine
                         ? 0.5 * (std::cos(M_PI * x) + 1)
                         : 1 - 28 * std::pow(x, 6) + 48 * std::pow(x, 7) - 21 * std::pow(x, 8);
  const double env_slope = fn == mc::CutoffFn::kCosine
                               ? -0.5 * M_PI / c * std::sin(M_PI * x)
                               : (-168 * std::pow(x, 5) + 336 * std::pow(x, 6) - 168 * std::pow(x, 7)) / c;
  return slope * env + basis * env_slope;
}

// (i, j, S) -> distance.
using PairMap = std::map<std::tuple<int64_t, int64_t, int, int, int>, double>;

struct Geometry {
  std::vector<float> positions;  // [N, 3]
  std::vector<float> cells;      // [M, 3, 3], empty: open
  std::vector<uint8_t> pbc;      // [M, 3] flags, empty: all periodic
  std::vector<int64_t> batch;    // [N], empty: one molecule
  float cutoff;
};

void invert(const double a[9], double out[9]) {
  const double det = a[0] * (a[4] * a[8] - a[5] * a[7]) - a[1] * (a[3] * a[8] - a[5] * a[6]) +
                     a[2] * (a[3] * a[7] - a[4] * a[6]);
  out[0] = (a[4] * a[8] - a[5] * a[7]) / det;
  out[1] = (a[2] * a[7] - a[1] * a[8]) / det;
  out[2] = (a[1] * a[5] - a[2] * a[4]) / det;
  out[3] = (a[5] * a[6] - a[3] * a[8]) / det;
  out[4] = (a[0] * a[8] - a[2] * a[6]) / det;
  out[5] = (a[2] * a[3] - a[0] * a[5]) / det;
  out[6] = (a[3] * a[7] - a[4] * a[6]) / det;
  out[7] = (a[1] * a[6] - a[0] * a[7]) / det;
  out[8] = (a[0] * a[4] - a[1] * a[3]) / det;
}

void lattice_of(const Geometry& g, int64_t m, double cell[9], bool periodic[3]) {
  for (int e = 0; e < 9; ++e) cell[e] = g.cells.empty() ? (e % 4 == 0) : g.cells[9 * m + e];
  for (int k = 0; k < 3; ++k)
    periodic[k] = !g.cells.empty() && (g.pbc.empty() || g.pbc[3 * m + k] != 0);
}

int64_t molecule(const Geometry& g, int64_t i) { return g.batch.empty() ? 0 : g.batch[i]; }

// Every pair of a molecule against every image in a box wide enough for any pair, in double.
PairMap brute_force_pairs(const Geometry& g, bool half) {
  const int64_t n = static_cast<int64_t>(g.positions.size() / 3);
  PairMap found;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      if (molecule(g, i) != molecule(g, j)) continue;
      double cell[9], inverse[9];
      bool periodic[3];
      lattice_of(g, molecule(g, i), cell, periodic);
      invert(cell, inverse);
      double delta[3];
      for (int c = 0; c < 3; ++c) delta[c] = double(g.positions[3 * j + c]) - g.positions[3 * i + c];
      int lo[3], hi[3];
      for (int k = 0; k < 3; ++k) {
        double f = 0, width = 0;
        for (int c = 0; c < 3; ++c) {
          f += delta[c] * inverse[3 * c + k];
          width += inverse[3 * c + k] * inverse[3 * c + k];
        }
        const int reach = static_cast<int>(std::ceil(g.cutoff * std::sqrt(width))) + 1;
        lo[k] = periodic[k] ? static_cast<int>(std::floor(-f)) - reach : 0;
        hi[k] = periodic[k] ? static_cast<int>(std::ceil(-f)) + reach : 0;
      }
      for (int s0 = lo[0]; s0 <= hi[0]; ++s0)
        for (int s1 = lo[1]; s1 <= hi[1]; ++s1)
          for (int s2 = lo[2]; s2 <= hi[2]; ++s2) {
            const std::array<int, 3> s{s0, s1, s2};
            if (i == j && s == std::array<int, 3>{0, 0, 0}) continue;
            if (half && !(i < j || (i == j && s > std::array<int, 3>{0, 0, 0}))) continue;
            double d2 = 0;
            for (int c = 0; c < 3; ++c) {
              const double v = delta[c] + s0 * cell[c] + s1 * cell[3 + c] + s2 * cell[6 + c];
              d2 += v * v;
            }
            if (std::sqrt(d2) < g.cutoff) found[{i, j, s0, s1, s2}] = std::sqrt(d2);
          }
    }
  return found;
}

struct NeighborListRun {
  int64_t num_pairs;
  std::vector<int64_t> pairs;  // [2, P]
  std::vector<float> shifts, distances;
};

NeighborListRun run_neighbor_list(const Geometry& g, int64_t max_pairs, bool half,
                                  mc::NeighborSearch search) {
  const int64_t n = static_cast<int64_t>(g.positions.size() / 3);
  std::vector<float> positions = g.positions, cells = g.cells;
  Device<float> dpos(positions);
  Device<float> dcell(cells);
  Raw<uint8_t> dpbc(g.pbc);
  Raw<int64_t> dbatch(g.batch);
  Raw<int64_t> dpairs(2 * max_pairs), dcount(1);
  Device<float> dshifts(3 * max_pairs), ddistances(max_pairs);
  mc::NeighborListParams p{};
  p.positions = dpos.ptr;
  p.cell = g.cells.empty() ? nullptr : dcell.ptr;
  p.pbc = g.pbc.empty() ? nullptr : reinterpret_cast<const bool*>(dpbc.ptr);
  p.pbc_stride = 3;
  p.batch = g.batch.empty() ? nullptr : dbatch.ptr;
  p.num_molecules = g.cells.empty() ? 1 : static_cast<int64_t>(g.cells.size() / 9);
  p.num_atoms = n;
  p.cutoff = g.cutoff;
  p.max_reach = 32.0f;
  p.max_pairs = max_pairs;
  p.half = half;
  p.search = search;
  p.pairs = dpairs.ptr;
  p.shifts = dshifts.ptr;
  p.distances = ddistances.ptr;
  p.num_pairs = dcount.ptr;
  void* workspace = nullptr;
  REQUIRE(cudaMalloc(&workspace, std::max<size_t>(mc::neighbor_list_workspace_bytes(p), 1)) == cudaSuccess);
  REQUIRE(mc::launch_neighbor_list(p, workspace, nullptr) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  cudaFree(workspace);
  return {dcount.read()[0], dpairs.read(), dshifts.read(), ddistances.read()};
}

// The stored pairs as (i, j, S) -> distance, S recovered from the shift; checks the grouping
// by i, that no pair repeats, and the padding.
PairMap stored_pairs(const Geometry& g, const NeighborListRun& run, int64_t max_pairs) {
  PairMap got;
  const int64_t stored = std::min(run.num_pairs, max_pairs);
  for (int64_t e = 0; e < stored; ++e) {
    const int64_t i = run.pairs[e], j = run.pairs[max_pairs + e];
    if (e > 0) REQUIRE(run.pairs[e - 1] <= i);
    double cell[9], inverse[9];
    bool periodic[3];
    lattice_of(g, molecule(g, i), cell, periodic);
    invert(cell, inverse);
    int s[3];
    for (int k = 0; k < 3; ++k) {
      double f = 0;
      for (int c = 0; c < 3; ++c) f += run.shifts[3 * e + c] * inverse[3 * c + k];
      s[k] = static_cast<int>(std::lround(f));
      REQUIRE(std::abs(f - s[k]) < 1e-3);
    }
    REQUIRE(got.emplace(std::make_tuple(i, j, s[0], s[1], s[2]), run.distances[e]).second);
  }
  for (int64_t e = stored; e < max_pairs; ++e) {
    REQUIRE(run.pairs[e] == 0);
    REQUIRE(run.pairs[max_pairs + e] == 0);
    REQUIRE(run.distances[e] == g.cutoff);
    REQUIRE(run.shifts[3 * e] == g.cutoff);
  }
  return got;
}

void require_same_pairs(const PairMap& got, const PairMap& want, double cutoff) {
  size_t unexplained = 0, far = 0;
  for (const auto& [key, d] : got)
    if (!want.count(key) && std::abs(d - cutoff) > 1e-4) ++unexplained;
  for (const auto& [key, d] : want) {
    const auto it = got.find(key);
    if (it == got.end()) {
      if (std::abs(d - cutoff) > 1e-4) ++unexplained;
    } else if (std::abs(it->second - d) > 5e-5) {
      ++far;
    }
  }
  INFO("pairs: got " << got.size() << ", want " << want.size());
  REQUIRE(unexplained == 0);
  REQUIRE(far == 0);
}

// Fractional coordinates in [-0.5, 1.5) of `cell` (the unit cube when open), scaled by `side`.
std::vector<float> random_positions(int64_t n, const std::vector<float>& cell, float side = 1.0f) {
  std::uniform_real_distribution<float> dist(-0.5f, 1.5f);
  std::vector<float> pos(3 * n);
  for (int64_t i = 0; i < n; ++i) {
    const float f[3] = {dist(rng()), dist(rng()), dist(rng())};
    for (int c = 0; c < 3; ++c)
      pos[3 * i + c] = cell.empty() ? side * f[c]
                                    : f[0] * cell[c] + f[1] * cell[3 + c] + f[2] * cell[6 + c];
  }
  return pos;
}

}  // namespace

TEST_CASE("launch_radial_basis matches the host reference", "[radial_basis]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  const float cutoff = 5.0f;
  for (const auto kind : {mc::RadialBasisKind::kGaussian, mc::RadialBasisKind::kBessel})
    for (const auto fn : {mc::CutoffFn::kNone, mc::CutoffFn::kCosine, mc::CutoffFn::kPolynomial})
      for (const int64_t num : {1, 7, 20}) {
        INFO("kind=" << int(kind) << " cutoff_fn=" << int(fn) << " num=" << num);
        const int64_t count = 1001;
        std::vector<float> d = random_values(count, 3.0f, 2.5f);
        for (auto& v : d) v = std::abs(v);
        d[0] = 0.0f;
        d[1] = cutoff;
        Device<float> dd(d), dout(count * num);
        std::vector<double> want(count * num);
        for (int64_t p = 0; p < count; ++p)
          for (int64_t k = 0; k < num; ++k)
            want[p * num + k] = radial_basis_reference(kind, fn, num, k, d[p], cutoff);
        mc::RadialBasisParams params{dd.ptr, dout.ptr, count, num, cutoff, kind, fn, mc::DType::kFloat32};
        REQUIRE(mc::launch_radial_basis(params, nullptr) == cudaSuccess);
        REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
        require_close(dout.read(), want, 2e-5, 2e-5);
      }
}

// Sums with cancellation: the error is compared relative to 1 + sum_k |grad_k * derivative_k|.
template <typename T>
void check_radial_basis_backward(mc::RadialBasisKind kind, mc::CutoffFn fn, int64_t num, double tol) {
  const float cutoff = 5.0f;
  const int64_t count = 1001;
  std::vector<float> d = random_values(count, 3.0f, 2.5f);
  for (auto& v : d) v = std::fmod(std::abs(v), 1.2f * cutoff);  // neighbor_list's range, and beyond
  d[0] = 0.0f;
  d[1] = cutoff;
  d[2] = 1e-3f;
  std::vector<float> grad = random_values(count * num, 0.3f, 1.7f);
  Device<T> dd(d), dgrad(grad), dout(count);  // d and grad now hold the values rounded to T
  mc::RadialBasisBackwardParams params{dgrad.ptr, dd.ptr, dout.ptr, count, num, cutoff, kind, fn,
                                       dtype_of<T>()};
  REQUIRE(mc::launch_radial_basis_backward(params, nullptr) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const std::vector<float> got = dout.read();
  std::vector<float> got_scaled(count);
  std::vector<double> want_scaled(count);
  for (int64_t p = 0; p < count; ++p) {
    double want = 0, magnitude = 0;
    for (int64_t k = 0; k < num; ++k) {
      const double term =
          grad[p * num + k] * radial_basis_derivative_reference(kind, fn, num, k, d[p], cutoff);
      want += term;
      magnitude += std::abs(term);
    }
    got_scaled[p] = static_cast<float>(got[p] / (1 + magnitude));
    want_scaled[p] = want / (1 + magnitude);
  }
  require_close(got_scaled, want_scaled, tol, tol);
}

TEST_CASE("launch_radial_basis_backward matches the host reference", "[radial_basis]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  for (const auto kind : {mc::RadialBasisKind::kGaussian, mc::RadialBasisKind::kBessel})
    for (const auto fn : {mc::CutoffFn::kNone, mc::CutoffFn::kCosine, mc::CutoffFn::kPolynomial})
      for (const int64_t num : {1, 5, 20, 50}) {  // groups of 4, 8 and 32 lanes, 50 in two passes
        INFO("kind=" << int(kind) << " cutoff_fn=" << int(fn) << " num=" << num);
        check_radial_basis_backward<float>(kind, fn, num, 2e-5);
        check_radial_basis_backward<__half>(kind, fn, num, 2e-3);
      }
}

TEST_CASE("launch_radial_basis_backward of nothing launches nothing", "[radial_basis]") {
  mc::RadialBasisBackwardParams params{nullptr, nullptr, nullptr, 0, 20, 5.0f,
                                       mc::RadialBasisKind::kBessel, mc::CutoffFn::kCosine,
                                       mc::DType::kFloat32};
  REQUIRE(mc::launch_radial_basis_backward(params, nullptr) == cudaSuccess);
}

TEST_CASE("launch_neighbor_list matches brute force", "[neighbor_list]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  const std::vector<float> triclinic = {6.0f, 0, 0, 1.5f, 5.5f, 0, -1.0f, 1.2f, 6.2f};
  const std::vector<float> small = {3.0f, 0, 0, 0.4f, 3.5f, 0, 0.3f, -0.5f, 4.0f};
  std::vector<Geometry> cases;
  cases.push_back({random_positions(200, {}, 10.0f), {}, {}, {}, 2.5f});         // open
  cases.push_back({random_positions(120, triclinic), triclinic, {}, {}, 3.0f});  // periodic
  cases.push_back({random_positions(40, small), small, {}, {}, 4.5f});           // cutoff > box
  cases.push_back({random_positions(80, triclinic), triclinic, {1, 0, 1}, {}, 3.0f});  // mixed pbc
  {  // a batch: a periodic molecule, an open one (pbc off), a small box
    Geometry g{{}, {}, {1, 1, 1, 0, 0, 0, 1, 1, 1}, {}, 3.2f};
    const std::vector<float>* cells[] = {&triclinic, &triclinic, &small};
    const int64_t sizes[] = {30, 7, 12};
    for (int m = 0; m < 3; ++m) {
      const std::vector<float> pos = random_positions(sizes[m], *cells[m]);
      g.positions.insert(g.positions.end(), pos.begin(), pos.end());
      g.cells.insert(g.cells.end(), cells[m]->begin(), cells[m]->end());
      g.batch.insert(g.batch.end(), sizes[m], m);
    }
    cases.push_back(g);
  }
  for (size_t c = 0; c < cases.size(); ++c)
    for (const bool half : {false, true})
      for (const auto search : {mc::NeighborSearch::kDirect, mc::NeighborSearch::kCellList}) {
        const Geometry& g = cases[c];
        if (search == mc::NeighborSearch::kCellList && !g.batch.empty()) continue;
        INFO("case " << c << " half=" << half << " cell_list=" << (search == mc::NeighborSearch::kCellList));
        const PairMap want = brute_force_pairs(g, half);
        const int64_t capacity = static_cast<int64_t>(want.size()) + 17;
        const NeighborListRun run = run_neighbor_list(g, capacity, half, search);
        REQUIRE(std::abs(run.num_pairs - static_cast<int64_t>(want.size())) <= 2);
        require_same_pairs(stored_pairs(g, run, capacity), want, g.cutoff);
        // Overflow: the count stays true, the first pairs are the same ones.
        const int64_t part = static_cast<int64_t>(want.size()) / 3;
        const NeighborListRun cut = run_neighbor_list(g, part, half, search);
        REQUIRE(cut.num_pairs == run.num_pairs);
        for (int64_t e = 0; e < part; ++e) {
          REQUIRE(cut.pairs[e] == run.pairs[e]);
          REQUIRE(cut.pairs[part + e] == run.pairs[capacity + e]);
          REQUIRE(cut.distances[e] == run.distances[e]);
        }
      }
}

TEST_CASE("launch_neighbor_list flags invalid geometry on the device", "[neighbor_list]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  const std::vector<float> cube = {4.0f, 0, 0, 0, 4.0f, 0, 0, 0, 4.0f};
  Geometry nan_atom{random_positions(10, cube), cube, {}, {}, 2.0f};
  nan_atom.positions[7] = std::nanf("");
  Geometry singular{random_positions(10, cube), {4.0f, 0, 0, 0, 4.0f, 0, 0, 0, 0}, {}, {}, 2.0f};
  Geometry unsorted{random_positions(4, {}, 3.0f), {}, {}, {0, 1, 0, 1}, 2.0f};
  for (const Geometry* g : {&nan_atom, &singular, &unsorted})
    for (const auto search : {mc::NeighborSearch::kDirect, mc::NeighborSearch::kCellList}) {
      if (search == mc::NeighborSearch::kCellList && !g->batch.empty()) continue;
      const NeighborListRun run = run_neighbor_list(*g, 16, false, search);
      REQUIRE(run.num_pairs == -1);
      for (int64_t e = 0; e < 16; ++e) {
        REQUIRE(std::isnan(run.distances[e]));
        REQUIRE(run.pairs[e] == 0);
      }
    }
}

namespace {

// Runs both launchers on random features and the given pairs; checks them against host sums in
// float64 (of the values as rounded to T) unless an index is out of range, where it checks the
// documented NaN outputs instead.
template <typename T>
void check_message_passing(int64_t n, int64_t f, const std::vector<int64_t>& pairs, double tol) {
  const int64_t p = static_cast<int64_t>(pairs.size() / 2);
  std::vector<float> x = random_values(n * f), w = random_values(p * f, 0.2f, 1.0f);
  Device<T> dx(x), dw(w), dout(n * f), dprod(p * f);
  int64_t* dpairs = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&dpairs), std::max<size_t>(pairs.size(), 1) * 8) == cudaSuccess);
  if (p > 0)
    REQUIRE(cudaMemcpy(dpairs, pairs.data(), pairs.size() * 8, cudaMemcpyHostToDevice) == cudaSuccess);
  const size_t bytes = mc::message_passing_workspace_bytes(n, f, dtype_of<T>());
  void* workspace = nullptr;
  REQUIRE(cudaMalloc(&workspace, bytes) == cudaSuccess);
  REQUIRE(cudaMemset(workspace, 0xFF, bytes) == cudaSuccess);  // the launcher must zero it

  mc::MessagePassingParams mp{dx.ptr, dw.ptr, dpairs, dout.ptr, workspace, n, p, f, dtype_of<T>()};
  REQUIRE(mc::launch_message_passing(mp, nullptr) == cudaSuccess);
  mc::PairProductParams pp{dx.ptr, dx.ptr, dpairs, dprod.ptr, n, p, f, dtype_of<T>()};
  REQUIRE(mc::launch_pair_product(pp, nullptr) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const std::vector<float> out = dout.read(), prod = dprod.read();
  cudaFree(dpairs);
  cudaFree(workspace);

  const auto valid = [&](int64_t q) {
    return pairs[q] >= 0 && pairs[q] < n && pairs[p + q] >= 0 && pairs[p + q] < n;
  };
  bool all_valid = true;
  for (int64_t q = 0; q < p; ++q) all_valid = all_valid && valid(q);
  std::vector<double> sums(n * f, 0.0), products(p * f);
  for (int64_t q = 0; q < p; ++q) {
    if (!valid(q)) continue;
    const int64_t i = pairs[q], j = pairs[p + q];
    for (int64_t k = 0; k < f; ++k) {
      sums[i * f + k] += double(x[j * f + k]) * w[q * f + k];
      products[q * f + k] = double(x[i * f + k]) * x[j * f + k];
    }
  }
  if (all_valid) {
    require_close(out, sums, tol, tol);
    require_close(prod, products, tol, tol);
    return;
  }
  for (const float v : out) REQUIRE(std::isnan(v));
  for (int64_t q = 0; q < p; ++q)
    for (int64_t k = 0; k < f; ++k) {
      if (valid(q)) {
        REQUIRE(std::abs(prod[q * f + k] - products[q * f + k]) <= tol * (1 + std::abs(products[q * f + k])));
      } else {
        REQUIRE(std::isnan(prod[q * f + k]));
      }
    }
}

std::vector<int64_t> random_pairs(int64_t n, int64_t p, bool sorted) {
  std::uniform_int_distribution<int64_t> node(0, n - 1);
  std::vector<std::pair<int64_t, int64_t>> list(p);
  for (auto& e : list) e = {node(rng()), node(rng())};
  if (sorted) std::stable_sort(list.begin(), list.end(), [](auto a, auto b) { return a.first < b.first; });
  std::vector<int64_t> flat(2 * p);
  for (int64_t q = 0; q < p; ++q) {
    flat[q] = list[q].first;
    flat[p + q] = list[q].second;
  }
  return flat;
}

}  // namespace

TEST_CASE("launch_message_passing and launch_pair_product match the host reference",
          "[message_passing]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  SECTION("valid pairs in any order, odd and vector widths") {
    for (const int64_t f : {1, 7, 128, 129})
      for (const bool sorted : {false, true})
        for (const int64_t p : {0, 1, 700, 5000}) {
          INFO("f=" << f << " sorted=" << sorted << " p=" << p);
          const std::vector<int64_t> pairs = random_pairs(50, p, sorted);
          check_message_passing<float>(50, f, pairs, 1e-4);
          check_message_passing<__half>(50, f, pairs, 4e-3);
        }
  }
  SECTION("out-of-range indices: no access outside the arrays, NaN outputs") {
    for (const int64_t bad : {int64_t{50}, int64_t{-1}, int64_t{1} << 40}) {
      std::vector<int64_t> pairs = random_pairs(50, 300, true);
      pairs[17] = bad;        // a receiver
      pairs[300 + 5] = bad;   // a sender
      check_message_passing<float>(50, 128, pairs, 1e-4);
      check_message_passing<__half>(50, 33, pairs, 4e-3);
    }
  }
}

// ---- pair_vectors ----------------------------------------------------------------------------

namespace {

// Forward and backward on N atoms and P random pairs (repeats and self pairs included, shifts
// given) against the formulas of cuda/pair_vectors.cuh in double. `bad` >= 0 puts an
// out-of-range index at pair `bad`.
void check_pair_vectors(int64_t N, int64_t P, int64_t bad = -1) {
  INFO("N=" << N << " P=" << P << " bad=" << bad);
  std::vector<float> positions = random_values(N * 3, 0.0f, 3.0f), shifts = random_values(P * 3),
                     grad_vectors = random_values(P * 3), grad_distances = random_values(P);
  std::vector<int64_t> pairs(2 * P);
  std::uniform_int_distribution<int64_t> atom(0, N - 1);
  for (auto& k : pairs) k = atom(rng());
  if (bad >= 0) pairs[P + bad] = N;  // a sender past the last atom
  Device<float> dpos(positions), dshifts(shifts), dgv(grad_vectors), dgd(grad_distances), vectors(P * 3),
      distances(P), grad(N * 3);
  int64_t* dpairs = nullptr;
  void* workspace = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&dpairs), std::max<size_t>(pairs.size(), 1) * sizeof(int64_t)) ==
          cudaSuccess);
  REQUIRE(cudaMemcpy(dpairs, pairs.data(), pairs.size() * sizeof(int64_t), cudaMemcpyHostToDevice) == cudaSuccess);
  const size_t workspace_bytes = mc::pair_vectors_backward_workspace_bytes(N, P, /*given_order=*/false);
  REQUIRE(cudaMalloc(&workspace, workspace_bytes) == cudaSuccess);
  REQUIRE(cudaMemset(workspace, 0x7F, workspace_bytes) == cudaSuccess);
  REQUIRE(mc::launch_pair_vectors({dpos.ptr, dpairs, dshifts.ptr, vectors.ptr, distances.ptr, N, P}, nullptr) ==
          cudaSuccess);
  REQUIRE(mc::launch_pair_vectors_backward({dgv.ptr, dgd.ptr, dpos.ptr, dpairs, dshifts.ptr, grad.ptr, nullptr, N, P},
                                           workspace, nullptr) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const std::vector<float> got_vectors = vectors.read(), got_distances = distances.read(), got_grad = grad.read();
  cudaFree(dpairs);
  cudaFree(workspace);
  if (bad >= 0) {
    for (int c = 0; c < 3; ++c) REQUIRE(std::isnan(got_vectors[3 * bad + c]));
    REQUIRE(std::isnan(got_distances[bad]));
    for (const float g : got_grad) REQUIRE(std::isnan(g));
    return;
  }
  std::vector<double> want_vectors(P * 3), want_distances(P), want_grad(N * 3);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t i = pairs[p], j = pairs[P + p];
    double v[3], squares = 0;
    for (int c = 0; c < 3; ++c) {
      v[c] = double{positions[3 * j + c]} - positions[3 * i + c] + shifts[3 * p + c];
      squares += v[c] * v[c];
      want_vectors[3 * p + c] = v[c];
    }
    const double d = std::sqrt(squares);
    want_distances[p] = d;
    for (int c = 0; c < 3; ++c) {
      const double g = grad_vectors[3 * p + c] + (d > 0 ? grad_distances[p] / d : 0.0) * v[c];
      want_grad[3 * j + c] += g;
      want_grad[3 * i + c] -= g;
    }
  }
  require_close(got_vectors, want_vectors, 1e-5, 1e-5);
  require_close(got_distances, want_distances, 1e-5, 1e-5);
  require_close(got_grad, want_grad, 1e-4, 1e-4);  // float32 atomics over each atom's pairs
}

}  // namespace

TEST_CASE("launch_pair_vectors(_backward) match the host reference", "[pair_vectors]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  check_pair_vectors(12, 132);
  check_pair_vectors(1, 3);
  check_pair_vectors(5, 0);
  check_pair_vectors(3000, 20000);
}

TEST_CASE("launch_pair_vectors writes NaN for out-of-range pairs", "[pair_vectors]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  check_pair_vectors(6, 40, 7);
}

// ---- painn_update ----------------------------------------------------------------------------

namespace {

// All four launchers on s [N, F], v, uv, vv [N, 3, F], a [N, 3F], grad_s [N, F], grad_v [N, 3, F],
// grad_input [N, 2F] against the formulas of cuda/painn_update.cuh in double.
template <typename T>
void check_painn_update(int64_t N, int64_t F) {
  INFO("N=" << N << " F=" << F << " half=" << (!std::is_same_v<T, float>));
  const float eps = 0.25f;
  std::vector<float> s = random_values(N * F), v = random_values(N * 3 * F), uv = random_values(N * 3 * F),
                     vv = random_values(N * 3 * F), a = random_values(N * 3 * F), gs = random_values(N * F),
                     gv = random_values(N * 3 * F), gin = random_values(N * 2 * F);
  Device<T> ds(s), dv(v), duv(uv), dvv(vv), da(a), dgs(gs), dgv(gv), dgin(gin);
  Device<T> input(N * 2 * F), grad_vv_in(N * 3 * F), s_out(N * F), v_out(N * 3 * F), grad_uv(N * 3 * F),
      grad_vv(N * 3 * F), grad_a(N * 3 * F);
  const mc::DType dtype = dtype_of<T>();
  REQUIRE(mc::launch_painn_update_input({ds.ptr, dvv.ptr, input.ptr, N, F, eps, dtype}, nullptr) == cudaSuccess);
  REQUIRE(mc::launch_painn_update_input_backward({dgin.ptr, dvv.ptr, grad_vv_in.ptr, N, F, eps, dtype}, nullptr) ==
          cudaSuccess);
  REQUIRE(mc::launch_painn_update({ds.ptr, dv.ptr, duv.ptr, dvv.ptr, da.ptr, s_out.ptr, v_out.ptr, N, F, dtype},
                                  nullptr) == cudaSuccess);
  REQUIRE(mc::launch_painn_update_backward({dgs.ptr, dgv.ptr, duv.ptr, dvv.ptr, da.ptr, grad_uv.ptr, grad_vv.ptr,
                                            grad_a.ptr, N, F, dtype},
                                           nullptr) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  std::vector<double> w_input(N * 2 * F), w_grad_vv_in(N * 3 * F), w_s(N * F), w_v(N * 3 * F),
      w_guv(N * 3 * F), w_gvv(N * 3 * F), w_ga(N * 3 * F);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t f = 0; f < F; ++f) {
      const auto at3 = [&](int c) { return (n * 3 + c) * F + f; };
      double squares = 0, dot = 0, ga_vv = 0;
      const double a_vv = a[n * 3 * F + f], a_sv = a[n * 3 * F + F + f], a_ss = a[n * 3 * F + 2 * F + f];
      for (int c = 0; c < 3; ++c) {
        squares += double{vv[at3(c)]} * vv[at3(c)];
        dot += double{uv[at3(c)]} * vv[at3(c)];
        ga_vv += double{gv[at3(c)]} * uv[at3(c)];
      }
      const double norm = std::sqrt(squares + eps);
      w_input[n * 2 * F + f] = s[n * F + f];
      w_input[n * 2 * F + F + f] = norm;
      w_s[n * F + f] = s[n * F + f] + a_ss + a_sv * dot;
      for (int c = 0; c < 3; ++c) {
        w_grad_vv_in[at3(c)] = gin[n * 2 * F + F + f] * vv[at3(c)] / norm;
        w_v[at3(c)] = v[at3(c)] + a_vv * uv[at3(c)];
        w_guv[at3(c)] = gv[at3(c)] * a_vv + gs[n * F + f] * a_sv * vv[at3(c)];
        w_gvv[at3(c)] = gs[n * F + f] * a_sv * uv[at3(c)];
      }
      w_ga[n * 3 * F + f] = ga_vv;
      w_ga[n * 3 * F + F + f] = gs[n * F + f] * dot;
      w_ga[n * 3 * F + 2 * F + f] = gs[n * F + f];
    }
  }
  // Sums of three products of values up to ~8: the half outputs' one rounding dominates.
  const double tol = std::is_same_v<T, float> ? 5e-4 : 2e-2;
  require_close(input.read(), w_input, tol, 1e-3);
  require_close(grad_vv_in.read(), w_grad_vv_in, tol, 1e-3);
  require_close(s_out.read(), w_s, tol, 1e-3);
  require_close(v_out.read(), w_v, tol, 1e-3);
  require_close(grad_uv.read(), w_guv, tol, 1e-3);
  require_close(grad_vv.read(), w_gvv, tol, 1e-3);
  require_close(grad_a.read(), w_ga, tol, 1e-3);
}

}  // namespace

TEST_CASE("launch_painn_update(_input)(_backward) match the host reference", "[painn_update]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  for (const auto& [N, F] : {std::pair<int64_t, int64_t>{12, 128}, {7, 33}, {1, 1}, {0, 5}, {3000, 128}}) {
    check_painn_update<float>(N, F);
    check_painn_update<__half>(N, F);
  }
}

// ---- vector_message_passing -----------------------------------------------------------------

namespace {

struct MessageCase {
  int64_t nodes, features, pairs;
  bool sorted;
};

struct MessageInputs {
  std::vector<float> x, filter, vectors, directions, grad_scalar, grad_vector;
  std::vector<int64_t> pairs;  // [2, P]
};

MessageInputs message_inputs(const MessageCase& k) {
  const int64_t F = k.features;
  MessageInputs in{random_values(k.nodes * 3 * F), random_values(k.pairs * 3 * F),
                   random_values(k.nodes * 3 * F), random_values(k.pairs * 3),
                   random_values(k.nodes * F),     random_values(k.nodes * 3 * F),
                   std::vector<int64_t>(2 * k.pairs)};
  std::uniform_int_distribution<int64_t> node(0, k.nodes - 1);
  std::vector<std::pair<int64_t, int64_t>> ij(k.pairs);
  for (auto& e : ij) e = {node(rng()), node(rng())};
  if (k.sorted) std::sort(ij.begin(), ij.end());
  for (int64_t p = 0; p < k.pairs; ++p) {
    in.pairs[p] = ij[p].first;
    in.pairs[k.pairs + p] = ij[p].second;
    float* d = in.directions.data() + 3 * p;
    const float norm = std::sqrt(d[0] * d[0] + d[1] * d[1] + d[2] * d[2]);
    for (int c = 0; c < 3; ++c) d[c] /= norm;
  }
  return in;
}

// Host references in double: the forward (scalar, vector) and backward (grad_x, grad_filter,
// grad_vectors, grad_directions) of docs/ops.md.
std::array<std::vector<double>, 6> message_reference(const MessageCase& k, const MessageInputs& in) {
  const int64_t F = k.features, N = k.nodes, P = k.pairs;
  std::vector<double> scalar(N * F), vector(N * 3 * F), gx(N * 3 * F), gf(P * 3 * F), gvec(N * 3 * F),
      gd(P * 3);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t i = in.pairs[p], j = in.pairs[P + p];
    for (int64_t f = 0; f < F; ++f) {
      double x[3], fl[3], m[3];
      for (int part = 0; part < 3; ++part) {
        x[part] = in.x[j * 3 * F + part * F + f];
        fl[part] = in.filter[p * 3 * F + part * F + f];
        m[part] = x[part] * fl[part];
      }
      scalar[i * F + f] += m[0];
      double g[3] = {in.grad_scalar[i * F + f], 0.0, 0.0};
      for (int c = 0; c < 3; ++c) {
        const double v = in.vectors[(j * 3 + c) * F + f], d = in.directions[3 * p + c];
        const double gv = in.grad_vector[(i * 3 + c) * F + f];
        vector[(i * 3 + c) * F + f] += v * m[1] + m[2] * d;
        g[1] += gv * v;
        g[2] += gv * d;
        gvec[(j * 3 + c) * F + f] += gv * m[1];
        gd[3 * p + c] += gv * m[2];
      }
      for (int part = 0; part < 3; ++part) {
        gf[p * 3 * F + part * F + f] = g[part] * x[part];
        gx[j * 3 * F + part * F + f] += g[part] * fl[part];
      }
    }
  }
  return {scalar, vector, gx, gf, gvec, gd};
}

struct MessageRun {
  std::array<std::vector<float>, 6> out;  // scalar, vector, grad_x, grad_filter, grad_vectors, grad_dirs
};

template <typename T>
MessageRun run_message_passing(const MessageCase& k, MessageInputs& in) {
  const int64_t F = k.features, N = k.nodes, P = k.pairs;
  Device<T> x(in.x), filter(in.filter), vectors(in.vectors), directions(in.directions),
      grad_scalar(in.grad_scalar), grad_vector(in.grad_vector);
  Device<T> scalar(N * F), vector(N * 3 * F), gx(N * 3 * F), gf(P * 3 * F), gvec(N * 3 * F), gd(P * 3);
  int64_t* pairs = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&pairs), std::max<size_t>(in.pairs.size(), 1) * sizeof(int64_t)) ==
          cudaSuccess);
  REQUIRE(cudaMemcpy(pairs, in.pairs.data(), in.pairs.size() * sizeof(int64_t), cudaMemcpyHostToDevice) ==
          cudaSuccess);
  mc::VectorMessagePassingParams fp{x.ptr,      filter.ptr, vectors.ptr, directions.ptr,     pairs, scalar.ptr,
                                    vector.ptr, /*live_pairs=*/nullptr, N, P, F, dtype_of<T>()};
  mc::VectorMessagePassingBackwardParams bp{grad_scalar.ptr, grad_vector.ptr, x.ptr, filter.ptr,
                                            vectors.ptr, directions.ptr, pairs, gx.ptr, gf.ptr,
                                            gvec.ptr, gd.ptr, /*sender_order=*/nullptr, /*live_pairs=*/nullptr, N, P, F,
                                            dtype_of<T>()};
  const size_t bytes = std::max(mc::vector_message_passing_workspace_bytes(fp),
                                mc::vector_message_passing_backward_workspace_bytes(bp));
  void* workspace = nullptr;
  REQUIRE(cudaMalloc(&workspace, bytes) == cudaSuccess);
  REQUIRE(cudaMemset(workspace, 0x7F, bytes) == cudaSuccess);  // the launchers initialize it
  REQUIRE(mc::launch_vector_message_passing(fp, workspace, nullptr) == cudaSuccess);
  REQUIRE(mc::launch_vector_message_passing_backward(bp, workspace, nullptr) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  cudaFree(workspace);
  cudaFree(pairs);
  return {{scalar.read(), vector.read(), gx.read(), gf.read(), gvec.read(), gd.read()}};
}

}  // namespace

TEST_CASE("launch_vector_message_passing(_backward) match the host reference", "[vector_message_passing]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  // 20,000 pairs take the backward's sender order (pair_order.cuh), the others their own.
  const MessageCase cases[] = {{12, 128, 132, true},   {12, 128, 132, false}, {9, 129, 60, false},
                               {300, 64, 20000, true}, {300, 7, 20000, false}, {1, 1, 3, false},
                               {5, 3, 0, false}};
  for (const MessageCase& k : cases) {
    INFO("N=" << k.nodes << " F=" << k.features << " P=" << k.pairs << " sorted=" << k.sorted);
    {
      MessageInputs in = message_inputs(k);
      const MessageRun run = run_message_passing<float>(k, in);
      const auto want = message_reference(k, in);
      for (int o = 0; o < 6; ++o) {
        INFO("output " << o << " (float)");
        require_close(run.out[o], want[o], 1e-4, 1e-4);
      }
    }
    {
      MessageInputs in = message_inputs(k);
      const MessageRun run = run_message_passing<__half>(k, in);  // `in` now holds the rounded values
      const auto want = message_reference(k, in);
      for (int o = 0; o < 6; ++o) {
        INFO("output " << o << " (half)");
        require_close(run.out[o], want[o], 2e-3, 2e-3);
      }
    }
  }
}

TEST_CASE("launch_vector_message_passing writes NaN for out-of-range pairs", "[vector_message_passing]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  for (const int64_t pairs : {int64_t{40}, mc::kSenderOrderMinPairs}) {
    for (const int64_t bad : {int64_t{-1}, int64_t{6}}) {
      const MessageCase k{6, 8, pairs, true};
      MessageInputs in = message_inputs(k);
      in.pairs[k.pairs + 17] = bad;
      const MessageRun run = run_message_passing<float>(k, in);
      for (int o = 0; o < 6; ++o) {
        INFO("output " << o << " bad index " << bad << " P=" << pairs);
        for (const float v : run.out[o]) REQUIRE(std::isnan(v));
      }
    }
  }
}

namespace {

// int32 device arrays for the pair-order cases (Device<T> holds floating values).
int* device_ints(const std::vector<int>& host) {
  int* d = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&d), std::max<size_t>(host.size(), 1) * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMemcpy(d, host.data(), host.size() * sizeof(int), cudaMemcpyHostToDevice) == cudaSuccess);
  return d;
}

std::vector<int> read_ints(const int* d, int64_t n) {
  std::vector<int> host(n);
  REQUIRE(cudaMemcpy(host.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
  return host;
}

}  // namespace

TEST_CASE("sort_by_sender groups the pairs by sender, bad senders last", "[pair_order]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  // tests/python/test_vector_message_passing.py (SENDER_ORDER_MIN_PAIRS) and the 20,000-pair
  // cases above rely on this threshold: change them with it.
  REQUIRE(mc::kSenderOrderMinPairs == 8192);
  // Few nodes (the counting sort, with long runs across its chunks) and many (the radix sort).
  for (const int64_t nodes : {int64_t{37}, int64_t{100000}}) {
    INFO("nodes=" << nodes);
    const int64_t P = 3 * mc::kSenderOrderMinPairs + 5;
    REQUIRE_FALSE(mc::use_sender_order(nodes, mc::kSenderOrderMinPairs - 1));
    REQUIRE(mc::use_sender_order(nodes, P));
    {  // a list too short to pay: no scratch, no order (list order), nothing to check
      const int sentinel = 0;
      mc::SenderOrder none{&sentinel, {nullptr, 3}};
      REQUIRE(mc::sender_order_workspace_bytes(nodes, mc::kSenderOrderMinPairs - 1, false) == 0);
      REQUIRE(mc::launch_sender_order(nullptr, nodes, mc::kSenderOrderMinPairs - 1, nullptr, &sentinel, nullptr,
                                      &none, nullptr) == cudaSuccess);
      REQUIRE(none.order == nullptr);
      REQUIRE(none.check.count == 0);
    }
    std::uniform_int_distribution<int64_t> node(0, nodes - 1);
    std::vector<int64_t> pairs(2 * P);
    for (auto& e : pairs) e = node(rng());
    for (const int64_t p : {int64_t{0}, int64_t{5}, P - 1}) pairs[P + p] = p == 5 ? -3 : nodes;  // out of range
    int64_t* dpairs = nullptr;
    int* dorder = device_ints(std::vector<int>(P, -1));
    void* scratch = nullptr;
    const size_t bytes = mc::sort_by_sender_scratch_bytes(nodes, P);
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&dpairs), pairs.size() * sizeof(int64_t)) == cudaSuccess);
    REQUIRE(cudaMemcpy(dpairs, pairs.data(), pairs.size() * sizeof(int64_t), cudaMemcpyHostToDevice) ==
            cudaSuccess);
    REQUIRE(cudaMalloc(&scratch, bytes) == cudaSuccess);
    REQUIRE(cudaMemset(scratch, 0x7F, bytes) == cudaSuccess);  // the sort initializes it
    // Without a count, then with neighbor_list's (its padding, pairs from it on, last), then with
    // a negative one (neighbor_list's NaN case: every pair walked).
    const int64_t live = P - 1000;
    for (const int64_t count : {int64_t{-2}, live, int64_t{-1}}) {
      INFO("count=" << count);
      int64_t* dcount = nullptr;
      if (count != -2) {
        REQUIRE(cudaMalloc(reinterpret_cast<void**>(&dcount), sizeof(int64_t)) == cudaSuccess);
        REQUIRE(cudaMemcpy(dcount, &count, sizeof(int64_t), cudaMemcpyHostToDevice) == cudaSuccess);
      }
      REQUIRE(mc::sort_by_sender(dpairs, nodes, P, dcount, dorder, scratch, nullptr) == cudaSuccess);
      const std::vector<int> order = read_ints(dorder, P);
      cudaFree(dcount);
      const int64_t walked = count == live ? live : P;
      // A permutation of the pairs whose keys never decrease: the sender, `nodes` for a bad one,
      // `nodes + 1` for padding.
      std::vector<int> seen(P, 0);
      int64_t previous_key = -1;
      for (const int p : order) {
        REQUIRE(p >= 0);
        REQUIRE(p < P);
        ++seen[p];
        const int64_t sender = pairs[P + p];
        const int64_t key = p >= walked ? nodes + 1 : sender >= 0 && sender < nodes ? sender : nodes;
        REQUIRE(key >= previous_key);
        previous_key = key;
      }
      REQUIRE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
      // The bad senders (pairs 0, 5 and P - 1; the last one padding with a count) right before
      // the padding, or last.
      const int64_t bad_end = walked, bad = count == live ? 2 : 3;
      for (int64_t q = bad_end - bad; q < bad_end; ++q)
        REQUIRE((pairs[P + order[q]] < 0 || pairs[P + order[q]] >= nodes));
      for (int64_t q = walked; q < P; ++q) REQUIRE(order[q] >= walked);
    }
    cudaFree(dorder);
    cudaFree(scratch);
    cudaFree(dpairs);
  }
}

TEST_CASE("launch_sender_order checks a given order: permutations balance, others do not", "[pair_order]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  const int64_t nodes = 300, P = 2 * mc::kSenderOrderMinPairs + 77;
  std::vector<int> reversed(P);
  for (int64_t k = 0; k < P; ++k) reversed[k] = static_cast<int>(P - 1 - k);
  std::vector<int> duplicated = reversed, out_of_range = reversed, swapped = reversed, identity(P);
  duplicated[10] = duplicated[11];  // one index twice, one missing
  out_of_range[20] = static_cast<int>(P);
  std::swap(swapped[0], swapped[P - 1]);  // still a permutation
  for (int64_t k = 0; k < P; ++k) identity[k] = static_cast<int>(k);
  // With a count (neighbor_list's: the walk stops there) the positions before it must hold the
  // pairs before it: the identity does, the reversed order and the swapped identity do not.
  const int64_t count = P - 100;
  int64_t* dcount = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&dcount), sizeof(int64_t)) == cudaSuccess);
  REQUIRE(cudaMemcpy(dcount, &count, sizeof(int64_t), cudaMemcpyHostToDevice) == cudaSuccess);
  std::vector<int> swapped_identity = identity;
  std::swap(swapped_identity[0], swapped_identity[P - 1]);
  struct Case {
    const char* name;
    const std::vector<int>& given;
    const int64_t* live;
    bool valid;
  };
  for (const Case& c : {Case{"reversed", reversed, nullptr, true}, Case{"swapped", swapped, nullptr, true},
                        Case{"duplicated", duplicated, nullptr, false},
                        Case{"out of range", out_of_range, nullptr, false}, Case{"identity, count", identity, dcount, true},
                        Case{"reversed, count", reversed, dcount, false},
                        Case{"swapped identity, count", swapped_identity, dcount, false},
                        Case{"duplicated, count", duplicated, dcount, false}}) {
    INFO(c.name);
    int* dgiven = device_ints(c.given);
    void* workspace = nullptr;
    const size_t bytes = mc::sender_order_workspace_bytes(nodes, P, /*given=*/true);
    // A given order needs no sort: less scratch than sorting here.
    REQUIRE(bytes < mc::sender_order_workspace_bytes(nodes, P, /*given=*/false));
    REQUIRE(cudaMalloc(&workspace, bytes) == cudaSuccess);
    REQUIRE(cudaMemset(workspace, 0x7F, bytes) == cudaSuccess);  // the launcher initializes what it reads
    mc::SenderOrder walk;
    // The pairs are not read when an order is given.
    REQUIRE(mc::launch_sender_order(nullptr, nodes, P, c.live, dgiven, workspace, &walk, nullptr) == cudaSuccess);
    REQUIRE(walk.order != nullptr);
    REQUIRE(walk.check.count > 0);
    const std::vector<int> copied = read_ints(walk.order, P);
    std::vector<unsigned long long> balances(walk.check.count);
    REQUIRE(cudaMemcpy(balances.data(), walk.check.balances, balances.size() * sizeof(unsigned long long),
                       cudaMemcpyDeviceToHost) == cudaSuccess);
    cudaFree(dgiven);
    cudaFree(workspace);
    unsigned long long total = 0;  // what order_rejected adds up
    for (const unsigned long long b : balances) total += b;
    REQUIRE((total == 0) == c.valid);
    for (int64_t k = 0; k < P; ++k) {  // the walk's copy: in range whatever was given
      const int want = c.given[k] >= 0 && c.given[k] < P ? c.given[k] : 0;
      if (copied[k] != want) FAIL("copied[" << k << "] = " << copied[k] << ", want " << want);
    }
  }
  cudaFree(dcount);
}

namespace {

void check_small_linear(int64_t m, int64_t n, int64_t k, bool broadcast_residual) {
  INFO("m=" << m << " n=" << n << " k=" << k << " broadcast_residual=" << broadcast_residual);
  std::vector<float> x = random_values(m * k), w = random_values(n * k, 0.0f, 0.3f), b = random_values(n),
                     r = random_values(broadcast_residual ? n : m * n);
  Device<float> dx(x), dw(w), db(b), dr(r), dy(m * n);
  const int64_t ldr = broadcast_residual ? 0 : n;
  std::vector<double> want(m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = double(b[j]) + r[i * ldr + j];
      for (int64_t c = 0; c < k; ++c) {
        const double v = x[i * k + c];
        sum += v / (1.0 + std::exp(-v)) * w[j * k + c];  // silu(x) @ w^T
      }
      want[i * n + j] = sum;
    }
  }
  mc::SmallLinearParams p{dx.ptr, dw.ptr, db.ptr, dr.ptr, dy.ptr, m, n, k, k, k, ldr,
                          mc::Activation::kSilu, mc::DType::kFloat32};
  REQUIRE(mc::launch_small_linear(p, nullptr) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  require_close(dy.read(), want, 1e-4, 1e-4);
}

}  // namespace

TEST_CASE("launch_small_linear matches the host reference", "[linear]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  for (const bool broadcast : {false, true}) {
    check_small_linear(2, 24, 40, broadcast);   // 16-byte weight rows
    check_small_linear(8, 33, 37, broadcast);   // scalar path, the most rows
    check_small_linear(1, 300, 1280, broadcast);
    check_small_linear(5, 17, 2048, broadcast);  // the up-to-8-rows instance below 8; past the prefetched inputs
  }
  mc::SmallLinearParams too_many{};
  too_many.m = mc::kSmallLinearMaxRows + 1;
  REQUIRE(mc::launch_small_linear(too_many, nullptr) == cudaErrorInvalidValue);
  mc::SmallLinearParams too_wide{};
  too_wide.m = 2;
  too_wide.k = mc::kSmallLinearMaxInputs / 2 + 1;
  REQUIRE(mc::launch_small_linear(too_wide, nullptr) == cudaErrorInvalidValue);
}


template <typename T>
void check_subpixel_shuffle(int64_t n, int64_t c, int64_t h, int64_t w, bool with_bias) {
  INFO("n=" << n << " c=" << c << " h=" << h << " w=" << w << " bias=" << with_bias
            << " half=" << (!std::is_same_v<T, float>));
  std::vector<float> x = random_values(n * (h + 1) * (w + 1) * 4 * c), bias = random_values(c);
  Device<T> dx(x), dout(n * 4 * h * w * c);
  Device<float> dbias(bias);
  std::vector<double> want(dout.n);
  for (int64_t s = 0; s < n; ++s)
    for (int64_t oy = 0; oy < 2 * h; ++oy)
      for (int64_t ox = 0; ox < 2 * w; ++ox)
        for (int64_t ch = 0; ch < c; ++ch) {
          const int64_t p = oy % 2, q = ox % 2, sy = oy / 2 + p, sx = ox / 2 + q;
          const double value = x[((s * (h + 1) + sy) * (w + 1) + sx) * 4 * c + (2 * p + q) * c + ch];
          want[((s * 2 * h + oy) * 2 * w + ox) * c + ch] = value + (with_bias ? bias[ch] : 0.0);
        }
  mc::SubpixelShuffleParams p{dx.ptr, with_bias ? dbias.ptr : nullptr, dout.ptr, n, h, w, c, dtype_of<T>(),
                              mc::DType::kFloat32};  // the bias is float32 whatever T is
  REQUIRE(mc::launch_subpixel_shuffle(p, nullptr) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const double tol = std::is_same_v<T, float> ? 1e-6 : 1e-3;  // one rounding of value + bias
  require_close(dout.read(), want, tol, tol);
}

TEST_CASE("launch_subpixel_shuffle matches the host reference", "[subpixel_shuffle]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  for (const bool with_bias : {false, true}) {
    check_subpixel_shuffle<float>(2, 3, 4, 5, with_bias);    // scalar path
    check_subpixel_shuffle<float>(1, 8, 3, 3, with_bias);    // 16-byte vectors
    check_subpixel_shuffle<__half>(2, 16, 5, 2, with_bias);  // 16-byte vectors, float32 bias
    check_subpixel_shuffle<__half>(1, 13, 1, 7, with_bias);  // scalar path
  }
  mc::SubpixelShuffleParams empty{};
  REQUIRE(mc::launch_subpixel_shuffle(empty, nullptr) == cudaSuccess);
}

// Velocity-Verlet updates, float32 state and model: a kick and drift, then the forces taken in.
TEST_CASE("launch_verlet_kick_drift, launch_verlet_forces_kick and launch_verlet_forces_kick_drift match the host "
          "reference", "[verlet]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  for (const int64_t atoms : {1, 7, 300}) {
    INFO("atoms=" << atoms);
    std::vector<float> x = random_values(3 * atoms), v = random_values(3 * atoms, 0.0f, 0.1f),
                       f = random_values(3 * atoms), grad = random_values(3 * atoms), e = random_values(1),
                       inverse = random_values(atoms, 1.0f, 0.2f);
    Device<float> dx(x), dv(v), df(f), dgrad(grad), de(e), dinverse(inverse), dout(3 * atoms), denergy(1);
    mc::VerletParams p{};
    p.atoms = atoms;
    p.kick = 0.25;
    p.drift = 0.5;
    p.positions = dx.ptr;
    p.velocities = dv.ptr;
    p.forces = df.ptr;
    p.inverse_masses = dinverse.ptr;
    p.model_positions = dout.ptr;
    REQUIRE(mc::launch_verlet_kick_drift(p, nullptr) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::vector<double> want_v(3 * atoms), want_x(3 * atoms), want_f(3 * atoms);
    for (int64_t k = 0; k < 3 * atoms; ++k) {
      want_v[k] = v[k] + 0.25 * f[k] * inverse[k / 3];
      want_x[k] = x[k] + 0.5 * want_v[k];
    }
    require_close(dv.read(), want_v, 1e-6, 1e-6);
    require_close(dx.read(), want_x, 1e-6, 1e-6);
    require_close(dout.read(), want_x, 1e-6, 1e-6);

    v = dv.read();
    p.kick = 0.125;
    p.energy = denergy.ptr;
    p.grad = dgrad.ptr;
    p.model_energy = de.ptr;
    std::vector<float> count = {57.0f}, range = {60.0f, 100.0f};  // [max, min] so far
    Device<int64_t> dcount(count), drange(range);
    p.pair_count = dcount.ptr;
    p.pair_count_range = drange.ptr;
    REQUIRE(mc::launch_verlet_forces_kick(p, nullptr) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    for (int64_t k = 0; k < 3 * atoms; ++k) {
      want_f[k] = -grad[k];
      want_v[k] = v[k] + 0.125 * want_f[k] * inverse[k / 3];
    }
    require_close(df.read(), want_f, 0, 0);
    require_close(dv.read(), want_v, 1e-6, 1e-6);
    require_close(denergy.read(), {e[0]}, 0, 0);
    require_close(drange.read(), {60.0, 57.0}, 0, 0);

    // Again with a count above the maximum and a float64 model energy (read as it is, rounded once).
    std::vector<float> more = {75.0f};
    Device<int64_t> dmore(more);
    Device<double> de64(e);
    p.pair_count = dmore.ptr;
    p.model_energy = de64.ptr;
    p.model_energy_float64 = true;
    p.kick = 0.0;  // the velocities stay
    v = dv.read();
    REQUIRE(mc::launch_verlet_forces_kick(p, nullptr) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    require_close(drange.read(), {75.0, 57.0}, 0, 0);
    require_close(denergy.read(), {e[0]}, 0, 0);
    require_close(dv.read(), std::vector<double>(v.begin(), v.end()), 0, 0);

    // Both in one kernel: the forces taken in with a kick, the same kick again, then the drift
    // (and a count below the minimum folded in).
    x = dx.read();
    v = dv.read();
    p.kick = 0.25;
    p.model_energy = de.ptr;
    p.model_energy_float64 = false;
    std::vector<float> fewer = {40.0f};
    Device<int64_t> dfewer(fewer);
    p.pair_count = dfewer.ptr;
    REQUIRE(mc::launch_verlet_forces_kick_drift(p, nullptr) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    for (int64_t k = 0; k < 3 * atoms; ++k) {
      want_v[k] = v[k] + 2 * (0.25 * want_f[k] * inverse[k / 3]);
      want_x[k] = x[k] + 0.5 * want_v[k];
    }
    require_close(df.read(), want_f, 0, 0);
    require_close(dv.read(), want_v, 1e-6, 1e-6);
    require_close(dx.read(), want_x, 1e-6, 1e-6);
    require_close(dout.read(), want_x, 1e-6, 1e-6);
    require_close(denergy.read(), {e[0]}, 0, 0);
    require_close(drange.read(), {75.0, 40.0}, 0, 0);
  }
}

// cfconv: the filter network W2 act(W1 basis + b1) + b2 times the envelope, scattered from the
// senders into the receivers, and its gradients, against a double-precision host reference.
struct CfconvCase {
  int64_t nodes, pairs;
  int rbf, width;
  mc::Activation activation;
};

double host_activation(double v, mc::Activation a, bool slope) {
  const double sigmoid = 1.0 / (1.0 + std::exp(-v));
  if (a == mc::Activation::kSilu) return slope ? sigmoid * (1.0 + v * (1.0 - sigmoid)) : v * sigmoid;
  return slope ? sigmoid : std::log1p(std::exp(v)) - std::log(2.0);  // shifted softplus
}

TEST_CASE("launch_cfconv(_backward) match the host reference", "[cfconv]") {
  if (!have_gpu()) MIRAGE_SKIP("no CUDA device");
  // 20,000 pairs: more 64-pair tiles than an H200's blocks (two teams each) take at once.
  const CfconvCase cases[] = {{40, 700, 20, 128, mc::Activation::kShiftedSoftplus},
                              {300, 20000, 7, 64, mc::Activation::kSilu},
                              {5, 3, 1, 64, mc::Activation::kShiftedSoftplus}};
  for (const CfconvCase& k : cases) {
    INFO("N=" << k.nodes << " P=" << k.pairs << " R=" << k.rbf << " D=" << k.width);
    if (!mc::cfconv_supported(k.rbf, k.width, k.width)) MIRAGE_SKIP("cfconv's kernels do not fit this GPU");
    const int64_t N = k.nodes, P = k.pairs, R = k.rbf, D = k.width;
    std::vector<float> x = random_values(N * D), basis = random_values(P * R, 0.5f, 0.3f);
    std::vector<float> envelope = random_values(P, 0.5f, 0.2f), grad = random_values(N * D);
    std::vector<float> w1 = random_values(D * R, 0.0f, 1.0f / std::sqrt(float(R))), b1 = random_values(D);
    std::vector<float> w2 = random_values(D * D, 0.0f, 1.0f / std::sqrt(float(D))), b2 = random_values(D);
    std::vector<int64_t> pairs(2 * P);
    std::uniform_int_distribution<int64_t> node(0, N - 1);
    for (int64_t p = 0; p < P; ++p) pairs[p] = node(rng()), pairs[P + p] = node(rng());
    std::sort(pairs.begin(), pairs.begin() + P);  // receiver-sorted, as neighbor_list lists them

    // The host reference.
    std::vector<double> pre(P * D), filters(P * D), out(N * D, 0.0), grad_x(N * D, 0.0), grad_basis(P * R, 0.0),
        grad_envelope(P, 0.0);
    for (int64_t p = 0; p < P; ++p) {
      const int64_t i = pairs[p], j = pairs[P + p];
      std::vector<double> hidden(D), grad_filter(D);
      for (int64_t h = 0; h < D; ++h) {
        double z = b1[h];
        for (int64_t r = 0; r < R; ++r) z += double(w1[h * R + r]) * basis[p * R + r];
        pre[p * D + h] = z;
        hidden[h] = host_activation(z, k.activation, false);
      }
      for (int64_t m = 0; m < D; ++m) {
        double f = b2[m];
        for (int64_t h = 0; h < D; ++h) f += double(w2[m * D + h]) * hidden[h];
        filters[p * D + m] = f;
        out[i * D + m] += double(x[j * D + m]) * f * envelope[p];
        grad_x[j * D + m] += double(grad[i * D + m]) * f * envelope[p];
        grad_filter[m] = double(grad[i * D + m]) * x[j * D + m];
        grad_envelope[p] += grad_filter[m] * f;
      }
      for (int64_t h = 0; h < D; ++h) {
        double g = 0.0;
        for (int64_t m = 0; m < D; ++m) g += grad_filter[m] * envelope[p] * w2[m * D + h];
        g *= host_activation(pre[p * D + h], k.activation, true);
        for (int64_t r = 0; r < R; ++r) grad_basis[p * R + r] += g * w1[h * R + r];
      }
    }

    Device<float> dx(x), dbasis(basis), denvelope(envelope), dgrad(grad), dw1(w1), db1(b1), dw2(w2), db2(b2);
    Device<float> dout(N * D), dfilters(P * D), dgrad_x(N * D), dgrad_basis(P * R), dgrad_envelope(P);
    int64_t* dpairs = nullptr;
    int* dinvalid = nullptr;
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&dpairs), std::max<size_t>(pairs.size(), 1) * 8) == cudaSuccess);
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&dinvalid), 4) == cudaSuccess);
    REQUIRE(cudaMemcpy(dpairs, pairs.data(), pairs.size() * 8, cudaMemcpyHostToDevice) == cudaSuccess);
    const mc::CfconvWeights weights{dw1.ptr, db1.ptr, dw2.ptr, db2.ptr, k.rbf, k.width, k.activation, false};
    const mc::CfconvParams forward{weights, dx.ptr, dbasis.ptr, denvelope.ptr, dpairs, dout.ptr, dfilters.ptr,
                                   dinvalid, /*live_pairs=*/nullptr, N, P};
    REQUIRE(mc::launch_cfconv(forward, nullptr) == cudaSuccess);
    const mc::CfconvBackwardParams backward{weights, dgrad.ptr, dx.ptr, dbasis.ptr, denvelope.ptr, dpairs,
                                            dfilters.ptr, dgrad_x.ptr, dgrad_basis.ptr, dgrad_envelope.ptr,
                                            dinvalid, /*sender_order=*/nullptr, /*live_pairs=*/nullptr, N, P};
    // 20,000 pairs walk in sender order, the others in list order.
    void* workspace = nullptr;
    const size_t workspace_bytes = mc::cfconv_backward_workspace_bytes(N, P, /*given_order=*/false);
    REQUIRE((workspace_bytes > 0) == (P >= mc::kSenderOrderMinPairs));
    REQUIRE(cudaMalloc(&workspace, std::max<size_t>(workspace_bytes, 1)) == cudaSuccess);
    REQUIRE(mc::launch_cfconv_backward(backward, workspace, nullptr) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    cudaFree(workspace);
    cudaFree(dpairs);
    cudaFree(dinvalid);
    // float32 accumulation over up to ~70 pairs a node and 128-long products (3xTF32 products).
    require_close(dfilters.read(), filters, 1e-4, 1e-4);
    require_close(dout.read(), out, 1e-3, 1e-4);
    require_close(dgrad_x.read(), grad_x, 1e-3, 1e-4);
    require_close(dgrad_basis.read(), grad_basis, 1e-3, 1e-4);
    require_close(dgrad_envelope.read(), grad_envelope, 1e-3, 1e-4);
  }
}
