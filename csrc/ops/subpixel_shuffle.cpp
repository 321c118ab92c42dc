// mirage::subpixel_shuffle: checks, CPU reference and Meta kernel.
#include "subpixel_shuffle.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "message.h"

namespace mirage::ops {

c10::SymDimVector check_subpixel_shuffle(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  check_activation_dtype(kSubpixelShuffle, "x", x);
  MIRAGE_CHECK(x.dim() == 4, kSubpixelShuffle, ": x must be 4-D [N, 4C, H+1, W+1], got shape ", x.sym_sizes());
  MIRAGE_CHECK(x.sym_size(1) % 4 == 0, kSubpixelShuffle,
               ": x's channels must be a multiple of 4 (four parities of C channels), got ", x.sym_size(1));
  MIRAGE_CHECK(x.sym_size(2) >= 1 && x.sym_size(3) >= 1, kSubpixelShuffle,
               ": x's height and width must be at least 1 (H+1 and W+1), got shape ", x.sym_sizes());
  const c10::SymInt channels = x.sym_size(1) / 4;
  check_param(kSubpixelShuffle, "bias", bias, x, channels);
  return {x.sym_size(0), channels, 2 * (x.sym_size(2) - 1), 2 * (x.sym_size(3) - 1)};
}

at::Tensor subpixel_shuffle_composite(const at::Tensor& x, const at::Tensor& bias) {
  const c10::SymInt channels = x.sym_size(1) / 4, height = x.sym_size(2) - 1, width = x.sym_size(3) - 1;
  // parity[p][q] = x's channels of parity (p, q), shifted by (p, q): out[:, :, 2i+p, 2j+q].
  std::vector<at::Tensor> rows;
  for (int64_t p = 0; p < 2; ++p) {
    std::vector<at::Tensor> columns;
    for (int64_t q = 0; q < 2; ++q)
      columns.push_back(
          x.narrow_symint(1, (2 * p + q) * channels, channels).narrow_symint(2, p, height).narrow_symint(3, q, width));
    rows.push_back(at::stack(columns, -1));  // [N, C, H, W, 2]
  }
  at::Tensor out = at::stack(rows, 3).reshape_symint({x.sym_size(0), channels, 2 * height, 2 * width});
  if (bias.defined()) {
    // A float32 bias is added to 16-bit values in float32, as the kernel does, so that its gradient
    // (a sum over the image, in the backward's recompute) is summed in float32, not float16.
    const at::ScalarType sum = at::promote_types(out.scalar_type(), bias.scalar_type());
    out = (out.to(sum) + bias.to(sum).view_symint({channels, 1, 1})).to(x.scalar_type());
  }
  return out.contiguous(at::MemoryFormat::ChannelsLast);
}

namespace {

at::Tensor subpixel_shuffle_cpu(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  check_subpixel_shuffle(x, bias);
  const at::Tensor b = present(bias) ? bias->to(at::kDouble) : at::Tensor();
  return subpixel_shuffle_composite(x.to(at::kDouble), b).to(x.scalar_type());
}

at::Tensor subpixel_shuffle_meta(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  return at::empty_symint(check_subpixel_shuffle(x, bias), x.options().memory_format(at::MemoryFormat::ChannelsLast));
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) { m.impl("subpixel_shuffle", &subpixel_shuffle_cpu); }
TORCH_LIBRARY_IMPL(mirage, Meta, m) { m.impl("subpixel_shuffle", &subpixel_shuffle_meta); }

}  // namespace mirage::ops
