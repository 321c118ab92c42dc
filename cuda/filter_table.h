// mirage::radial_cfconv's filter table: the filter network of a distance,
//   F(d) = envelope(d) (W2 act(W1 basis(d) + b1) + b2)                   [M]
// as a piecewise quintic over `intervals` equal pieces of [0, cutoff], each the Hermite
// interpolant of F, F' and F'' at its two ends (evaluated in float64). The coefficients of piece k
// in s = d intervals / cutoff - k (0 <= s <= 1), c[0] + c[1] s + ... + c[5] s^5, are stored as
// table[k, q, m] (q = 0 .. 5). Its error falls as the sixth power of the piece's width: with
// intervals_for()'s count it is below float32 rounding for the models measured
// (docs/ops.md). The value and derivative functions below are shared by the CUDA table kernel
// and the CPU reference (host and device code, float64, free of CUDA and torch headers).
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"
#include "kinds.h"

namespace mirage::cuda::filter_table {

constexpr int kCoefficients = 6;

// A function's value and its first two derivatives at one point.
struct Jet {
  double v, d1, d2;
};

// The pieces a table of this basis takes: 32 per unit of the basis' resolution over the cutoff (the
// Gaussians' count of spacings, the Bessel functions' highest frequency times the cutoff, pi R),
// rounded up to a power of two, at least 512. SchNet's 20 Gaussians: 1,024 pieces (3 MiB at
// M = 128).
inline int64_t intervals_for(RadialBasisKind basis, int64_t num_rbf) {
  const double resolution = basis == RadialBasisKind::kBessel ? 3.141592653589793 * num_rbf : num_rbf - 1.0;
  int64_t intervals = 512;
  while (intervals < 32.0 * resolution) intervals *= 2;
  return intervals;
}

// radial_basis' function k of num (Gaussian or Bessel, no envelope) at d.
MIRAGE_HOST_DEVICE inline Jet basis_jet(RadialBasisKind kind, int k, int num, double d, double cutoff) {
  if (kind == RadialBasisKind::kGaussian) {
    const double spacing = num > 1 ? cutoff / (num - 1) : cutoff, z = (d - k * spacing) / spacing;
    const double g = exp(-0.5 * z * z);
    return {g, -z / spacing * g, (z * z - 1.0) / (spacing * spacing) * g};
  }
  // sqrt(2 / c) w sinc(w d), w = (k + 1) pi / c; sinc by its Taylor series below |x| = 0.1 (exact
  // to float64 rounding there), where the closed forms of its derivatives cancel.
  const double w = (k + 1) * 3.141592653589793 / cutoff, scale = sqrt(2.0 / cutoff) * w, x = w * d;
  double s0, s1, s2;
  if (fabs(x) < 0.1) {
    const double x2 = x * x;
    s0 = 1.0 - x2 / 6.0 * (1.0 - x2 / 20.0 * (1.0 - x2 / 42.0 * (1.0 - x2 / 72.0)));
    s1 = -x / 3.0 * (1.0 - x2 / 10.0 * (1.0 - x2 / 28.0 * (1.0 - x2 / 54.0)));
    s2 = -1.0 / 3.0 + x2 / 10.0 * (1.0 - x2 / (168.0 / 10.0) * (1.0 - x2 / (270.0 / 7.0) * (1.0 - x2 / (616.0 / 9.0))));
  } else {
    s0 = sin(x) / x;
    s1 = (cos(x) - s0) / x;
    s2 = -s0 - 2.0 * s1 / x;
  }
  return {scale * s0, scale * w * s1, scale * w * w * s2};
}

// The filter network's activation at z (relu, not smooth, is refused by the op). The softplus
// family keeps F.softplus' threshold: the identity above 20.
MIRAGE_HOST_DEVICE inline Jet activation_jet(Activation activation, double z) {
  switch (activation) {
    case Activation::kSoftplus:
    case Activation::kShiftedSoftplus: {
      const double shift = activation == Activation::kShiftedSoftplus ? 0.6931471805599453 : 0.0;
      if (z > 20.0) return {z - shift, 1.0, 0.0};
      const double s = 1.0 / (1.0 + exp(-z));
      return {log1p(exp(z)) - shift, s, s * (1.0 - s)};
    }
    case Activation::kSilu: {
      const double s = 1.0 / (1.0 + exp(-z));
      return {z * s, s * (1.0 + z * (1.0 - s)), s * (1.0 - s) * (2.0 + z * (1.0 - 2.0 * s))};
    }
    case Activation::kTanh: {
      const double t = tanh(z);
      return {t, 1.0 - t * t, -2.0 * t * (1.0 - t * t)};
    }
    case Activation::kGelu: {  // z Phi(z): Phi + z phi, phi (2 - z^2)
      const double phi = 0.3989422804014327 * exp(-0.5 * z * z), cdf = 0.5 * erfc(-z * 0.7071067811865476);
      return {z * cdf, cdf + z * phi, phi * (2.0 - z * z)};
    }
    default:
      return {z, 1.0, 0.0};
  }
}

// The envelope (cosine or polynomial) on [0, cutoff], its derivatives from the left at the cutoff.
MIRAGE_HOST_DEVICE inline Jet envelope_jet(CutoffFn fn, double d, double cutoff) {
  const double x = d / cutoff;
  if (fn == CutoffFn::kCosine) {
    const double a = 3.141592653589793 / cutoff, c = cos(a * d);
    return {0.5 * (c + 1.0), -0.5 * a * sin(a * d), -0.5 * a * a * c};
  }
  // 1 - 28 x^6 + 48 x^7 - 21 x^8, factored as radial_functions.cuh's envelope()
  const double y = 1.0 - x;
  return {y * y * y * (1.0 + x * (3.0 + x * (6.0 + x * (10.0 + x * (15.0 + 21.0 * x))))),
          -168.0 / cutoff * x * x * x * x * x * y * y,
          -168.0 / (cutoff * cutoff) * x * x * x * x * y * (5.0 - 7.0 * x)};
}

// The product of two jets (Leibniz).
MIRAGE_HOST_DEVICE inline Jet times(const Jet& a, const Jet& b) {
  return {a.v * b.v, a.d1 * b.v + a.v * b.d1, a.d2 * b.v + 2.0 * a.d1 * b.d1 + a.v * b.d2};
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
