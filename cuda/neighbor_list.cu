// Neighbor lists on the GPU, graph-safe: buffers sized from the shapes, no host synchronization.
//
// Every search runs the same steps:
//   prepare (per atom: validity, its molecule's atom range, its position wrapped into the cell)
//   -> count (pairs per center atom i) -> inclusive scan (offsets; the last one is the true count)
//   -> write (each atom's pairs from its offset; those past the capacity are dropped)
//   -> finish (padding, num_pairs; on invalid input NaN everywhere and num_pairs = -1).
// Counting before writing makes the order deterministic (grouped by i, ascending) and the count
// exact whatever the capacity; it costs a second pass over the candidates.
//
// Geometry: positions r are row vectors, the cell's rows are the lattice vectors a_k, and the
// fractional coordinate f_k = dot(r, n_k) with n_k = (a_{k+1} x a_{k+2}) / det. 1 / |n_k| is the
// spacing of the lattice planes along k, and |dr| >= |df_k| / |n_k|: a neighbor within the cutoff
// differs by less than reach_k = cutoff * |n_k| in f_k. Both searches rest on that bound.
//
// Two searches:
//  - direct: one warp per center atom scans the atoms of its molecule 32 at a time and, on a
//    periodic axis, only the images S_k whose slab can come within the cutoff (usually one or two).
//    Consecutive warps read the same neighbor positions, which L1 serves: no shared-memory tiles.
//    Up to kOneBlockMaxAtoms atoms every step runs in one block, in one launch.
//  - cell list (one molecule of many atoms): atoms are binned in fractional coordinates into bins
//    at least one cutoff thick (coarser when there would be more bins than atoms), sorted by bin
//    with a stable radix sort, and each atom (one warp, in bin order) scans the bins around its
//    own, periodic images included (more than one image per bin when the box is thinner than
//    the cutoff), their atoms laid end to end across the lanes. This handles a cutoff beyond
//    half the box, or beyond the box, exactly.
#include <algorithm>
#include <cmath>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "kernel_utils.cuh"
#include "neighbor_list.cuh"

namespace mirage::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kSetupThreads = 1024;
// The direct search runs in one block up to this many atoms and pairs of capacity (see
// one_block_direct_kernel; the block also writes the padding, one slot a thread at a time).
constexpr int kOneBlockMaxAtoms = 128;
constexpr int64_t kOneBlockMaxPairs = 65536;
constexpr int kOneBlockThreads = 512;
// kAuto uses the cell list from this many atoms (one molecule). Measured on an H200 (2026-11-23,
// benchmarks/bench_neighbor_list.py: water boxes at a 5 A cutoff, in a CUDA graph, µs direct /
// cell list): 648 atoms 56 / 62, 1,536 atoms 99 / 53, 3,000 atoms 181 / 60, 8,232 atoms 1,073 /
// 113, 24,000 atoms 8,027 / 217. The cell list's fixed cost (sorting, setup: ~50 µs) loses to the
// direct search's N^2 only near 1,000 atoms.
constexpr int64_t kCellListMinAtoms = 1024;
// Positions may lie at most this many cell widths from the origin along a periodic axis: image
// indices are kept in float32, exact up to 2^24 (the CPU reference has the same limit).
constexpr float kMaxCellWidthsFromOrigin = 16777216.0f;
// Slack, in cell widths, on a pair's image range: the range only bounds, the distance test decides.
constexpr float kImageMargin = 1e-4f;

// Image indices never exceed this for valid input (reach <= max_reach, |df| <= 1, plus margin).
__device__ __forceinline__ float image_limit(const NeighborListParams& p) { return p.max_reach + 2.0f; }

struct Lattice {
  float a[3][3];       // rows: lattice vectors (identity for open boundaries)
  float normal[3][3];  // n_k = (a[k+1] x a[k+2]) / det: fractional coordinate f_k = dot(r, n_k)
  float reach[3];      // cutoff * |n_k|: how many cell widths the cutoff spans along k
  bool periodic[3];
  bool valid;          // finite, non-singular, reach <= max_reach on periodic axes
};

// One atom as the searches see it.
struct AtomFrame {
  float r[3];      // position moved into the cell along periodic axes
  float f[3];      // its fractional coordinates (in [0, 1] along periodic axes)
  float wrap[3];   // whole cells taken off: r = positions[i] - wrap @ cell
  int first, end;  // the atoms of its molecule: [first, end)
};

struct CellGrid {
  int bins[3];      // bins along each axis
  int reach[3];     // neighbor bins searched on each side of an atom's bin
  float origin[3];  // fractional coordinate where bin 0 starts
  float scale[3];   // bins per unit of fractional coordinate
};

// A pair found: the Cartesian shift of j's image relative to the original positions, and the distance.
struct Hit {
  float shift[3];
  float distance;
};

