// The kernels' enums of activation and radial-function names (checked before): CPU references
// and CUDA launches alike.
#pragma once

#include <string_view>

#include "../../cuda/kinds.h"

namespace mirage::ops {

// The force-field kernels' activation of a name from kEnergyActivations (schnet_energy.h).
inline cuda::Activation kernel_activation(std::string_view name) {
  if (name == "shifted_softplus") return cuda::Activation::kShiftedSoftplus;
  if (name == "softplus") return cuda::Activation::kSoftplus;
  if (name == "silu") return cuda::Activation::kSilu;
  if (name == "tanh") return cuda::Activation::kTanh;
  if (name == "gelu") return cuda::Activation::kGelu;
  return cuda::Activation::kRelu;  // the checks admit nothing else
}

// The radial functions' names (checked by check_radial_basis) as the kernels take them.
inline cuda::RadialBasisKind kernel_basis(std::string_view kind) {
  return kind == "gaussian" ? cuda::RadialBasisKind::kGaussian
         : kind == "bessel" ? cuda::RadialBasisKind::kBessel
                            : cuda::RadialBasisKind::kNone;
}
inline cuda::CutoffFn kernel_cutoff_fn(std::string_view cutoff_fn) {
  return cutoff_fn == "cosine"       ? cuda::CutoffFn::kCosine
         : cutoff_fn == "polynomial" ? cuda::CutoffFn::kPolynomial
                                     : cuda::CutoffFn::kNone;
}

}  // namespace mirage::ops
