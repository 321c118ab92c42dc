// float64 jets (a value and its first two derivatives) of the functions the force-field ops
// choose between: radial_basis' basis functions and envelopes, the filter networks'
// activations. Host and device code, free of CUDA and torch headers: the CPU references
// (radial_basis, radial_cfconv) and radial_cfconv's table kernel share them.
#pragma once

#include <cmath>

#include "host_device.h"
#include "kinds.h"

namespace mirage::cuda::jets {

// A function's value and its first two derivatives at one point.
struct Jet {
  double v, d1, d2;
};

// radial_basis' function k of num at d (no envelope): the Gaussian of center k * spacing, the
// Bessel function of frequency (k + 1) pi / cutoff, or for kind "none" cos(0 d): 1, and NaN at a
// NaN or infinite d, as the other kinds' derivatives there.
MIRAGE_HOST_DEVICE inline Jet basis_jet(RadialBasisKind kind, int k, int num, double d, double cutoff) {
  if (kind == RadialBasisKind::kNone) {  // finite: |d| <= the largest double (false for NaN too)
    return fabs(d) <= 1.7976931348623157e308 ? Jet{1.0, 0.0, 0.0} : Jet{NAN, NAN, NAN};
  }
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
    s2 = -1.0 / 3.0 +
         x2 / 10.0 * (1.0 - x2 / (168.0 / 10.0) * (1.0 - x2 / (270.0 / 7.0) * (1.0 - x2 / (616.0 / 9.0))));
  } else {
    s0 = sin(x) / x;
    s1 = (cos(x) - s0) / x;
    s2 = -s0 - 2.0 * s1 / x;
  }
  return {scale * s0, scale * w * s1, scale * w * w * s2};
}

// A filter network's activation at z (not relu: radial_cfconv refuses it). The softplus family
// keeps F.softplus' threshold: the identity above 20.
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

// The envelope's formula at d (1 for "none"): at the cutoff its derivatives from the left, past
// it the polynomial continued (radial_basis' envelope is 0 from the cutoff on; its callers decide).
MIRAGE_HOST_DEVICE inline Jet envelope_jet(CutoffFn fn, double d, double cutoff) {
  if (fn == CutoffFn::kNone) return {1.0, 0.0, 0.0};
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

}  // namespace mirage::cuda::jets