__device__ __forceinline__ float dot3(const float u[3], const float v[3]) {
  return u[0] * v[0] + u[1] * v[1] + u[2] * v[2];
}

__device__ __forceinline__ int64_t molecule_of(const NeighborListParams& p, int64_t i) {
  if (p.batch == nullptr) return 0;
  // Clamped so that invalid input (flagged by prepare_atoms_kernel) never reads outside cell/pbc.
  const int64_t b = p.batch[i];
  return b < 0 ? 0 : (b >= p.num_molecules ? p.num_molecules - 1 : b);
}

__device__ __forceinline__ Lattice load_lattice(const NeighborListParams& p, int64_t molecule) {
  Lattice l;
  for (int k = 0; k < 3; ++k) {
    for (int c = 0; c < 3; ++c) l.a[k][c] = l.normal[k][c] = k == c ? 1.0f : 0.0f;
    l.reach[k] = p.cutoff;
    l.periodic[k] = false;
  }
  l.valid = true;
  if (p.cell == nullptr) return l;
  const float* cell = p.cell + molecule * 9;
  for (int k = 0; k < 3; ++k)
    for (int c = 0; c < 3; ++c) l.a[k][c] = cell[3 * k + c];
  float cross[3][3];
  for (int k = 0; k < 3; ++k) {
    const float* u = l.a[(k + 1) % 3];
    const float* v = l.a[(k + 2) % 3];
    cross[k][0] = u[1] * v[2] - u[2] * v[1];
    cross[k][1] = u[2] * v[0] - u[0] * v[2];
    cross[k][2] = u[0] * v[1] - u[1] * v[0];
  }
  const float det = dot3(l.a[0], cross[0]);
  l.valid = det != 0.0f && isfinite(det);
  for (int k = 0; k < 3; ++k) {
    for (int c = 0; c < 3; ++c) l.normal[k][c] = cross[k][c] / det;
    l.reach[k] = p.cutoff * sqrtf(dot3(l.normal[k], l.normal[k]));
    l.periodic[k] = p.pbc == nullptr || p.pbc[molecule * p.pbc_stride + k];
    if (l.periodic[k] && !(l.reach[k] <= p.max_reach)) l.valid = false;
  }
  return l;
}

// First index in sorted[0, n) whose value is not below `value` (n when none).
template <typename T>
__device__ int64_t lower_bound(const T* sorted, int64_t n, T value) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (sorted[mid] < value) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Atom i: validity (finite position, a valid cell, batch sorted and naming a cell), the range of
// its molecule, and its position wrapped into the cell along periodic axes.
__device__ void prepare_atom(const NeighborListParams& p, int64_t i, AtomFrame* frames, int* invalid) {
  bool ok = true;
  AtomFrame atom;
  atom.first = 0;
  atom.end = static_cast<int>(p.num_atoms);
  if (p.batch != nullptr) {
    const int64_t b = p.batch[i];
    if (i + 1 < p.num_atoms && p.batch[i + 1] < b) ok = false;
    if (p.cell != nullptr && (b < 0 || b >= p.num_molecules)) ok = false;
    // On unsorted input these are garbage but inside [0, N]; the output is poisoned anyway.
    atom.first = static_cast<int>(lower_bound(p.batch, p.num_atoms, b));
    atom.end = b == INT64_MAX ? atom.end : static_cast<int>(lower_bound(p.batch, p.num_atoms, b + 1));
  }
  const Lattice lat = load_lattice(p, molecule_of(p, i));
  ok = ok && lat.valid;
  float r[3];
  for (int c = 0; c < 3; ++c) {
    r[c] = p.positions[3 * i + c];
    ok = ok && isfinite(r[c]);
  }
  for (int k = 0; k < 3; ++k) {
    const float f = dot3(r, lat.normal[k]);
    if (lat.periodic[k] && !(fabsf(f) < kMaxCellWidthsFromOrigin)) ok = false;
    atom.wrap[k] = lat.periodic[k] ? floorf(f) : 0.0f;
    atom.f[k] = f - atom.wrap[k];
  }
  for (int c = 0; c < 3; ++c)
    atom.r[c] = r[c] - (atom.wrap[0] * lat.a[0][c] + atom.wrap[1] * lat.a[1][c] + atom.wrap[2] * lat.a[2][c]);
  frames[i] = atom;
  if (!ok) *invalid = 1;  // every writer stores the same value
}

__global__ void __launch_bounds__(kThreads) prepare_atoms_kernel(NeighborListParams p,
                                                                  AtomFrame* frames,  // [N]
                                                                  int* invalid) {     // [1]
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < p.num_atoms) prepare_atom(p, i, frames, invalid);
}

