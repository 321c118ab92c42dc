// The functions kernels and CPU references choose between at run time: activations and the radial
// functions. Free of CUDA and torch headers (CPU-only builds include it too).
#pragma once

namespace mirage::cuda {

// The activation fused into a kernel's epilogue (group_norm takes kNone and kSilu only; the
// force-field kernels also take the softplus family and tanh).
enum class Activation : int { kNone, kSilu, kGelu, kGeluTanh, kRelu, kTanh, kSoftplus, kShiftedSoftplus };

// kNone: no basis, 1 (radial_functions.cuh's no_basis): radial_basis then gives the cutoff
// function alone.
enum class RadialBasisKind : int { kGaussian, kBessel, kNone };
enum class CutoffFn : int { kNone, kCosine, kPolynomial };

}  // namespace mirage::cuda
