// Backward formulas. Each fused op's forward re-dispatches below autograd to its kernel; its
// backward recomputes the op with PyTorch's differentiable composite and differentiates that.
// The recompute costs one extra forward, but the gradients are PyTorch's own, and double
// backward works because the composite is differentiable too.
#include <functional>
#include <string>

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "op_handles.h"

namespace mirage::autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor value_or_undefined(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

// Saves the tensor inputs (undefined for absent optional ones) and which of them need gradients.
void save_inputs(AutogradContext* ctx, const variable_list& inputs) {
  ctx->save_for_backward(inputs);
  c10::List<bool> needs;
  for (const auto& t : inputs) needs.push_back(t.defined() && t.requires_grad());
  ctx->saved_data["needs_grad"] = needs;
}

using Composite = std::function<variable_list(const variable_list&)>;

// Gradients of composite(inputs) with respect to the saved inputs, one slot per input.
variable_list composite_backward(AutogradContext* ctx, const variable_list& grad_outputs,
                                 const Composite& composite) {
  const bool create_graph = at::GradMode::is_enabled();
  const variable_list saved = ctx->get_saved_variables();
  const c10::List<bool> needs = ctx->saved_data["needs_grad"].toBoolList();
  const at::AutoGradMode enable_grad(true);
  variable_list inputs(saved.size()), wrt;
  std::vector<size_t> wrt_index;
  for (size_t i = 0; i < saved.size(); ++i) {
    if (!saved[i].defined()) continue;
    // For double backward, differentiate through the saved (graph-connected) inputs themselves.
    inputs[i] = create_graph ? saved[i] : saved[i].detach().requires_grad_(needs[i]);
    if (needs[i]) {
      wrt.push_back(inputs[i]);
      wrt_index.push_back(i);
    }
  }
  const variable_list outputs = composite(inputs);
  variable_list used_outputs, used_grads;
  for (size_t o = 0; o < outputs.size(); ++o) {
    if (grad_outputs[o].defined() && outputs[o].requires_grad()) {
      used_outputs.push_back(outputs[o]);
      used_grads.push_back(grad_outputs[o]);
    }
  }
  variable_list grads(saved.size());
  if (used_outputs.empty() || wrt.empty()) return grads;
  const variable_list computed = torch::autograd::grad(used_outputs, wrt, used_grads,
                                                       /*retain_graph=*/create_graph,
                                                       /*create_graph=*/create_graph,
                                                       /*allow_unused=*/true);
  for (size_t k = 0; k < wrt_index.size(); ++k) grads[wrt_index[k]] = computed[k];
  return grads;
}

// Parameters stored in float32 beside float16/bfloat16 activations join the composite in x's dtype;
// their gradient flows back through the cast into float32.
std::optional<at::Tensor> in_dtype_of(const at::Tensor& p, const at::Tensor& x) {
  return p.defined() ? std::optional<at::Tensor>(p.to(x.scalar_type())) : std::nullopt;
}

struct GroupNormFunction : torch::autograd::Function<GroupNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t num_groups,
                            const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps,
                            c10::string_view activation) {
    save_inputs(ctx, {x, value_or_undefined(weight), value_or_undefined(bias)});
    ctx->saved_data["num_groups"] = num_groups;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["activation"] = std::string(activation);
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return handles::group_norm().call(x, num_groups, weight, bias, eps, activation);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const int64_t num_groups = ctx->saved_data["num_groups"].toInt();
    const double eps = ctx->saved_data["eps"].toDouble();
    const bool silu = ctx->saved_data["activation"].toStringRef() == "silu";
    const variable_list grads = composite_backward(ctx, grad_outputs, [&](const variable_list& in) {
      at::Tensor y = at::group_norm(in[0], num_groups, in_dtype_of(in[1], in[0]),
                                    in_dtype_of(in[2], in[0]), eps);
      return variable_list{silu ? at::silu(y) : y};
    });
    return {grads[0], at::Tensor(), grads[1], grads[2], at::Tensor(), at::Tensor()};
  }
};

at::Tensor layer_norm_composite(const at::Tensor& x, const at::Tensor& weight,
                                const at::Tensor& bias, double eps) {
  return at::layer_norm(x, {x.size(-1)}, in_dtype_of(weight, x), in_dtype_of(bias, x), eps);
}

struct LayerNormFunction : torch::autograd::Function<LayerNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps) {
    save_inputs(ctx, {x, value_or_undefined(weight), value_or_undefined(bias)});
    ctx->saved_data["eps"] = eps;
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return handles::layer_norm().call(x, weight, bias, eps);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const double eps = ctx->saved_data["eps"].toDouble();
    const variable_list grads = composite_backward(ctx, grad_outputs, [&](const variable_list& in) {
      return variable_list{layer_norm_composite(in[0], in[1], in[2], eps)};
    });
    return {grads[0], grads[1], grads[2], at::Tensor()};
  }
};

struct AddLayerNormFunction : torch::autograd::Function<AddLayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& residual, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps) {
    save_inputs(ctx, {x, residual, value_or_undefined(weight), value_or_undefined(bias)});
    ctx->saved_data["eps"] = eps;
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, sum] = handles::add_layer_norm().call(x, residual, weight, bias, eps);
    return {out, sum};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const double eps = ctx->saved_data["eps"].toDouble();
    const variable_list grads = composite_backward(ctx, grad_outputs, [&](const variable_list& in) {
      const at::Tensor sum = in[0] + in[1];
      return variable_list{layer_norm_composite(sum, in[2], in[3], eps), sum};
    });
    return {grads[0], grads[1], grads[2], grads[3], at::Tensor()};
  }
};

struct GegluFunction : torch::autograd::Function<GegluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            c10::string_view approximate) {
    save_inputs(ctx, {x});
    ctx->saved_data["approximate"] = std::string(approximate);
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return handles::geglu().call(x, approximate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    const variable_list grads = composite_backward(ctx, grad_outputs, [&](const variable_list& in) {
      const auto halves = in[0].chunk(2, -1);
      return variable_list{halves[0] * at::gelu(halves[1], approximate)};
    });
    return {grads[0], at::Tensor()};
  }
};

at::Tensor group_norm_autograd(const at::Tensor& x, int64_t num_groups,
                               const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps,
                               c10::string_view activation) {
  return GroupNormFunction::apply(x, num_groups, weight, bias, eps, activation);
}

at::Tensor layer_norm_autograd(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps) {
  return LayerNormFunction::apply(x, weight, bias, eps);
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm_autograd(const at::Tensor& x,
                                                           const at::Tensor& residual,
                                                           const std::optional<at::Tensor>& weight,
                                                           const std::optional<at::Tensor>& bias,
                                                           double eps) {
  const variable_list out = AddLayerNormFunction::apply(x, residual, weight, bias, eps);
  return {out[0], out[1]};
}

at::Tensor geglu_autograd(const at::Tensor& x, c10::string_view approximate) {
  return GegluFunction::apply(x, approximate);
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, Autograd, m) {
  m.impl("group_norm", &group_norm_autograd);
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("add_layer_norm", &add_layer_norm_autograd);
  m.impl("geglu", &geglu_autograd);
}

}  // namespace mirage::autograd