__device__ __forceinline__ bool lexicographically_positive(const float s[3]) {
  return s[0] > 0.0f || (s[0] == 0.0f && (s[1] > 0.0f || (s[1] == 0.0f && s[2] > 0.0f)));
}

// Tests j's image S (in the wrapped frame) against i. The caller has already dropped j < i for
// half lists; here the self pair goes, and for half lists one of (i, i, S) and (i, i, -S).
__device__ __forceinline__ bool test_pair(const NeighborListParams& p, const Lattice& lat,
                                          const AtomFrame& ai, const AtomFrame& aj, int64_t i,
                                          int64_t j, const float s[3], Hit& hit) {
  if (i == j) {
    if (s[0] == 0.0f && s[1] == 0.0f && s[2] == 0.0f) return false;
    if (p.half && !lexicographically_positive(s)) return false;
  }
  float v[3];
  for (int c = 0; c < 3; ++c)
    v[c] = aj.r[c] - ai.r[c] + s[0] * lat.a[0][c] + s[1] * lat.a[1][c] + s[2] * lat.a[2][c];
  const float d = sqrtf(dot3(v, v));
  if (!(d < p.cutoff)) return false;
  // r_j^w - r_i^w + S @ cell = r_j - r_i + (S + wrap_i - wrap_j) @ cell: the image of the outputs.
  float image[3];
  for (int k = 0; k < 3; ++k) image[k] = s[k] + ai.wrap[k] - aj.wrap[k];
  for (int c = 0; c < 3; ++c)
    hit.shift[c] = image[0] * lat.a[0][c] + image[1] * lat.a[1][c] + image[2] * lat.a[2][c];
  hit.distance = d;
  return true;
}

__device__ __forceinline__ void write_pair(const NeighborListParams& p, int64_t slot, int64_t i,
                                           int64_t j, const Hit& hit) {
  if (slot >= p.max_pairs) return;  // overflow: counted, not stored
  p.pairs[slot] = i;
  p.pairs[p.max_pairs + slot] = j;
  for (int c = 0; c < 3; ++c) p.shifts[3 * slot + c] = hit.shift[c];
  p.distances[slot] = hit.distance;
}

// ---- direct search ----------------------------------------------------------------------------

// The images S_k of axis k that can hold j within the cutoff of i, given df = f_j - f_i:
// |df + S_k| < reach_k. Empty (lo > hi) for non-finite input.
__device__ __forceinline__ void image_range(const Lattice& lat, int k, float df, float limit,
                                            int& lo, int& hi) {
  if (!lat.periodic[k]) {
    lo = hi = 0;
    return;
  }
  const float low = ceilf(-lat.reach[k] - df - kImageMargin);
  const float high = floorf(lat.reach[k] - df + kImageMargin);
  if (!(low <= high)) {
    lo = 1;
    hi = 0;
    return;
  }
  lo = static_cast<int>(fmaxf(low, -limit));
  hi = static_cast<int>(fminf(high, limit));
}

// visit(hit) for each image of j within the cutoff of i, in ascending (S_0, S_1, S_2).
template <typename Visit>
__device__ __forceinline__ void for_each_direct_image(const NeighborListParams& p,
                                                      const Lattice& lat, const AtomFrame& ai,
                                                      const AtomFrame& aj, int64_t i, int64_t j,
                                                      Visit&& visit) {
  if (p.half && j < i) return;
  int lo[3], hi[3];
  for (int k = 0; k < 3; ++k) image_range(lat, k, aj.f[k] - ai.f[k], image_limit(p), lo[k], hi[k]);
  for (int s0 = lo[0]; s0 <= hi[0]; ++s0)
    for (int s1 = lo[1]; s1 <= hi[1]; ++s1)
      for (int s2 = lo[2]; s2 <= hi[2]; ++s2) {
        const float s[3] = {static_cast<float>(s0), static_cast<float>(s1), static_cast<float>(s2)};
        Hit hit;
        if (test_pair(p, lat, ai, aj, i, j, s, hit)) visit(hit);
      }
}

__device__ __forceinline__ int64_t warp_sum(int64_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ int64_t warp_inclusive_sum(int64_t v) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int64_t below = __shfl_up_sync(0xffffffffu, v, offset);
    if (lane >= offset) v += below;
  }
  return v;
}

// The pairs of center atom i, counted by one warp (every lane returns the count).
__device__ int64_t direct_count(const NeighborListParams& p, const AtomFrame* frames, int64_t i) {
  const int lane = threadIdx.x % 32;
  const Lattice lat = load_lattice(p, molecule_of(p, i));
  const AtomFrame ai = frames[i];
  int64_t count = 0;
  if (lat.valid) {
    for (int64_t j = ai.first + lane; j < ai.end; j += 32)
      for_each_direct_image(p, lat, ai, frames[j], i, j, [&](const Hit&) { ++count; });
  }
  return warp_sum(count);
}

