// Radial functions shared by the force-field kernels (radial_basis, schnet_energy): the Gaussian
// basis and the cutoff envelopes, float32. Device code: included by .cu files only.
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
