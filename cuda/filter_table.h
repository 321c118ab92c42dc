// mirage::radial_cfconv's filter table: the filter network of a distance,
//   F(d) = envelope(d) (W2 act(W1 basis(d) + b1) + b2)                   [M]
// as a piecewise quintic over `intervals` equal pieces of [0, cutoff], each the Hermite
// interpolant of F, F' and F'' at its two ends (evaluated in float64). The coefficients of piece k
// in s = d intervals / cutoff - k (0 <= s <= 1), c[0] + c[1] s + ... + c[5] s^5, are stored as
// table[k, q, m] (q = 0 .. 5). Its error falls as the sixth power of the piece's width: with
// intervals_for()'s count it is below float32 rounding for the models measured
// (docs/ops.md). The CUDA table kernel and the CPU reference share this and jets.h (host and
// device code, float64, free of CUDA and torch headers).
#pragma once

#include <cstdint>

#include "host_device.h"
#include "jets.h"
#include "kinds.h"

namespace mirage::cuda::filter_table {

using jets::Jet;

constexpr int kCoefficients = 6;

// The pieces a table of this basis takes: 32 per unit of the basis' resolution over the cutoff (the
// Gaussians' count of spacings, the Bessel functions' highest frequency times the cutoff, pi R),
// rounded up to a power of two, at least 512. SchNet's 20 Gaussians: 1,024 pieces (3 MiB at
// M = 128).
MIRAGE_HOST_DEVICE inline int64_t intervals_for(RadialBasisKind basis, int64_t num_rbf) {
  const double resolution = basis == RadialBasisKind::kBessel ? 3.141592653589793 * num_rbf : num_rbf - 1.0;
  int64_t intervals = 512;
  while (intervals < 32.0 * resolution) intervals *= 2;
  return intervals;
}

// The coefficients of the quintic on a piece of width h matching F, F', F'' at both ends.
MIRAGE_HOST_DEVICE inline void quintic(const Jet& left, const Jet& right, double h, double (&c)[kCoefficients]) {
  const double y = right.v - left.v, d0 = h * left.d1, d1 = h * right.d1;
  const double e0 = 0.5 * h * h * left.d2, e1 = 0.5 * h * h * right.d2;
  c[0] = left.v;
  c[1] = d0;
  c[2] = e0;
  c[3] = 10.0 * y - 6.0 * d0 - 4.0 * d1 - 3.0 * e0 + e1;
  c[4] = -15.0 * y + 8.0 * d0 + 7.0 * d1 + 3.0 * e0 - 2.0 * e1;
  c[5] = 6.0 * y - 3.0 * d0 - 3.0 * d1 - e0 + e1;
}

}  // namespace mirage::cuda::filter_table