// One warp per center atom i: counts[i] = its pairs.
__global__ void __launch_bounds__(kThreads) direct_count_kernel(NeighborListParams p,
                                                                 const AtomFrame* frames,  // [N]
                                                                 int64_t* counts) {         // [N]
  const int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  if (i >= p.num_atoms) return;  // warp-uniform
  const int64_t count = direct_count(p, frames, i);
  if (threadIdx.x % 32 == 0) counts[i] = count;
}

// The pairs of center atom i from slot `next` on, in ascending j, then image, written by one warp.
// Each round of 32 neighbors counts first, so that a warp scan places every lane's pairs.
__device__ void direct_write(const NeighborListParams& p, const AtomFrame* frames, int64_t i, int64_t next) {
  const int lane = threadIdx.x % 32;
  const Lattice lat = load_lattice(p, molecule_of(p, i));
  if (!lat.valid) return;
  const AtomFrame ai = frames[i];
  for (int64_t start = ai.first; start < ai.end; start += 32) {  // warp-uniform
    const int64_t j = start + lane;
    const bool has = j < ai.end;
    AtomFrame aj;
    int64_t mine = 0;
    if (has) {
      aj = frames[j];
      for_each_direct_image(p, lat, ai, aj, i, j, [&](const Hit&) { ++mine; });
    }
    const int64_t inclusive = warp_inclusive_sum(mine);
    int64_t slot = next + inclusive - mine;
    if (mine > 0)
      for_each_direct_image(p, lat, ai, aj, i, j, [&](const Hit& hit) { write_pair(p, slot++, i, j, hit); });
    next += __shfl_sync(0xffffffffu, inclusive, 31);
  }
}

// One warp per center atom i: its pairs from offsets[i].
__global__ void __launch_bounds__(kThreads) direct_write_kernel(NeighborListParams p,
                                                                 const AtomFrame* frames,  // [N]
                                                                 const int64_t* offsets) { // [N + 1]
  const int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  if (i < p.num_atoms) direct_write(p, frames, i, offsets[i]);  // warp-uniform
}

// ---- cell list --------------------------------------------------------------------------------

// One block: the atoms' extent along open axes, then the bins (at least one cutoff thick, at
// most max_bins in all) and how many neighbor bins each side can hold a neighbor.
__global__ void __launch_bounds__(kSetupThreads) grid_setup_kernel(NeighborListParams p,
                                                                    const AtomFrame* frames,  // [N]
                                                                    int64_t max_bins,
                                                                    CellGrid* grid) {         // [1]
  __shared__ float warp_lo[32][3], warp_hi[32][3];
  float lo[3] = {INFINITY, INFINITY, INFINITY}, hi[3] = {-INFINITY, -INFINITY, -INFINITY};
  for (int64_t i = threadIdx.x; i < p.num_atoms; i += blockDim.x)
    for (int k = 0; k < 3; ++k) {
      lo[k] = fminf(lo[k], frames[i].f[k]);
      hi[k] = fmaxf(hi[k], frames[i].f[k]);
    }
  for (int k = 0; k < 3; ++k)
    for (int offset = 16; offset > 0; offset >>= 1) {
      lo[k] = fminf(lo[k], __shfl_xor_sync(0xffffffffu, lo[k], offset));
      hi[k] = fmaxf(hi[k], __shfl_xor_sync(0xffffffffu, hi[k], offset));
    }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0)
    for (int k = 0; k < 3; ++k) {
      warp_lo[warp][k] = lo[k];
      warp_hi[warp][k] = hi[k];
    }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w)
    for (int k = 0; k < 3; ++k) {
      lo[k] = fminf(lo[k], warp_lo[w][k]);
      hi[k] = fmaxf(hi[k], warp_hi[w][k]);
    }
  const Lattice lat = load_lattice(p, 0);
  CellGrid g;
  float span[3];  // in fractional units
  for (int k = 0; k < 3; ++k) {
    span[k] = lat.periodic[k] ? 1.0f : hi[k] - lo[k];
    g.origin[k] = lat.periodic[k] ? 0.0f : lo[k];
    // span / reach cutoffs fit across the atoms (the cell) along k.
    const float fit = floorf(span[k] / lat.reach[k]);
    g.bins[k] = fit >= 1.0f ? static_cast<int>(fminf(fit, static_cast<float>(max_bins))) : 1;
  }
  while (static_cast<int64_t>(g.bins[0]) * g.bins[1] * g.bins[2] > max_bins) {
    const int k = g.bins[0] >= g.bins[1] && g.bins[0] >= g.bins[2] ? 0 : (g.bins[1] >= g.bins[2] ? 1 : 2);
    g.bins[k] = (g.bins[k] + 1) / 2;
  }
  for (int k = 0; k < 3; ++k) {
    const bool flat = !(span[k] > 0.0f);  // all atoms in one plane (or invalid input)
    g.scale[k] = flat ? 0.0f : g.bins[k] / span[k];
    // A bin is span / bins wide in f; the cutoff spans reach / that many bins. The +1 covers
    // both the partial bin and atoms placed one bin off by rounding at a bin edge.
    const float r = flat ? 0.0f : floorf(lat.reach[k] * g.scale[k]) + 1.0f;
    if (lat.periodic[k]) {
      // Past the limit the lattice is invalid and the output poisoned: search nothing.
      g.reach[k] = r >= 0.0f && r <= image_limit(p) ? static_cast<int>(r) : 0;
    } else {
      // An open axis has only its bins: bins - 1 on either side reach them all.
      g.reach[k] = r >= 0.0f ? static_cast<int>(fminf(r, static_cast<float>(g.bins[k] - 1))) : 0;
    }
  }
  *grid = g;
}

