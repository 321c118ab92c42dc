// mirage::bias_act: argument checks, CPU reference and Meta kernel.
#include "bias_act.h"

#include <cmath>
#include <iterator>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "message.h"

namespace mirage::ops {

void check_bias_act(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& residual, std::string_view activation, double scale) {
  check_activation_dtype(kBiasAct, "x", x);
  MIRAGE_CHECK(x.dim() >= 2, kBiasAct, ": x must have shape (N, C, *), got ", x.dim(),
              " dimension(s) ", x.sym_sizes());
  const c10::SymInt batch = x.sym_size(0), channels = x.sym_size(1);
  if (present(bias)) {
    check_same_device(kBiasAct, "bias", *bias, x);
    const bool per_channel = bias->dim() == 1 && bias->sym_size(0) == channels;
    const bool per_sample = bias->dim() == 2 && bias->sym_size(0) == batch && bias->sym_size(1) == channels;
    MIRAGE_CHECK(per_channel || per_sample, kBiasAct, ": bias must have shape [", channels, "] or [",
                batch, ", ", channels, "] for x of shape ", x.sym_sizes(), ", got ", bias->sym_sizes());
    MIRAGE_CHECK(bias->scalar_type() == x.scalar_type() || bias->scalar_type() == at::kFloat,
                kBiasAct, ": bias must have x's dtype (", x.scalar_type(), ") or float32, got ",
                bias->scalar_type());
  }
  if (present(residual)) {
    check_same_device(kBiasAct, "residual", *residual, x);
    MIRAGE_CHECK(residual->sym_sizes() == x.sym_sizes(), kBiasAct, ": residual must have x's shape ",
                x.sym_sizes(), ", got ", residual->sym_sizes());
    MIRAGE_CHECK(residual->scalar_type() == x.scalar_type(), kBiasAct,
                ": residual must have x's dtype (", x.scalar_type(), "), got ",
                residual->scalar_type());
  }
  check_bias_activation(kBiasAct, "activation", activation);
  MIRAGE_CHECK(finite_as_float32(scale), kBiasAct, ": scale must be finite as a float32, got ", scale);
}

int bias_activation_index(std::string_view activation) {
  for (int i = 0; i < static_cast<int>(std::size(kBiasActivations)); ++i)
    if (kBiasActivations[i] == activation) return i;
  return -1;
}

void check_bias_activation(std::string_view op, std::string_view argument, std::string_view activation) {
  MIRAGE_CHECK(bias_activation_index(activation) >= 0, op, ": ", argument,
              " must be one of \"none\", \"silu\", \"gelu\", \"gelu_tanh\", \"relu\", got \"", activation, "\"");
}

at::Tensor apply_activation(const at::Tensor& x, std::string_view activation) {
  if (activation == "silu") return at::silu(x);
  if (activation == "gelu") return at::gelu(x);
  if (activation == "gelu_tanh") return at::gelu(x, "tanh");
  if (activation == "relu") return at::relu(x);
  return x;
}

at::Tensor broadcastable_bias(const at::Tensor& bias, const at::Tensor& x) {
  c10::SymDimVector shape(x.dim(), 1);
  shape[1] = x.sym_size(1);
  if (bias.dim() == 2) shape[0] = x.sym_size(0);
  return bias.reshape_symint(shape);
}

namespace {

// The reference: float64 PyTorch ops, one step at a time as the op's definition reads.
at::Tensor bias_act_cpu(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual, c10::string_view activation,
                        double scale) {
  check_bias_act(x, bias, residual, activation, scale);
  at::Tensor v = x.to(at::kDouble);
  if (present(bias)) v = v + broadcastable_bias(bias->to(at::kDouble), v);
  if (activation == "silu") v = v / (1.0 + at::exp(-v));
  if (activation == "gelu") v = 0.5 * v * (1.0 + at::erf(v / std::sqrt(2.0)));
  if (activation == "gelu_tanh")
    v = 0.5 * v * (1.0 + at::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
  if (activation == "relu") v = at::relu(v);
  if (present(residual)) v = v + residual->to(at::kDouble);
  v = v * scale;
  return v.to(x.scalar_type()).contiguous(channels_layout(x));
}

at::Tensor bias_act_meta(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual, c10::string_view activation,
                         double scale) {
  check_bias_act(x, bias, residual, activation, scale);
  return empty_in_channels_layout(x, channels_layout(x));
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) { m.impl("bias_act", &bias_act_cpu); }
TORCH_LIBRARY_IMPL(mirage, Meta, m) { m.impl("bias_act", &bias_act_meta); }

}  // namespace mirage::ops
