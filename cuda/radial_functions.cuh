// Radial functions shared by the force-field kernels (radial_basis, schnet_energy, painn_energy):
// the Gaussian basis, sinc (for the Bessel basis) and the cutoff envelopes, float32. Device code:
// included by .cu files only.
#pragma once

#include "radial_basis.cuh"

namespace mirage::cuda {

constexpr float kPi = 3.14159265358979323846f;

// Gaussian k of num over [0, cutoff]: center k * spacing, width the spacing.
__host__ __device__ __forceinline__ float gaussian_spacing(int num, float cutoff) {
  return num > 1 ? cutoff / static_cast<float>(num - 1) : cutoff;
}

__device__ __forceinline__ float gaussian(float d, int k, float spacing) {
  const float z = (d - k * spacing) / spacing;
  return expf(-0.5f * z * z);
}

// d gaussian / dd, from its value.
__device__ __forceinline__ float gaussian_derivative(float value, float d, int k, float spacing) {
  const float z = (d - k * spacing) / spacing;
  return -z / spacing * value;
}

// Kind "none": cos(0 d), that is 1, and NaN (value and slope) where d is NaN or infinite, as the
// other kinds' gradients there (the envelopes give 0 at such d; the products stay NaN).
__device__ __forceinline__ float no_basis(float d) { return isfinite(d) ? 1.0f : __int_as_float(0x7fc00000); }

// Below this |x|, sin(x) / x is its Taylor series: exact to float64 rounding there, and the
// autograd composite switches at the same point so that its derivatives stay finite at d = 0.
constexpr float kSincSeriesBelow = 0.1f;

__device__ __forceinline__ float sinc(float x) {
  if (fabsf(x) < kSincSeriesBelow) {
    const float x2 = x * x;
    return 1.0f - x2 / 6.0f * (1.0f - x2 / 20.0f * (1.0f - x2 / 42.0f * (1.0f - x2 / 72.0f)));
  }
  return sinf(x) / x;
}

// sinc(x) and its derivative, with the forward's Taylor branch: below |x| = 0.1 the derivative of
// the series, -x/3 + x^3/30 - x^5/840 + x^7/45360 (what autograd of the composite gives there,
// and no cancellation), else (cos x - sinc x) / x.
__device__ __forceinline__ void sinc_and_derivative(float x, float& value, float& derivative) {
  if (fabsf(x) < kSincSeriesBelow) {
    const float x2 = x * x;
    value = sinc(x);
    derivative = -x / 3.0f * (1.0f - x2 / 10.0f * (1.0f - x2 / 28.0f * (1.0f - x2 / 54.0f)));
    return;
  }
  float sine, cosine;
  sincosf(x, &sine, &cosine);
  value = sine / x;
  derivative = (cosine - value) / x;
}

// basis_k(d), radial_basis' function k (no envelope), and its derivative in d: the Gaussian of
// center k * spacing, the Bessel function sqrt(2 / c) sin((k + 1) pi d / c) / d, or 1 (kNone).
__device__ __forceinline__ void basis_and_derivative(RadialBasisKind kind, int k, float d, float spacing,
                                                     float cutoff, float& value, float& derivative) {
  if (kind == RadialBasisKind::kNone) {
    value = no_basis(d);
    derivative = no_basis(d) - 1.0f;
    return;
  }
  if (kind == RadialBasisKind::kGaussian) {
    value = gaussian(d, k, spacing);
    derivative = gaussian_derivative(value, d, k, spacing);
    return;
  }
  const float frequency = (k + 1) * kPi / cutoff, scale = sqrtf(2.0f / cutoff) * frequency;
  float sinc_value, sinc_slope;
  sinc_and_derivative(frequency * d, sinc_value, sinc_slope);
  value = scale * sinc_value;
  derivative = scale * frequency * sinc_slope;
}

// Zero from the cutoff on (so the padding of mirage::neighbor_list, at the cutoff, is zero).
// NaN gives 0 here and NaN in the basis, so the product stays NaN.
__device__ __forceinline__ float envelope(CutoffFn fn, float d, float cutoff) {
  if (fn == CutoffFn::kNone) return 1.0f;
  if (!(d < cutoff)) return 0.0f;
  const float x = d / cutoff;
  if (fn == CutoffFn::kCosine) return 0.5f * (cosf(kPi * x) + 1.0f);
  // p = 6: 1 - 28 x^6 + 48 x^7 - 21 x^8, factored as (1 - x)^3 (1 + 3x + 6x^2 + 10x^3 + 15x^4 +
  // 21x^5): near the cutoff the expanded sum cancels to an absolute error of ~1e-6, which the
  // backward multiplies by the basis' slope; the factored form keeps its relative accuracy.
  const float one_minus_x = 1.0f - x;
  return one_minus_x * one_minus_x * one_minus_x *
         (1.0f + x * (3.0f + x * (6.0f + x * (10.0f + x * (15.0f + 21.0f * x)))));
}

// d envelope / dd: 0 from the cutoff on, as the envelope is constant there.
__device__ __forceinline__ float envelope_derivative(CutoffFn fn, float d, float cutoff) {
  if (fn == CutoffFn::kNone || !(d < cutoff)) return 0.0f;
  const float x = d / cutoff;
  if (fn == CutoffFn::kCosine) return -0.5f * kPi / cutoff * sinf(kPi * x);
  const float one_minus_x = 1.0f - x, x2 = x * x;  // -168 x^5 (1 - x)^2 / c
  return -168.0f / cutoff * (x2 * x2 * x) * (one_minus_x * one_minus_x);
}

}  // namespace mirage::cuda