__device__ __forceinline__ int bin_on_axis(const CellGrid& g, int k, float f) {
  const float x = (f - g.origin[k]) * g.scale[k];
  if (!(x > 0.0f)) return 0;                 // NaN lands here too
  if (x >= g.bins[k]) return g.bins[k] - 1;  // the far edge, reached by rounding
  return static_cast<int>(x);
}

__global__ void __launch_bounds__(kThreads) assign_bins_kernel(const AtomFrame* frames,  // [N]
                                                                const CellGrid* grid,     // [1]
                                                                int64_t n,
                                                                int* keys,                // [N]
                                                                int* atoms) {             // [N]
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const CellGrid g = *grid;
  const AtomFrame a = frames[i];
  keys[i] = (bin_on_axis(g, 0, a.f[0]) * g.bins[1] + bin_on_axis(g, 1, a.f[1])) * g.bins[2] +
            bin_on_axis(g, 2, a.f[2]);
  atoms[i] = static_cast<int>(i);
}

// bin_start[b]: the first sorted position of bin b (N past the last atom).
__global__ void __launch_bounds__(kThreads) bin_starts_kernel(const int* sorted_keys,  // [N]
                                                               int64_t n,
                                                               int* bin_start,          // [bins + 1]
                                                               int64_t bins_plus_one) {
  const int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (b < bins_plus_one) bin_start[b] = static_cast<int>(lower_bound(sorted_keys, n, static_cast<int>(b)));
}

// Global bin index `gb` along axis k of the unbounded periodic tiling: the bin in the cell and
// its image. False along an open axis past the atoms' extent.
__device__ __forceinline__ bool neighbor_bin(const Lattice& lat, const CellGrid& g, int k, int gb,
                                             int& bin, int& image) {
  const int n = g.bins[k];
  if (!lat.periodic[k]) {
    bin = gb;
    image = 0;
    return gb >= 0 && gb < n;
  }
  image = gb >= 0 ? gb / n : -((-gb + n - 1) / n);
  bin = gb - image * n;
  return true;
}

// Bin number b of the box of bins around `center` ((2 reach_0 + 1)(2 reach_1 + 1)(2 reach_2 + 1)
// of them, in ascending (d0, d1, d2)): its key and the image it stands for, or false when it
// falls off an open axis.
__device__ __forceinline__ bool nth_neighbor_bin(const Lattice& lat, const CellGrid& g, const int center[3],
                                                 int b, int& key, float s[3]) {
  const int w1 = 2 * g.reach[1] + 1, w2 = 2 * g.reach[2] + 1;
  const int d[3] = {b / (w1 * w2) - g.reach[0], (b / w2) % w1 - g.reach[1], b % w2 - g.reach[2]};
  int bin[3];
  for (int k = 0; k < 3; ++k) {
    int image;
    if (!neighbor_bin(lat, g, k, center[k] + d[k], bin[k], image)) return false;
    s[k] = static_cast<float>(image);
  }
  key = (bin[0] * g.bins[1] + bin[1]) * g.bins[2] + bin[2];
  return true;
}

