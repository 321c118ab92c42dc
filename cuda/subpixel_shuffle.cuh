// The sub-pixel form of nearest 2x upsampling followed by a 3x3 convolution: the convolution of
// the small input with a 2x2 kernel per output parity gives y, and this interleaves y's four
// parities into the large output, adding the convolution's bias on the way:
//   out[n, 2i+p, 2j+q, c] = y[n, i+p, j+q, (2p+q)*C + c] + bias[c]   (channels-last indices)
#pragma once

#include <cstdint>

#include "common.cuh"

namespace mirage::cuda {

struct SubpixelShuffleParams {
  const void* y;     // [batch, height + 1, width + 1, 4 * channels] channels-last
  const void* bias;  // [channels] or null
  void* out;         // [batch, 2 * height, 2 * width, channels] channels-last
  int64_t batch, height, width, channels;  // of the upsampled image's halves: out is 2x this
  DType dtype;       // of y and out
  DType bias_dtype;  // dtype or float32
};

cudaError_t launch_subpixel_shuffle(const SubpixelShuffleParams& params, cudaStream_t stream);

}  // namespace mirage::cuda
