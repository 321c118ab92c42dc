// mirage::neighbor_list: argument checks, shape function, CPU reference and Meta kernel.
#include "neighbor_list.h"

#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "message.h"

namespace mirage::ops {

namespace {

void check_on_device_of_positions(std::string_view arg, const at::Tensor& t,
                                  const at::Tensor& positions) {
  MIRAGE_CHECK(t.device() == positions.device(), kNeighborList, ": ", arg,
               " must be on positions' device (positions on ", positions.device(), ", ", arg,
               " on ", t.device(), ")");
}

}  // namespace

NeighborListShape check_neighbor_list(const at::Tensor& positions, double cutoff,
                                      const std::optional<at::Tensor>& cell,
                                      const std::optional<at::Tensor>& pbc,
                                      const std::optional<at::Tensor>& batch, int64_t max_pairs,
                                      std::string_view method) {
  const auto dtype = positions.scalar_type();
  MIRAGE_CHECK(dtype == at::kFloat || (dtype == at::kDouble && !positions.is_cuda()), kNeighborList,
               ": positions must be float32 (float64 off the GPU), got ", dtype, " on ",
               positions.device());
  MIRAGE_CHECK(positions.dim() == 2 && positions.size(1) == 3, kNeighborList,
               ": positions must have shape [N, 3], got ", positions.sizes());
  const int64_t n = positions.size(0);
  MIRAGE_CHECK(n <= std::numeric_limits<int32_t>::max(), kNeighborList,
               ": positions must have fewer than 2^31 atoms, got ", n);
  check_cutoff(kNeighborList, cutoff);
  if (present(batch)) {
    check_on_device_of_positions("batch", *batch, positions);
    MIRAGE_CHECK(batch->scalar_type() == at::kLong, kNeighborList, ": batch must be int64, got ",
                 batch->scalar_type());
    MIRAGE_CHECK(batch->dim() == 1 && batch->size(0) == n, kNeighborList,
                 ": batch must have shape [N] = [", n, "], got ", batch->sizes());
  }
  int64_t num_molecules = 1;
  if (present(cell)) {
    check_on_device_of_positions("cell", *cell, positions);
    MIRAGE_CHECK(cell->scalar_type() == dtype, kNeighborList, ": cell must have positions' dtype (",
                 dtype, "), got ", cell->scalar_type());
    if (present(batch)) {
      MIRAGE_CHECK(cell->dim() == 3 && cell->size(1) == 3 && cell->size(2) == 3, kNeighborList,
                   ": cell must have shape [M, 3, 3] with batch (one cell per molecule), got ",
                   cell->sizes());
      num_molecules = cell->size(0);
    } else {
      MIRAGE_CHECK(cell->dim() == 2 && cell->size(0) == 3 && cell->size(1) == 3, kNeighborList,
                   ": cell must have shape [3, 3] without batch, got ", cell->sizes());
    }
  }
  if (present(pbc)) {
    MIRAGE_CHECK(present(cell), kNeighborList, ": pbc needs a cell (open boundaries need neither)");
    check_on_device_of_positions("pbc", *pbc, positions);
    MIRAGE_CHECK(pbc->scalar_type() == at::kBool, kNeighborList, ": pbc must be bool, got ",
                 pbc->scalar_type());
    const bool shared = pbc->dim() == 1 && pbc->size(0) == 3;
    const bool per_molecule = present(batch) && pbc->dim() == 2 && pbc->size(0) == num_molecules &&
                              pbc->size(1) == 3;
    MIRAGE_CHECK(shared || per_molecule, kNeighborList,
                 ": pbc must have shape [3] (or [M, 3] with batch and M cells), got ", pbc->sizes());
  }
  MIRAGE_CHECK(max_pairs >= -1, kNeighborList, ": max_pairs must be >= 0, or -1 for N * (N - 1), got ",
               max_pairs);
  MIRAGE_CHECK(method == "auto" || method == "direct" || method == "cell_list", kNeighborList,
               ": method must be \"auto\", \"direct\" or \"cell_list\", got \"", method, "\"");
  MIRAGE_CHECK(!(method == "cell_list" && present(batch)), kNeighborList,
               ": method \"cell_list\" takes one molecule; batched molecules use \"direct\" or \"auto\"");
  return {n, num_molecules, max_pairs == -1 ? n * std::max<int64_t>(n - 1, 0) : max_pairs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> empty_neighbor_list_outputs(
    const at::Tensor& positions, const NeighborListShape& shape) {
  const auto index = positions.options().dtype(at::kLong);
  return allocate_named(kNeighborList, "max_pairs", shape.max_pairs, [&] {
    return std::make_tuple(at::empty({2, shape.max_pairs}, index),
                           at::empty({shape.max_pairs, 3}, positions.options()),
                           at::empty({shape.max_pairs}, positions.options()), at::empty({1}, index));
  });
}

namespace {

struct Lattice {
  double a[3][3];       // rows: lattice vectors (identity for open boundaries)
  double normal[3][3];  // (a[k+1] x a[k+2]) / det: fractional coordinate k = dot(r, normal[k])
  double reach[3];      // cutoff * |normal[k]|: cell widths the cutoff spans along k
  bool periodic[3];
};

double dot3(const double* u, const double* v) { return u[0] * v[0] + u[1] * v[1] + u[2] * v[2]; }

// cell: 9 values or nullptr (open); pbc: 3 flags or nullptr (all periodic).
Lattice make_lattice(const double* cell, const bool* pbc, double cutoff, int64_t molecule) {
  Lattice l{};
  for (int k = 0; k < 3; ++k) {
    l.a[k][k] = l.normal[k][k] = 1.0;
    l.reach[k] = cutoff;
  }
  if (cell == nullptr) return l;
  for (int k = 0; k < 3; ++k)
    for (int c = 0; c < 3; ++c) l.a[k][c] = cell[3 * k + c];
  double cross[3][3];
  for (int k = 0; k < 3; ++k) {
    const double* u = l.a[(k + 1) % 3];
    const double* v = l.a[(k + 2) % 3];
    cross[k][0] = u[1] * v[2] - u[2] * v[1];
    cross[k][1] = u[2] * v[0] - u[0] * v[2];
    cross[k][2] = u[0] * v[1] - u[1] * v[0];
  }
  const double det = dot3(l.a[0], cross[0]);
  MIRAGE_CHECK(std::isfinite(det) && det != 0.0, kNeighborList,
               ": cell must be finite and non-singular (molecule ", molecule, " has determinant ",
               det, ")");
  for (int k = 0; k < 3; ++k) {
    for (int c = 0; c < 3; ++c) l.normal[k][c] = cross[k][c] / det;
    l.reach[k] = cutoff * std::sqrt(dot3(l.normal[k], l.normal[k]));
    l.periodic[k] = pbc == nullptr || pbc[k];
    MIRAGE_CHECK(!l.periodic[k] || l.reach[k] <= kNeighborListMaxReach, kNeighborList,
                 ": cutoff must span at most ", kNeighborListMaxReach,
                 " cell widths along a periodic axis (molecule ", molecule, ", axis ", k,
                 ": cutoff ", cutoff, " spans ", l.reach[k], ")");
  }
  return l;
}

struct Pair {
  int64_t i, j;
  double shift[3];
  double distance;
};

bool lexicographically_positive(const int64_t s[3]) {
  return s[0] > 0 || (s[0] == 0 && (s[1] > 0 || (s[1] == 0 && s[2] > 0)));
}

// The pairs found: the first `capacity` kept, all of them counted (memory bounded by the
// capacity, as the outputs are, however many pairs there are).
struct FoundPairs {
  int64_t capacity;
  std::vector<Pair> kept;
  int64_t count = 0;
  void add(const Pair& pair) {
    if (count++ < capacity) kept.push_back(pair);
  }
};

// Every pair of atoms in [first, end) and every image S of j with |r_j - r_i + S @ cell| < cutoff,
// in ascending (i, j, S). For each pair the images tried are those within reach + 1 of the one
// nearest in fractional coordinates: more than the bound |df_k + S_k| < reach_k needs.
void search_molecule(const double* r, int64_t first, int64_t end, const Lattice& lat,
                     double cutoff, bool half, FoundPairs& found) {
  for (int64_t i = first; i < end; ++i) {
    for (int64_t j = half ? i : first; j < end; ++j) {
      double delta[3];
      for (int c = 0; c < 3; ++c) delta[c] = r[3 * j + c] - r[3 * i + c];
      int64_t lo[3], hi[3];
      for (int k = 0; k < 3; ++k) {
        if (!lat.periodic[k]) {
          lo[k] = hi[k] = 0;
          continue;
        }
        const auto nearest = static_cast<int64_t>(-std::round(dot3(delta, lat.normal[k])));
        const auto span = static_cast<int64_t>(std::floor(lat.reach[k])) + 1;
        lo[k] = nearest - span;
        hi[k] = nearest + span;
      }
      int64_t s[3];
      for (s[0] = lo[0]; s[0] <= hi[0]; ++s[0])
        for (s[1] = lo[1]; s[1] <= hi[1]; ++s[1])
          for (s[2] = lo[2]; s[2] <= hi[2]; ++s[2]) {
            if (i == j && s[0] == 0 && s[1] == 0 && s[2] == 0) continue;
            if (i == j && half && !lexicographically_positive(s)) continue;
            Pair pair{i, j, {0, 0, 0}, 0};
            for (int c = 0; c < 3; ++c)
              pair.shift[c] = s[0] * lat.a[0][c] + s[1] * lat.a[1][c] + s[2] * lat.a[2][c];
            double v[3];
            for (int c = 0; c < 3; ++c) v[c] = delta[c] + pair.shift[c];
            pair.distance = std::sqrt(dot3(v, v));
            if (pair.distance < cutoff) found.add(pair);
          }
    }
  }
}

// The reference: float64, every pair of each molecule against every candidate image. Plain on
// purpose (O(N^2) per molecule); it reads the values, so it raises where the CUDA kernel can only
// flag (graph-safe): non-finite positions, a singular cell, an unsorted batch.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> neighbor_list_cpu(
    const at::Tensor& positions, double cutoff, const std::optional<at::Tensor>& cell,
    const std::optional<at::Tensor>& pbc, const std::optional<at::Tensor>& batch,
    int64_t max_pairs, bool half, c10::string_view method) {
  const NeighborListShape shape =
      check_neighbor_list(positions, cutoff, cell, pbc, batch, max_pairs, method);
  const int64_t n = shape.num_atoms;
  const at::Tensor r64 = positions.to(at::kDouble).contiguous();
  const double* r = r64.const_data_ptr<double>();
  for (int64_t i = 0; i < n; ++i)
    MIRAGE_CHECK(std::isfinite(r[3 * i]) && std::isfinite(r[3 * i + 1]) && std::isfinite(r[3 * i + 2]),
                 kNeighborList, ": positions must be finite (atom ", i, " is not)");
  const at::Tensor cell64 = present(cell) ? cell->to(at::kDouble).contiguous() : at::Tensor();
  const at::Tensor pbc_c = present(pbc) ? pbc->contiguous() : at::Tensor();
  const at::Tensor batch_c = present(batch) ? batch->contiguous() : at::Tensor();
  const int64_t* b = present(batch) ? batch_c.const_data_ptr<int64_t>() : nullptr;
  const int64_t pbc_stride = present(pbc) && pbc_c.dim() == 2 ? 3 : 0;

  const int64_t capacity = shape.max_pairs;
  FoundPairs found{capacity};
  for (int64_t first = 0; first < n;) {
    int64_t end = first + 1;
    int64_t molecule = 0;
    if (b == nullptr) {
      end = n;
    } else {
      while (end < n && b[end] == b[first]) ++end;
      MIRAGE_CHECK(end == n || b[end] > b[first], kNeighborList, ": batch must be sorted (batch[",
                   end - 1, "] = ", b[end - 1], " > batch[", end, "] = ", b[end], ")");
      molecule = b[first];
      MIRAGE_CHECK(!present(cell) || (molecule >= 0 && molecule < shape.num_molecules), kNeighborList,
                   ": batch must index the rows of cell, in [0, ", shape.num_molecules, "), got ",
                   molecule, " at atom ", first);
    }
    const Lattice lat = make_lattice(
        present(cell) ? cell64.const_data_ptr<double>() + 9 * molecule : nullptr,
        present(pbc) ? pbc_c.const_data_ptr<bool>() + pbc_stride * molecule : nullptr, cutoff, molecule);
    for (int64_t i = first; i < end; ++i)
      for (int k = 0; k < 3; ++k)
        MIRAGE_CHECK(!lat.periodic[k] || std::abs(dot3(r + 3 * i, lat.normal[k])) < kNeighborListMaxCellWidths,
                     kNeighborList, ": positions must lie within 2^24 cell widths of the origin along "
                     "a periodic axis (atom ", i, ", axis ", k, ")");
    search_molecule(r, first, end, lat, cutoff, half, found);
    first = end;
  }

  auto [pairs, shifts64, distances64] = allocate_named(kNeighborList, "max_pairs", capacity, [&] {
    return std::make_tuple(at::zeros({2, capacity}, positions.options().dtype(at::kLong)),
                           at::zeros({capacity, 3}, r64.options()), at::full({capacity}, cutoff, r64.options()));
  });
  shifts64.select(1, 0).fill_(cutoff);  // padding: r_j - r_i + shift = (cutoff, 0, 0)
  int64_t* ps = pairs.mutable_data_ptr<int64_t>();
  double* ss = shifts64.mutable_data_ptr<double>();
  double* ds = distances64.mutable_data_ptr<double>();
  for (int64_t e = 0; e < static_cast<int64_t>(found.kept.size()); ++e) {
    ps[e] = found.kept[e].i;
    ps[capacity + e] = found.kept[e].j;
    for (int c = 0; c < 3; ++c) ss[3 * e + c] = found.kept[e].shift[c];
    ds[e] = found.kept[e].distance;
  }
  const at::Tensor num_pairs = at::full({1}, found.count, positions.options().dtype(at::kLong));
  return {pairs, shifts64.to(positions.scalar_type()), distances64.to(positions.scalar_type()),
          num_pairs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> neighbor_list_meta(
    const at::Tensor& positions, double cutoff, const std::optional<at::Tensor>& cell,
    const std::optional<at::Tensor>& pbc, const std::optional<at::Tensor>& batch,
    int64_t max_pairs, bool /*half*/, c10::string_view method) {
  return empty_neighbor_list_outputs(
      positions, check_neighbor_list(positions, cutoff, cell, pbc, batch, max_pairs, method));
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) { m.impl("neighbor_list", &neighbor_list_cpu); }
TORCH_LIBRARY_IMPL(mirage, Meta, m) { m.impl("neighbor_list", &neighbor_list_meta); }

}  // namespace mirage::ops