// One warp per center atom i: the candidates (the atoms of the bins around i's bin, bin by bin
// in the order of nth_neighbor_bin, atoms in bin order) laid end to end and taken 32 at a time,
// so that lanes stay busy although a bin holds only a dozen atoms or so. round(found, hit, j)
// is called by every lane for each round (found false for lanes past the end).
template <typename Round>
__device__ void for_each_cell_list_round(const NeighborListParams& p, const Lattice& lat, const CellGrid& g,
                                         const AtomFrame* frames, const int* bin_start,
                                         const int* sorted_atoms, int64_t i, const AtomFrame& ai,
                                         Round&& round) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x % 32;
  int center[3];
  for (int k = 0; k < 3; ++k) center[k] = bin_on_axis(g, k, ai.f[k]);
  const int bins = (2 * g.reach[0] + 1) * (2 * g.reach[1] + 1) * (2 * g.reach[2] + 1);
  for (int group = 0; group < bins; group += 32) {  // warp-uniform
    // Lane l holds bin group + l: its first sorted position, its size, its image.
    int start = 0, size = 0, key = 0;
    float s[3] = {0.0f, 0.0f, 0.0f};
    if (group + lane < bins && nth_neighbor_bin(lat, g, center, group + lane, key, s)) {
      start = bin_start[key];
      size = bin_start[key + 1] - start;
    }
    const int inclusive = static_cast<int>(warp_inclusive_sum(static_cast<int64_t>(size)));
    const int before = inclusive - size, total = __shfl_sync(kAll, inclusive, 31);
    for (int first = 0; first < total; first += 32) {  // warp-uniform
      const int u = first + lane;
      // The lane whose bin holds candidate u: the last one with `before` <= u (they ascend).
      int owner = 0;
      for (int step = 16; step > 0; step >>= 1) {
        if (__shfl_sync(kAll, before, owner + step) <= u) owner += step;
      }
      const int t = __shfl_sync(kAll, start, owner) + u - __shfl_sync(kAll, before, owner);
      float image[3];
      for (int k = 0; k < 3; ++k) image[k] = __shfl_sync(kAll, s[k], owner);
      int64_t j = -1;
      Hit hit;
      bool found = false;
      if (u < total) {
        j = sorted_atoms[t];
        found = !(p.half && j < i) && test_pair(p, lat, ai, frames[j], i, j, image, hit);
      }
      round(found, hit, j);
    }
  }
}

// One warp per atom, the atoms taken in bin order so that neighboring warps share their bins.
__global__ void __launch_bounds__(kThreads) cell_list_count_kernel(
    NeighborListParams p, const AtomFrame* frames,  // [N]
    const CellGrid* grid, const int* bin_start,     // [1], [bins + 1]
    const int* sorted_atoms,                        // [N]
    int64_t* counts) {                              // [N]
  const int64_t t = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  if (t >= p.num_atoms) return;  // warp-uniform
  const int64_t i = sorted_atoms[t];
  const Lattice lat = load_lattice(p, 0);
  const CellGrid g = *grid;
  int64_t count = 0;
  if (lat.valid)
    for_each_cell_list_round(p, lat, g, frames, bin_start, sorted_atoms, i, frames[i],
                             [&](bool found, const Hit&, int64_t) { count += found; });
  count = warp_sum(count);
  if (threadIdx.x % 32 == 0) counts[i] = count;
}

// The same walk; each round's hits go to consecutive slots from offsets[i] (a warp scan).
__global__ void __launch_bounds__(kThreads) cell_list_write_kernel(
    NeighborListParams p, const AtomFrame* frames,  // [N]
    const CellGrid* grid, const int* bin_start,     // [1], [bins + 1]
    const int* sorted_atoms,                        // [N]
    const int64_t* offsets) {                       // [N + 1]
  const int64_t t = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  if (t >= p.num_atoms) return;  // warp-uniform
  const int64_t i = sorted_atoms[t];
  const Lattice lat = load_lattice(p, 0);
  if (!lat.valid) return;  // warp-uniform
  const CellGrid g = *grid;
  int64_t next = offsets[i];
  for_each_cell_list_round(p, lat, g, frames, bin_start, sorted_atoms, i, frames[i],
                           [&](bool found, const Hit& hit, int64_t j) {
                             const int64_t inclusive = warp_inclusive_sum(static_cast<int64_t>(found));
                             if (found) write_pair(p, next + inclusive - 1, i, j, hit);
                             next += __shfl_sync(0xffffffffu, inclusive, 31);
                           });
}

// ---- finish -----------------------------------------------------------------------------------

// Padding after the pairs: (0, 0), shift (cutoff, 0, 0), distance cutoff, so that r_j - r_i +
// shift has length cutoff and every cutoff function gives zero. Invalid input: NaN shifts and
// distances everywhere and num_pairs = -1, so that energies turn NaN rather than silently finite.
// Thread `first` of `threads` takes slots first, first + threads, ...
__device__ void finish_pairs(const NeighborListParams& p, int64_t count, bool bad, int64_t first, int64_t threads) {
  const float nan = __int_as_float(0x7fc00000);
  for (int64_t e = first; e < p.max_pairs; e += threads) {
    if (!bad && e < count) continue;
    p.pairs[e] = 0;
    p.pairs[p.max_pairs + e] = 0;
    p.shifts[3 * e] = bad ? nan : p.cutoff;
    p.shifts[3 * e + 1] = bad ? nan : 0.0f;
    p.shifts[3 * e + 2] = bad ? nan : 0.0f;
    p.distances[e] = bad ? nan : p.cutoff;
  }
  if (first == 0) *p.num_pairs = bad ? -1 : count;
}

__global__ void __launch_bounds__(kThreads) finish_kernel(NeighborListParams p,
                                                           const int64_t* total,  // [1]
                                                           const int* invalid) {  // [1]
  finish_pairs(p, *total, *invalid != 0, blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x,
               static_cast<int64_t>(gridDim.x) * blockDim.x);
}

// ---- one block --------------------------------------------------------------------------------

// The direct search of a small system in one block, every step above with its buffers in shared
// memory: one launch instead of two memsets and six kernels, each of which costs a CUDA graph
// 1-2 us however little it does (benzene's whole neighbor list was ~9 us on an H200). Launched
// overlapped: in an MD step it follows the kernel that moved the positions.
__global__ void __launch_bounds__(kOneBlockThreads) one_block_direct_kernel(NeighborListParams p) {
  start_after_prior_grid();
  __shared__ AtomFrame frames[kOneBlockMaxAtoms];
  __shared__ int64_t offsets[kOneBlockMaxAtoms + 1];  // offsets[i + 1]: atom i's count, then scanned
  __shared__ int invalid;
  const int n = static_cast<int>(p.num_atoms), warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int lane = threadIdx.x % 32;
  if (threadIdx.x == 0) invalid = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) prepare_atom(p, i, frames, &invalid);
  __syncthreads();
  for (int i = warp; i < n; i += warps) {
    const int64_t count = direct_count(p, frames, i);
    if (lane == 0) offsets[i + 1] = count;
  }
  __syncthreads();
  if (warp == 0) {  // inclusive scan of offsets[1 .. n], a lane kOneBlockMaxAtoms / 32 counts
    constexpr int kPerLane = kOneBlockMaxAtoms / 32;
    int64_t local[kPerLane], sum = 0;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      const int i = lane * kPerLane + c;
      sum += i < n ? offsets[i + 1] : 0;
      local[c] = sum;
    }
    const int64_t below = warp_inclusive_sum(sum) - sum;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      const int i = lane * kPerLane + c;
      if (i < n) offsets[i + 1] = below + local[c];
    }
    if (lane == 0) offsets[0] = 0;
  }
  __syncthreads();
  for (int i = warp; i < n; i += warps) direct_write(p, frames, i, offsets[i]);
  __syncthreads();  // on invalid input the padding overwrites every slot
  finish_pairs(p, offsets[n], invalid != 0, threadIdx.x, blockDim.x);
}

// ---- workspace --------------------------------------------------------------------------------

struct Workspace {
  int* invalid;                  // [1]
  AtomFrame* frames;             // [N]
  int64_t* counts;               // [N]
  int64_t* offsets;              // [N + 1]
  void* scan_temp;
  size_t scan_bytes;
  // cell list only
  int64_t max_bins;
  int key_bits;
  CellGrid* grid;                // [1]
  int *keys, *sorted_keys;       // [N]
  int *atoms, *sorted_atoms;     // [N]
  int* bin_start;                // [max_bins + 1]
  void* sort_temp;
  size_t sort_bytes;
  size_t total_bytes;
};

// Carves `base` into the buffers these params need; with base == nullptr it only sizes them.
Workspace plan_workspace(const NeighborListParams& p, char* base) {
  Workspace w{};
  WorkspaceLayout layout(base);
  const int n = static_cast<int>(p.num_atoms);  // checked < 2^31 by the caller
  w.invalid = static_cast<int*>(layout.take(sizeof(int)));
  w.frames = static_cast<AtomFrame*>(layout.take(n * sizeof(AtomFrame)));
  w.counts = static_cast<int64_t*>(layout.take(n * sizeof(int64_t)));
  w.offsets = static_cast<int64_t*>(layout.take((n + 1) * sizeof(int64_t)));
  cub::DeviceScan::InclusiveSum(nullptr, w.scan_bytes, w.counts, w.offsets, n);
  w.scan_temp = layout.take(w.scan_bytes);
  if (resolve_neighbor_search(p) == NeighborSearch::kCellList) {
    // No more bins than atoms: a dilute or spread-out system gets coarser bins, not more memory.
    w.max_bins = std::max<int64_t>(n, 1);
    w.key_bits = 1;
    while ((int64_t{1} << w.key_bits) < w.max_bins) ++w.key_bits;
    w.grid = static_cast<CellGrid*>(layout.take(sizeof(CellGrid)));
    w.keys = static_cast<int*>(layout.take(n * sizeof(int)));
    w.sorted_keys = static_cast<int*>(layout.take(n * sizeof(int)));
    w.atoms = static_cast<int*>(layout.take(n * sizeof(int)));
    w.sorted_atoms = static_cast<int*>(layout.take(n * sizeof(int)));
    w.bin_start = static_cast<int*>(layout.take((w.max_bins + 1) * sizeof(int)));
    cub::DeviceRadixSort::SortPairs(nullptr, w.sort_bytes, w.keys, w.sorted_keys, w.atoms,
                                    w.sorted_atoms, n, 0, w.key_bits);
    w.sort_temp = layout.take(w.sort_bytes);
  }
  w.total_bytes = layout.bytes();
  return w;
}

unsigned blocks_for(int64_t threads) {
  return static_cast<unsigned>(std::max<int64_t>(ceil_div(threads, kThreads), 1));
}

}  // namespace

NeighborSearch resolve_neighbor_search(const NeighborListParams& params) {
  if (params.search != NeighborSearch::kAuto) return params.search;
  return params.batch == nullptr && params.num_atoms >= kCellListMinAtoms ? NeighborSearch::kCellList
                                                                          : NeighborSearch::kDirect;
}

namespace {

// Whether the search runs as one_block_direct_kernel, which needs no workspace.
bool runs_in_one_block(const NeighborListParams& p) {
  return resolve_neighbor_search(p) == NeighborSearch::kDirect && p.num_atoms <= kOneBlockMaxAtoms &&
         p.max_pairs <= kOneBlockMaxPairs;
}

}  // namespace

size_t neighbor_list_workspace_bytes(const NeighborListParams& params) {
  return runs_in_one_block(params) ? 0 : plan_workspace(params, nullptr).total_bytes;
}

cudaError_t launch_neighbor_list(const NeighborListParams& p, void* workspace, cudaStream_t stream) {
  const NeighborSearch search = resolve_neighbor_search(p);
  if (search == NeighborSearch::kCellList && p.batch != nullptr) return cudaErrorInvalidValue;
  const int64_t n = p.num_atoms;
  if (runs_in_one_block(p)) {
    return launch_overlapped(one_block_direct_kernel, dim3(1), dim3(kOneBlockThreads), 0, stream, false, p);
  }
  Workspace w = plan_workspace(p, static_cast<char*>(workspace));
  cudaError_t status = cudaMemsetAsync(w.invalid, 0, sizeof(int), stream);
  if (status == cudaSuccess) status = cudaMemsetAsync(w.offsets, 0, sizeof(int64_t), stream);
  if (status != cudaSuccess) return status;
  if (n > 0) {
    prepare_atoms_kernel<<<blocks_for(n), kThreads, 0, stream>>>(p, w.frames, w.invalid);
    if (search == NeighborSearch::kCellList) {
      grid_setup_kernel<<<1, kSetupThreads, 0, stream>>>(p, w.frames, w.max_bins, w.grid);
      assign_bins_kernel<<<blocks_for(n), kThreads, 0, stream>>>(w.frames, w.grid, n, w.keys, w.atoms);
      status = cub::DeviceRadixSort::SortPairs(w.sort_temp, w.sort_bytes, w.keys, w.sorted_keys,
                                               w.atoms, w.sorted_atoms, static_cast<int>(n), 0,
                                               w.key_bits, stream);
      if (status != cudaSuccess) return status;
      bin_starts_kernel<<<blocks_for(w.max_bins + 1), kThreads, 0, stream>>>(
          w.sorted_keys, n, w.bin_start, w.max_bins + 1);
      cell_list_count_kernel<<<blocks_for(n * 32), kThreads, 0, stream>>>(
          p, w.frames, w.grid, w.bin_start, w.sorted_atoms, w.counts);
    } else {
      direct_count_kernel<<<blocks_for(n * 32), kThreads, 0, stream>>>(p, w.frames, w.counts);
    }
    status = cub::DeviceScan::InclusiveSum(w.scan_temp, w.scan_bytes, w.counts, w.offsets + 1,
                                           static_cast<int>(n), stream);
    if (status != cudaSuccess) return status;
    if (search == NeighborSearch::kCellList) {
      cell_list_write_kernel<<<blocks_for(n * 32), kThreads, 0, stream>>>(
          p, w.frames, w.grid, w.bin_start, w.sorted_atoms, w.offsets);
    } else {
      direct_write_kernel<<<blocks_for(n * 32), kThreads, 0, stream>>>(p, w.frames, w.offsets);
    }
  }
  const int64_t finish_blocks = std::min<int64_t>(blocks_for(p.max_pairs), 4LL * sm_count());
  finish_kernel<<<static_cast<unsigned>(finish_blocks), kThreads, 0, stream>>>(p, w.offsets + n, w.invalid);
  return cudaGetLastError();
}

}  // namespace mirage::cuda
