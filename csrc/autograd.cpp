// Backward formulas. Each fused op's forward re-dispatches below autograd to its kernel; its
// backward recomputes the op with PyTorch's differentiable composite and differentiates that.
// The recompute costs one extra forward, but the gradients are PyTorch's own, and double
// backward works because the composite is differentiable too.
// message_passing and pair_product are the exception: each one's gradients are the two ops
// themselves (docs/ops.md), so their backward calls them through the dispatcher, autograd
// included, with no recompute, and is differentiable to any order in turn. So is linear's, whose
// gradients are matmuls (x's a mirage::linear).
// radial_basis, vector_message_passing, painn_update(_input) and pair_vectors (forces) have a fused backward
// op of their own; only that op's backward (double backward) recomputes with a composite.
#include <cmath>
#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include "op_handles.h"
#include "tensors_given.h"
#include "ops/bias_act.h"
#include "ops/checks.h"
#include "ops/linear.h"
#include "ops/message.h"
#include "ops/pair_order.h"
#include "ops/schnet_energy.h"
#include "ops/subpixel_shuffle.h"
#include "ops/vector_message_passing.h"

namespace mirage::autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using ops::present;

at::Tensor value_or_undefined(const std::optional<at::Tensor>& t) {
  return present(t) ? *t : at::Tensor();
}

// The inverse: a saved optional input as the ops take it again.
std::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Float32 for float16/bfloat16 (the composites compute as the kernels do); float32 and float64
// as they are.
at::Tensor to_compute_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16 ? t.to(at::kFloat) : t;
}

// ctx->save_for_backward, but inference tensors (made under torch.inference_mode: frozen features
// feeding trainable parameters), which autograd refuses to save where PyTorch's composites save
// intermediates of their own (the activation of x, the sum x + residual, the gathered x[j]), are
// held in saved_data and put back by saved_tensors. Nothing is copied (a call that records no
// backward, under no_grad, pays nothing), and no version check is lost: outside inference mode
// an inference tensor cannot be changed in place.
void save_for_backward(AutogradContext* ctx, variable_list tensors) {
  c10::List<int64_t> where;
  c10::List<at::Tensor> held;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined() || !tensors[i].is_inference()) continue;
    where.push_back(static_cast<int64_t>(i));
    held.push_back(std::exchange(tensors[i], at::Tensor()));
  }
  if (!where.empty()) {
    ctx->saved_data["inference_at"] = where;
    ctx->saved_data["inference"] = held;
  }
  ctx->save_for_backward(tensors);
}

// What save_for_backward saved, in its order.
variable_list saved_tensors(AutogradContext* ctx) {
  variable_list saved = ctx->get_saved_variables();
  const auto where = ctx->saved_data.find("inference_at");
  if (where != ctx->saved_data.end()) {
    const c10::List<int64_t> indices = where->second.toIntList();
    const c10::List<at::Tensor> held = ctx->saved_data.at("inference").toTensorList();
    for (size_t k = 0; k < indices.size(); ++k) saved[indices[k]] = held[k];
  }
  return saved;
}

// Saves the tensor inputs (undefined for absent optional ones) and which of them need gradients.
// Where `read` is given and read[i] is false, the backward reads input i's shape, dtype and device
// but no value of it (the op is linear in it: its gradient is the same at any value), so a stand-in
// of one element expanded to its sizes is saved instead. Kept, the input (an activation, often)
// held its memory until the backward, and an in-place change of it, which PyTorch's composite
// allows, made the backward fail.
void save_inputs(AutogradContext* ctx, const variable_list& inputs, const std::vector<bool>& read = {}) {
  variable_list saved = inputs;
  c10::List<bool> needs, stand_in;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    const bool shape_only = t.defined() && i < read.size() && !read[i];
    if (shape_only) saved[i] = at::zeros({}, t.options()).expand_symint(t.sym_sizes());
    needs.push_back(t.defined() && t.requires_grad());
    stand_in.push_back(shape_only);
  }
  save_for_backward(ctx, saved);
  ctx->saved_data["needs_grad"] = needs;
  ctx->saved_data["stand_in"] = stand_in;
}

using Composite = std::function<variable_list(const variable_list&)>;

// Gradients of composite(inputs) with respect to the saved inputs, one slot per input.
variable_list composite_backward(AutogradContext* ctx, const variable_list& grad_outputs,
                                 const Composite& composite) {
  const bool create_graph = at::GradMode::is_enabled();
  const variable_list saved = saved_tensors(ctx);
  const c10::List<bool> needs = ctx->saved_data["needs_grad"].toBoolList();
  const c10::List<bool> stand_in = ctx->saved_data["stand_in"].toBoolList();
  const at::AutoGradMode enable_grad(true);
  variable_list inputs(saved.size()), wrt;
  std::vector<size_t> wrt_index;
  for (size_t i = 0; i < saved.size(); ++i) {
    if (!saved[i].defined()) continue;
    // For double backward, differentiate through the saved (graph-connected) inputs themselves;
    // a stand-in has no graph, and the gradients do not depend on its value.
    inputs[i] = create_graph && !stand_in[i] ? saved[i] : saved[i].detach().requires_grad_(needs[i]);
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

// The dtype a composite with parameters computes in: x's, widened by its (defined) parameters'.
// A float32 weight or bias beside float16/bfloat16 x makes it float32, as the kernels compute, so
// that the parameters' gradients (sums over every row or pixel) are summed in float32: in x's
// dtype a float16 bias's over a 256x256 image overflowed, and a bfloat16 one's stopped growing at
// 512 rows.
at::ScalarType composite_dtype(const at::Tensor& x, std::initializer_list<at::Tensor> parameters) {
  at::ScalarType dtype = x.scalar_type();
  for (const at::Tensor& p : parameters)
    if (p.defined()) dtype = at::promote_types(dtype, p.scalar_type());
  return dtype;
}

// p in `dtype`, or none for an undefined p.
std::optional<at::Tensor> as(const at::Tensor& p, at::ScalarType dtype) {
  return p.defined() ? std::optional<at::Tensor>(p.to(dtype)) : std::nullopt;
}

// group_norm's composite: PyTorch's group_norm, except where the batch is unbacked (torch.compile
// with mark_unbacked) or x is empty. On CUDA at::group_norm copies channels-last input to contiguous
// first, a copy that guards on the batch, which an unbacked size forbids (torch 2.11, H200,
// 2026-11-30); its backward refuses input without channels or pixels ("Expected number of channels
// to be greater than 0"). There the statistics are reductions over a grouped view of x (no copy, no
// guard; over nothing, empty or zero gradients), in float32 for float16 and bfloat16, rounded once
// at the end. Backed symbolic sizes keep PyTorch's: its gradients are what eager gives to the last
// bits, which torch.library.opcheck compares.
at::Tensor group_norm_composite(const at::Tensor& x, int64_t num_groups, const at::Tensor& weight,
                                const at::Tensor& bias, double eps) {
  const c10::SymInt batch = x.sym_size(0);
  const bool unbacked = batch.is_symbolic() && !batch.has_hint();
  if (!unbacked && !TORCH_GUARD_OR_FALSE(x.sym_numel().sym_eq(0))) {
    const at::ScalarType dtype = composite_dtype(x, {weight, bias});
    return at::group_norm(x.to(dtype), num_groups, as(weight, dtype), as(bias, dtype), eps).to(x.scalar_type());
  }
  const at::ScalarType compute = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // Without channels any num_groups is valid, and 2^62 empty groups would overflow the view's strides.
  const int64_t groups = TORCH_GUARD_OR_FALSE(x.sym_size(1).sym_eq(0)) ? 1 : num_groups;
  const at::Tensor grouped = x.to(compute).unflatten_symint(1, {groups, x.sym_size(1) / groups});
  std::vector<int64_t> reduced;
  for (int64_t d = 2; d < grouped.dim(); ++d) reduced.push_back(d);
  const at::Tensor centered = grouped - grouped.mean(reduced, /*keepdim=*/true);
  const at::Tensor variance = (centered * centered).mean(reduced, /*keepdim=*/true);
  at::Tensor y = (centered * at::rsqrt(variance + eps)).flatten(1, 2);
  std::vector<int64_t> per_channel(x.dim() - 1, 1);
  per_channel[0] = -1;
  if (weight.defined()) y = y * weight.to(compute).view(per_channel);
  if (bias.defined()) y = y + bias.to(compute).view(per_channel);
  return y.to(x.scalar_type());
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
      const at::Tensor y = group_norm_composite(in[0], num_groups, in[1], in[2], eps);
      return variable_list{silu ? at::silu(y) : y};
    });
    return {grads[0], at::Tensor(), grads[1], grads[2], at::Tensor(), at::Tensor()};
  }
};

at::Tensor layer_norm_composite(const at::Tensor& x, const at::Tensor& weight,
                                const at::Tensor& bias, double eps) {
  const at::ScalarType dtype = composite_dtype(x, {weight, bias});
  return at::layer_norm_symint(x.to(dtype), {x.sym_size(-1)}, as(weight, dtype), as(bias, dtype), eps)
      .to(x.scalar_type());
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

struct BiasActFunction : torch::autograd::Function<BiasActFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, c10::string_view activation,
                            double scale) {
    // Linear in the residual, and without an activation in x and the bias too.
    const bool activated = activation != "none";
    save_inputs(ctx, {x, value_or_undefined(bias), value_or_undefined(residual)}, {activated, activated, false});
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["scale"] = scale;
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return handles::bias_act().call(x, bias, residual, activation, scale);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    const double scale = ctx->saved_data["scale"].toDouble();
    const variable_list grads = composite_backward(ctx, grad_outputs, [&](const variable_list& in) {
      at::Tensor v = in[0].to(composite_dtype(in[0], {in[1]}));
      if (in[1].defined()) v = v + ops::broadcastable_bias(in[1].to(v.scalar_type()), v);
      v = ops::apply_activation(v, activation);
      if (in[2].defined()) v = v + in[2];
      return variable_list{(v * scale).to(in[0].scalar_type())};
    });
    return {grads[0], grads[1], grads[2], at::Tensor(), at::Tensor()};
  }
};

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, c10::string_view input_activation) {
    // The bias and the residual enter linearly: their gradients read no value of theirs, so only
    // their presence is kept (saved, they stayed alive until the backward, and an in-place change
    // of them, which F.linear(x, w) + r allows, made it fail).
    save_inputs(ctx, {x, weight});
    ctx->saved_data["has_bias"] = present(bias);
    ctx->saved_data["has_residual"] = present(residual);
    ctx->saved_data["input_activation"] = std::string(input_activation);
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return handles::linear().call(x, weight, bias, residual, input_activation);
  }

  // The gradients are matmuls of the saved inputs, with no recompute of the forward. x's is
  // mirage::linear itself, grad @ weight with weight^T passed as a column-major weight: PyTorch's
  // cuBLAS matmul took 52 us at [12, 384] x [384, 128] in float32 on an H200 (a PaiNN's forces on
  // benzene), mirage::linear 3.4 us (docs/perf/forcefield.md). Every gradient is computed with
  // differentiable ops (mirage::linear through the dispatcher, autograd included), so double
  // backward works; an input activation is differentiated as its composite.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list grads(5);
    const at::Tensor& grad = grad_outputs[0];
    if (!grad.defined()) return grads;
    const variable_list saved = saved_tensors(ctx);
    // What this backward pass asks for (forces want x's gradient only, not the parameters' that
    // require grad too). Absent optional inputs have no edge: the edges number the given tensors.
    const bool given[4] = {true, true, ctx->saved_data["has_bias"].toBool(), ctx->saved_data["has_residual"].toBool()};
    bool needs[4];
    for (size_t i = 0, edge = 0; i < 4; ++i) needs[i] = given[i] && ctx->needs_input_grad(edge++);
    const std::string activation = ctx->saved_data["input_activation"].toStringRef();
    const bool create_graph = at::GradMode::is_enabled();
    // [*, F] as [rows, F], without reading sizes (symbolic under torch.compile's dynamic shapes).
    const auto rows = [](const at::Tensor& t) { return t.dim() == 1 ? t.unsqueeze(0) : t.flatten(0, -2); };
    if (needs[3]) grads[3] = grad;
    if (needs[2]) grads[2] = rows(grad).sum(0);
    if (!needs[0] && !needs[1]) return grads;
    at::Tensor x = saved[0], activated = saved[0];
    if (activation != "none") {
      const at::AutoGradMode enable_grad(true);
      if (!create_graph) x = x.detach().requires_grad_(needs[0]);
      activated = ops::apply_activation(x, activation);
    }
    if (needs[1]) grads[1] = at::mm(rows(grad).t(), rows(activated));
    if (needs[0]) {
      grads[0] = handles::linear().call(grad, saved[1].t(), std::nullopt, std::nullopt, "none");
      if (activation != "none")
        grads[0] = torch::autograd::grad({activated}, {x}, {grads[0]}, /*retain_graph=*/create_graph,
                                         /*create_graph=*/create_graph)[0];
    }
    return grads;
  }
};

struct SubpixelShuffleFunction : torch::autograd::Function<SubpixelShuffleFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
    save_inputs(ctx, {x, value_or_undefined(bias)}, {false, false});  // linear in both
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return handles::subpixel_shuffle().call(x, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    return composite_backward(ctx, grad_outputs, [](const variable_list& in) {
      return variable_list{ops::subpixel_shuffle_composite(in[0], in[1])};
    });
  }
};

// The inverse of [..., 3, 3] cells (rows are lattice vectors) from cross products: column k is
// (a_{k+1} x a_{k+2}) / det. No solver, so no host sync checking for singular input (forces are
// captured in CUDA graphs).
at::Tensor inverse_3x3(const at::Tensor& cell) {
  const at::Tensor a0 = cell.select(-2, 0), a1 = cell.select(-2, 1), a2 = cell.select(-2, 2);
  const at::Tensor columns =
      at::stack({at::linalg_cross(a1, a2), at::linalg_cross(a2, a0), at::linalg_cross(a0, a1)}, -1);
  const at::Tensor det = (a0 * columns.select(-1, 0)).sum(-1);
  return columns / det.unsqueeze(-1).unsqueeze(-1);
}

// mirage::neighbor_list's float outputs as PyTorch ops, differentiable in positions and cell:
// shift = S @ cell with the integer images S recovered from the kernel's shifts (S = shift @
// cell^-1, rounded), distance = |r_j - r_i + shift|. Entries past num_pairs (padding, or all of
// them for invalid input) keep their constant shift and distance, with zero gradient.
variable_list neighbor_list_composite(const at::Tensor& positions, const at::Tensor& cell,
                                      const at::Tensor& batch, const at::Tensor& pairs,
                                      const at::Tensor& shifts, const at::Tensor& num_pairs,
                                      double cutoff) {
  const at::Tensor constant_shift = shifts.detach();
  const at::Tensor distances = at::full({pairs.size(1)}, cutoff, shifts.options());
  if (positions.size(0) == 0) return {pairs, constant_shift, distances, num_pairs};
  const at::Tensor valid = at::arange(pairs.size(1), num_pairs.options()) < num_pairs;  // [P]
  at::Tensor shift = constant_shift;
  if (cell.defined()) {
    // [3, 3], or with batch one cell per pair: [P, 3, 3].
    const at::Tensor pair_cell =
        cell.dim() == 3 ? cell.index_select(0, batch.index_select(0, pairs[0])) : cell;
    const at::Tensor images =
        at::round(at::matmul(constant_shift.unsqueeze(-2), inverse_3x3(pair_cell.detach())));
    shift = at::where(valid.unsqueeze(-1), at::matmul(images, pair_cell).squeeze(-2), constant_shift);
  }
  const at::Tensor vec =
      positions.index_select(0, pairs[1]) - positions.index_select(0, pairs[0]) + shift;
  return {pairs, shift, at::where(valid, at::linalg_vector_norm(vec, 2, -1), distances), num_pairs};
}

struct NeighborListFunction : torch::autograd::Function<NeighborListFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& positions, double cutoff,
                               const std::optional<at::Tensor>& cell,
                               const std::optional<at::Tensor>& pbc,
                               const std::optional<at::Tensor>& batch, int64_t max_pairs, bool half,
                               c10::string_view method) {
    at::Tensor pairs, shifts, distances, num_pairs;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(pairs, shifts, distances, num_pairs) =
          handles::neighbor_list().call(positions, cutoff, cell, pbc, batch, max_pairs, half, method);
    }
    const at::Tensor cell_or_undefined = value_or_undefined(cell);
    save_inputs(ctx, {positions, cell_or_undefined, value_or_undefined(batch), pairs, shifts, num_pairs});
    ctx->saved_data["cutoff"] = cutoff;
    // Without a cell that requires grad the shifts are constants (zero, padding, or images of a
    // constant cell): no graph behind them.
    if (cell_or_undefined.defined() && cell_or_undefined.requires_grad()) {
      ctx->mark_non_differentiable({pairs, num_pairs});
    } else {
      ctx->mark_non_differentiable({pairs, shifts, num_pairs});
    }
    return {pairs, shifts, distances, num_pairs};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const double cutoff = ctx->saved_data["cutoff"].toDouble();
    const variable_list grads = composite_backward(ctx, grad_outputs, [&](const variable_list& in) {
      return neighbor_list_composite(in[0], in[1], in[2], in[3], in[4], in[5], cutoff);
    });
    return {grads[0], at::Tensor(), grads[1], at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// mirage::radial_basis as PyTorch ops (float32 inside for float16/bfloat16 distances). sin(x)/x
// switches to its Taylor series below |x| = 0.1 as the kernels do, with x replaced by 1 in the
// unused branch, so that no derivative of any order divides by zero at d = 0.
at::Tensor radial_basis_composite(const at::Tensor& distances, const std::string& kind, int64_t num,
                                  double cutoff, const std::string& cutoff_fn) {
  const at::Tensor d = to_compute_dtype(distances).unsqueeze(-1);
  at::Tensor out;
  if (kind == "none") {  // cos(0 d): 1, and NaN in value and every derivative at NaN and infinite d, as the kernels
    std::vector<int64_t> shape = d.sizes().vec();
    shape.back() = num;
    out = at::cos(d * 0).expand(shape);
  } else if (kind == "gaussian") {
    const double spacing = num > 1 ? cutoff / static_cast<double>(num - 1) : cutoff;
    const at::Tensor z = (d - at::arange(num, d.options()) * spacing) / spacing;
    out = at::exp(-0.5 * z * z);
  } else {
    const at::Tensor frequency = at::arange(1, num + 1, d.options()) * (M_PI / cutoff);
    const at::Tensor x = d * frequency;
    const at::Tensor small = x.abs() < 0.1;
    const at::Tensor safe_x = at::where(small, at::ones_like(x), x);
    const at::Tensor x2 = x * x;
    const at::Tensor series = 1 - x2 / 6 * (1 - x2 / 20 * (1 - x2 / 42 * (1 - x2 / 72)));
    out = std::sqrt(2.0 / cutoff) * frequency * at::where(small, series, at::sin(safe_x) / safe_x);
  }
  if (cutoff_fn == "cosine") {
    out = out * at::where(d < cutoff, 0.5 * (at::cos(d * (M_PI / cutoff)) + 1), 0.0);
  } else if (cutoff_fn == "polynomial") {
    const at::Tensor x = d / cutoff;
    out = out * at::where(d < cutoff, 1 + at::pow(x, 6) * (-28 + x * (48 - 21 * x)), 0.0);
  }
  return out.to(distances.scalar_type());
}

// radial_basis_backward as PyTorch ops: autograd of the composite above, with a graph
// (create_graph), so that it is differentiable in grad and distances in turn. distances is made a
// leaf of its own where it does not require grad (only grad's gradient is wanted).
at::Tensor radial_basis_backward_composite(const at::Tensor& grad, const at::Tensor& distances,
                                           const std::string& kind, int64_t num, double cutoff,
                                           const std::string& cutoff_fn) {
  const at::Tensor d = distances.requires_grad() ? distances : distances.detach().requires_grad_();
  const at::Tensor out = radial_basis_composite(d, kind, num, cutoff, cutoff_fn);
  return torch::autograd::grad({out}, {d}, {grad}, /*retain_graph=*/true, /*create_graph=*/true)[0];
}

// The op's parameters, saved beside the tensors by both autograd Functions below.
void save_radial_basis_parameters(AutogradContext* ctx, c10::string_view kind, int64_t num,
                                  double cutoff, c10::string_view cutoff_fn) {
  ctx->saved_data["kind"] = std::string(kind);
  ctx->saved_data["num"] = num;
  ctx->saved_data["cutoff"] = cutoff;
  ctx->saved_data["cutoff_fn"] = std::string(cutoff_fn);
}

// The forces' hot path: first-order gradients run the fused mirage::radial_basis_backward (one
// kernel, no recompute); only its own backward (double backward) recomputes with the composite.
struct RadialBasisBackwardFunction : torch::autograd::Function<RadialBasisBackwardFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad,
                            const at::Tensor& distances, c10::string_view kind, int64_t num,
                            double cutoff, c10::string_view cutoff_fn) {
    save_inputs(ctx, {grad, distances});
    save_radial_basis_parameters(ctx, kind, num, cutoff, cutoff_fn);
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return handles::radial_basis_backward().call(grad, distances, kind, num, cutoff, cutoff_fn);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const std::string kind = ctx->saved_data["kind"].toStringRef();
    const int64_t num = ctx->saved_data["num"].toInt();
    const double cutoff = ctx->saved_data["cutoff"].toDouble();
    const std::string cutoff_fn = ctx->saved_data["cutoff_fn"].toStringRef();
    const variable_list grads = composite_backward(ctx, grad_outputs, [&](const variable_list& in) {
      return variable_list{radial_basis_backward_composite(in[0], in[1], kind, num, cutoff, cutoff_fn)};
    });
    return {grads[0], grads[1], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct RadialBasisFunction : torch::autograd::Function<RadialBasisFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& distances, c10::string_view kind,
                            int64_t num, double cutoff, c10::string_view cutoff_fn) {
    save_for_backward(ctx, {distances});
    save_radial_basis_parameters(ctx, kind, num, cutoff, cutoff_fn);
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return handles::radial_basis().call(distances, kind, num, cutoff, cutoff_fn);
  }

  // Undefined output gradients arrive as zeros (materialized), so the fused op always runs.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor distances = saved_tensors(ctx)[0];
    // Through the dispatcher's Autograd key: with create_graph the call is recorded for double
    // backward.
    const at::Tensor grad_distances = handles::radial_basis_backward().call(
        grad_outputs[0], distances, ctx->saved_data["kind"].toStringRef(),
        ctx->saved_data["num"].toInt(), ctx->saved_data["cutoff"].toDouble(),
        ctx->saved_data["cutoff_fn"].toStringRef());
    return {grad_distances, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// pairs[0] receives, pairs[1] sends; the transposed scatter swaps them.
at::Tensor swapped(const at::Tensor& pairs) { return pairs.flip(0); }

struct MessagePassingFunction : torch::autograd::Function<MessagePassingFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& filter,
                            const at::Tensor& pairs) {
    save_for_backward(ctx, {x, filter, pairs});
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return handles::message_passing().call(x, filter, pairs);
  }

  // grad_x[n] = sum over p with j_p == n of g[i_p] * filter[p]; grad_filter[p] = g[i_p] * x[j_p].
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = saved_tensors(ctx);
    const at::Tensor& grad = grad_outputs[0];
    at::Tensor grad_x, grad_filter;
    if (grad.defined()) {
      if (ctx->needs_input_grad(0))
        grad_x = handles::message_passing().call(grad, saved[1], swapped(saved[2]));
      if (ctx->needs_input_grad(1)) grad_filter = handles::pair_product().call(grad, saved[0], saved[2]);
    }
    return {grad_x, grad_filter, at::Tensor()};
  }
};

struct PairProductFunction : torch::autograd::Function<PairProductFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor& pairs) {
    save_for_backward(ctx, {a, b, pairs});
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return handles::pair_product().call(a, b, pairs);
  }

  // grad_a[n] = sum over p with i_p == n of g[p] * b[j_p]; grad_b[n] likewise over j_p == n.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = saved_tensors(ctx);
    const at::Tensor& grad = grad_outputs[0];
    at::Tensor grad_a, grad_b;
    if (grad.defined()) {
      if (ctx->needs_input_grad(0)) grad_a = handles::message_passing().call(saved[1], grad, saved[2]);
      if (ctx->needs_input_grad(1))
        grad_b = handles::message_passing().call(saved[0], grad, swapped(saved[2]));
    }
    return {grad_a, grad_b, at::Tensor()};
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

at::Tensor bias_act_autograd(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& residual, c10::string_view activation,
                             double scale) {
  return BiasActFunction::apply(x, bias, residual, activation, scale);
}

at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& residual, c10::string_view input_activation) {
  return LinearFunction::apply(x, weight, bias, residual, input_activation);
}

at::Tensor subpixel_shuffle_autograd(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  return SubpixelShuffleFunction::apply(x, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> neighbor_list_autograd(
    const at::Tensor& positions, double cutoff, const std::optional<at::Tensor>& cell,
    const std::optional<at::Tensor>& pbc, const std::optional<at::Tensor>& batch,
    int64_t max_pairs, bool half, c10::string_view method) {
  const variable_list out =
      NeighborListFunction::apply(positions, cutoff, cell, pbc, batch, max_pairs, half, method);
  return {out[0], out[1], out[2], out[3]};
}

at::Tensor radial_basis_autograd(const at::Tensor& distances, c10::string_view kind, int64_t num,
                                 double cutoff, c10::string_view cutoff_fn) {
  return RadialBasisFunction::apply(distances, kind, num, cutoff, cutoff_fn);
}

at::Tensor radial_basis_backward_autograd(const at::Tensor& grad, const at::Tensor& distances,
                                          c10::string_view kind, int64_t num, double cutoff,
                                          c10::string_view cutoff_fn) {
  return RadialBasisBackwardFunction::apply(grad, distances, kind, num, cutoff, cutoff_fn);
}

at::Tensor message_passing_autograd(const at::Tensor& x, const at::Tensor& filter,
                                   const at::Tensor& pairs) {
  return MessagePassingFunction::apply(x, filter, pairs);
}

at::Tensor pair_product_autograd(const at::Tensor& a, const at::Tensor& b, const at::Tensor& pairs) {
  return PairProductFunction::apply(a, b, pairs);
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, Autograd, m) {
  m.impl("group_norm", given<&handles::group_norm, &group_norm_autograd>);
  m.impl("layer_norm", given<&handles::layer_norm, &layer_norm_autograd>);
  m.impl("add_layer_norm", given<&handles::add_layer_norm, &add_layer_norm_autograd>);
  m.impl("geglu", given<&handles::geglu, &geglu_autograd>);
  m.impl("bias_act", given<&handles::bias_act, &bias_act_autograd>);
  m.impl("linear", given<&handles::linear, &linear_autograd>);
  m.impl("subpixel_shuffle", given<&handles::subpixel_shuffle, &subpixel_shuffle_autograd>);
  m.impl("neighbor_list", given<&handles::neighbor_list, &neighbor_list_autograd>);
  m.impl("radial_basis", given<&handles::radial_basis, &radial_basis_autograd>);
  m.impl("radial_basis_backward", given<&handles::radial_basis_backward, &radial_basis_backward_autograd>);
  m.impl("message_passing", given<&handles::message_passing, &message_passing_autograd>);
  m.impl("pair_product", given<&handles::pair_product, &pair_product_autograd>);
}

// mirage::vector_message_passing. Its backward is a fused op of its own (forces are this
// gradient, so it must not cost a composite recompute); that op's backward in turn recomputes
// the gradient formulas below with PyTorch ops, which gives double backward (force training).
// With filter_weight the fused ops form the filter from the basis, and the backward op returns
// the basis' gradient; where the weight's gradient is wanted, the formed filter's gradient is
// taken instead (the op on a filter formed by a PyTorch product) and both are products of it.
namespace {

// The gradients of vector_message_passing (docs/ops.md) as differentiable PyTorch ops, float32
// inside for float16/bfloat16. Per pair p = (i, j), with m = x[j] * filter[p] = (m_s, m_vv, m_vs):
// dL/dm_s = grad_scalar[i], dL/dm_vv = sum_c grad_vector[i, c] * vectors[j, c],
// dL/dm_vs = sum_c grad_vector[i, c] * directions[p, c].
// in = (grad_scalar, grad_vector, x, filter, vectors, directions, pairs, filter_weight,
// sender_order, num_pairs). With num_pairs every per-pair input of the padding (indices, filter,
// directions) is replaced by zeros (node 0) on the device, as the fused op skips those pairs: each
// of their terms is then an exact 0, whatever the padding held (NaN, indices out of range).
variable_list vector_message_passing_backward_composite(const variable_list& in) {
  const at::Tensor& x = in[2];
  const at::Tensor& pairs = in[6];
  const at::Tensor keep = in[9].defined() ? ops::walked_mask(in[9], pairs.size(1)) : at::Tensor();
  const auto counted = [&keep](const at::Tensor& per_pair) {
    if (!keep.defined()) return per_pair;
    std::vector<int64_t> shape(per_pair.dim(), 1);
    shape[0] = -1;
    return at::where(keep.view(shape), per_pair, at::zeros({}, per_pair.options()));
  };
  const at::Tensor i = counted(pairs.select(0, 0)), j = counted(pairs.select(0, 1));
  const int64_t nodes = x.size(0), features = x.size(1) / 3;
  const at::Tensor x_j = to_compute_dtype(x).index_select(0, j);
  // The padding's basis rows out before the filter is formed: 0 * NaN in its product with the
  // weight would reach the weight's gradient.
  const at::Tensor filter = to_compute_dtype(ops::formed_filter(counted(in[3]), defined_or_none(in[7])));
  const at::Tensor grad_scalar_i = counted(to_compute_dtype(in[0]).index_select(0, i));
  const at::Tensor grad_vector_i = counted(to_compute_dtype(in[1]).index_select(0, i));  // [P, 3, F]
  const at::Tensor vectors_j = to_compute_dtype(in[4]).index_select(0, j);
  const at::Tensor directions = counted(to_compute_dtype(in[5]));
  const at::Tensor grad_m = at::cat({grad_scalar_i, (grad_vector_i * vectors_j).sum(1),
                                     (grad_vector_i * directions.unsqueeze(-1)).sum(1)},
                                    -1);  // [P, 3F]
  const at::Tensor m = x_j * filter;
  const at::Tensor m_vv = m.narrow(-1, features, features).unsqueeze(1);
  const at::Tensor m_vs = m.narrow(-1, 2 * features, features).unsqueeze(1);
  const at::Tensor grad_x =
      at::zeros({nodes, 3 * features}, filter.options()).index_add(0, j, grad_m * filter);
  const at::Tensor grad_vectors =
      at::zeros({nodes, 3, features}, filter.options()).index_add(0, j, grad_vector_i * m_vv);
  // The filter argument's gradient: the formed filter's, or with filter_weight the basis'.
  at::Tensor grad_filter = grad_m * x_j;
  if (in[7].defined()) grad_filter = grad_filter.matmul(to_compute_dtype(in[7]));
  const auto dtype = x.scalar_type();
  return {grad_x.to(dtype), grad_filter.to(dtype), grad_vectors.to(dtype),
          (grad_vector_i * m_vs).sum(-1).to(dtype)};
}

struct VectorMessagePassingBackwardFunction
    : torch::autograd::Function<VectorMessagePassingBackwardFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad_scalar,
                               const at::Tensor& grad_vector, const at::Tensor& x,
                               const at::Tensor& filter, const at::Tensor& vectors,
                               const at::Tensor& directions, const at::Tensor& pairs,
                               const std::optional<at::Tensor>& filter_weight,
                               const std::optional<at::Tensor>& sender_order,
                               const std::optional<at::Tensor>& num_pairs) {
    save_inputs(ctx, {grad_scalar, grad_vector, x, filter, vectors, directions, pairs,
                      value_or_undefined(filter_weight), value_or_undefined(sender_order),
                      value_or_undefined(num_pairs)});
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_x, grad_filter, grad_vectors, grad_directions] = handles::vector_message_passing_backward().call(
        grad_scalar, grad_vector, x, filter, vectors, directions, pairs, filter_weight, sender_order, num_pairs);
    return {grad_x, grad_filter, grad_vectors, grad_directions};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list grads =
        composite_backward(ctx, grad_outputs, &vector_message_passing_backward_composite);
    grads[6] = at::Tensor();
    return grads;
  }
};

struct VectorMessagePassingFunction : torch::autograd::Function<VectorMessagePassingFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& filter,
                               const at::Tensor& vectors, const at::Tensor& directions,
                               const at::Tensor& pairs, const std::optional<at::Tensor>& filter_weight,
                               const std::optional<at::Tensor>& sender_order,
                               const std::optional<at::Tensor>& num_pairs) {
    save_for_backward(ctx, {x, filter, vectors, directions, pairs, value_or_undefined(filter_weight),
                            value_or_undefined(sender_order), value_or_undefined(num_pairs)});
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [scalar, vector] = handles::vector_message_passing().call(x, filter, vectors, directions, pairs,
                                                                   filter_weight, sender_order, num_pairs);
    return {scalar, vector};
  }

  // Undefined output gradients arrive as zeros (materialized), so the fused op always runs.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = saved_tensors(ctx);
    at::Tensor basis = saved[1];
    const at::Tensor& weight = saved[5];
    std::optional<at::Tensor> fused_weight;
    at::Tensor filter = basis;
    if (weight.defined()) {
      // For forces alone the fused op forms the filter and returns the basis' gradient itself (on
      // tensor cores where it can). The weight's gradient needs the formed filter's, and double
      // backward a differentiable filter: there the filter is a PyTorch product of the two, of a
      // basis without the padding's rows (past num_pairs, which the op skips whatever they hold:
      // a NaN there made the weight's whole gradient NaN through 0 * NaN).
      if (at::GradMode::is_enabled() || ctx->needs_input_grad(5)) {
        if (saved[7].defined())
          basis = at::where(ops::walked_mask(saved[7], basis.size(0)).unsqueeze(-1), basis,
                            at::zeros({}, basis.options()));
        filter = ops::formed_filter(basis, weight);
      } else {
        fused_weight = weight;
      }
    }
    // Through the dispatcher's Autograd key: with create_graph the call is recorded for double
    // backward.
    auto [grad_x, grad_filter, grad_vectors, grad_directions] =
        handles::vector_message_passing_backward().call(grad_outputs[0], grad_outputs[1], saved[0], filter,
                                                        saved[2], saved[3], saved[4], fused_weight,
                                                        defined_or_none(saved[6]), defined_or_none(saved[7]));
    if (!weight.defined() || fused_weight.has_value()) {  // grad_filter: the filter argument's (the basis')
      return {grad_x, grad_filter, grad_vectors, grad_directions, at::Tensor(), at::Tensor(), at::Tensor(),
              at::Tensor()};
    }
    // grad_filter @ weight by mirage::linear: its narrow kernel takes these [P, 3F] x [3F, K]
    // products of many pairs (cuBLAS's float32 kernels ran them at a quarter of the FMA rate).
    const at::Tensor grad_basis =
        ctx->needs_input_grad(1)
            ? handles::linear().call(grad_filter, weight.t(), std::nullopt, std::nullopt, "none")
            : at::Tensor();
    const at::Tensor grad_weight = ctx->needs_input_grad(5) ? grad_filter.t().matmul(basis) : at::Tensor();
    return {grad_x, grad_basis, grad_vectors, grad_directions, at::Tensor(), grad_weight, at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> vector_message_passing_autograd(
    const at::Tensor& x, const at::Tensor& filter, const at::Tensor& vectors, const at::Tensor& directions,
    const at::Tensor& pairs, const std::optional<at::Tensor>& filter_weight,
    const std::optional<at::Tensor>& sender_order, const std::optional<at::Tensor>& num_pairs) {
  const variable_list out = VectorMessagePassingFunction::apply(x, filter, vectors, directions, pairs, filter_weight,
                                                                sender_order, num_pairs);
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> vector_message_passing_backward_autograd(
    const at::Tensor& grad_scalar, const at::Tensor& grad_vector, const at::Tensor& x,
    const at::Tensor& filter, const at::Tensor& vectors, const at::Tensor& directions,
    const at::Tensor& pairs, const std::optional<at::Tensor>& filter_weight,
    const std::optional<at::Tensor>& sender_order, const std::optional<at::Tensor>& num_pairs) {
  const variable_list out = VectorMessagePassingBackwardFunction::apply(
      grad_scalar, grad_vector, x, filter, vectors, directions, pairs, filter_weight, sender_order, num_pairs);
  return {out[0], out[1], out[2], out[3]};
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, Autograd, m) {
  m.impl("vector_message_passing", given<&handles::vector_message_passing, &vector_message_passing_autograd>);
  m.impl("vector_message_passing_backward",
         given<&handles::vector_message_passing_backward, &vector_message_passing_backward_autograd>);
}

// mirage::pair_vectors. Its gradient in the positions is a fused op of its own (a scatter onto
// the atoms, the forces' last step); that op's backward recomputes it with PyTorch ops, which
// gives double backward. The shifts' gradient (the stress path only) is PyTorch ops too.
namespace {

// (vectors, distances) and the gradient of the pair vectors they imply, g = grad_vectors +
// grad_distances * vectors / distances (0 where d = 0, as PyTorch's vector_norm), as PyTorch ops.
// An undefined gradient adds nothing (as in PyTorch, where it never reaches the norm).
at::Tensor pair_vector_gradient(const at::Tensor& grad_vectors, const at::Tensor& grad_distances,
                                const at::Tensor& vectors) {
  if (!grad_distances.defined()) return grad_vectors.defined() ? grad_vectors : at::zeros_like(vectors);
  const at::Tensor d = at::linalg_vector_norm(vectors, 2, {-1});
  const at::Tensor nonzero = d != 0;  // NaN too: it passes NaN on, as PyTorch's norm
  const at::Tensor radial = at::where(nonzero, grad_distances / at::where(nonzero, d, at::ones_like(d)), 0);
  const at::Tensor g = radial.unsqueeze(-1) * vectors;
  return grad_vectors.defined() ? grad_vectors + g : g;
}

at::Tensor pair_vectors_composite(const at::Tensor& positions, const at::Tensor& pairs, const at::Tensor& shifts) {
  const at::Tensor v = positions.index_select(0, pairs.select(0, 1)) - positions.index_select(0, pairs.select(0, 0));
  return shifts.defined() ? v + shifts : v;
}

// in = (grad_vectors, grad_distances, positions, pairs, shifts, sender_order); either gradient may
// be undefined (zero).
variable_list pair_vectors_backward_composite(const variable_list& in) {
  const at::Tensor& pairs = in[3];
  const at::Tensor g = pair_vector_gradient(in[0], in[1], pair_vectors_composite(in[2], pairs, in[4]));
  return {at::zeros_like(in[2]).index_add(0, pairs.select(0, 1), g).index_add(0, pairs.select(0, 0), -g)};
}

struct PairVectorsBackwardFunction : torch::autograd::Function<PairVectorsBackwardFunction> {
  static at::Tensor forward(AutogradContext* ctx, const std::optional<at::Tensor>& grad_vectors,
                            const std::optional<at::Tensor>& grad_distances, const at::Tensor& positions,
                            const at::Tensor& pairs, const std::optional<at::Tensor>& shifts,
                            const std::optional<at::Tensor>& sender_order) {
    save_inputs(ctx, {value_or_undefined(grad_vectors), value_or_undefined(grad_distances), positions, pairs,
                      value_or_undefined(shifts), value_or_undefined(sender_order)});
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return handles::pair_vectors_backward().call(grad_vectors, grad_distances, positions, pairs, shifts,
                                                 sender_order);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list grads = composite_backward(ctx, grad_outputs, &pair_vectors_backward_composite);
    grads[3] = at::Tensor();
    return grads;
  }
};

struct PairVectorsFunction : torch::autograd::Function<PairVectorsFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& positions, const at::Tensor& pairs,
                               const std::optional<at::Tensor>& shifts,
                               const std::optional<at::Tensor>& sender_order) {
    save_for_backward(ctx, {positions, pairs, value_or_undefined(shifts), value_or_undefined(sender_order)});
    // An output the energy does not use (the distances, for a model that reads only the vectors)
    // has an undefined gradient, which the fused op takes as zero: no tensor of zeros is filled.
    ctx->set_materialize_grads(false);
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [vectors, distances] = handles::pair_vectors().call(positions, pairs, shifts, sender_order);
    return {vectors, distances};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    if (!grad_outputs[0].defined() && !grad_outputs[1].defined()) return variable_list(4);
    const variable_list saved = saved_tensors(ctx);
    const at::Tensor &positions = saved[0], &pairs = saved[1], &shifts = saved[2];
    at::Tensor grad_positions, grad_shifts;
    if (ctx->needs_input_grad(0)) {
      // Through the dispatcher's Autograd key: with create_graph the call is recorded for double
      // backward.
      grad_positions = handles::pair_vectors_backward().call(defined_or_none(grad_outputs[0]),
                                                             defined_or_none(grad_outputs[1]), positions, pairs,
                                                             defined_or_none(shifts), defined_or_none(saved[3]));
    }
    if (shifts.defined() && ctx->needs_input_grad(2)) {  // the vectors are formed again only if needed
      grad_shifts = grad_outputs[1].defined() ? pair_vector_gradient(grad_outputs[0], grad_outputs[1],
                                                                     pair_vectors_composite(positions, pairs, shifts))
                                              : grad_outputs[0];
    }
    return {grad_positions, at::Tensor(), grad_shifts, at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> pair_vectors_autograd(const at::Tensor& positions, const at::Tensor& pairs,
                                                         const std::optional<at::Tensor>& shifts,
                                                         const std::optional<at::Tensor>& sender_order) {
  const variable_list out = PairVectorsFunction::apply(positions, pairs, shifts, sender_order);
  return {out[0], out[1]};
}

at::Tensor pair_vectors_backward_autograd(const std::optional<at::Tensor>& grad_vectors,
                                          const std::optional<at::Tensor>& grad_distances,
                                          const at::Tensor& positions, const at::Tensor& pairs,
                                          const std::optional<at::Tensor>& shifts,
                                          const std::optional<at::Tensor>& sender_order) {
  return PairVectorsBackwardFunction::apply(grad_vectors, grad_distances, positions, pairs, shifts, sender_order);
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, Autograd, m) {
  m.impl("pair_vectors", given<&handles::pair_vectors, &pair_vectors_autograd>);
  m.impl("pair_vectors_backward", given<&handles::pair_vectors_backward, &pair_vectors_backward_autograd>);
}

// mirage::painn_update_input and mirage::painn_update. Each one's backward is a fused op of its
// own (forces run through both); that op's backward recomputes its formulas with PyTorch ops,
// which gives double backward. The gradients in s and v are the incoming ones, passed through.
namespace {

// vv's gradient of painn_update_input: grad_norm * vv / norm. in = (grad, vv).
variable_list painn_update_input_backward_composite(const variable_list& in, double eps) {
  const at::Tensor grad_norm = to_compute_dtype(in[0]).chunk(2, 1)[1];
  const at::Tensor vv = to_compute_dtype(in[1]);
  const at::Tensor norm = (vv.square().sum(1) + eps).sqrt();
  return {((grad_norm / norm).unsqueeze(1) * vv).to(in[1].scalar_type())};
}

struct PainnUpdateInputBackwardFunction : torch::autograd::Function<PainnUpdateInputBackwardFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad, const at::Tensor& vv,
                            double eps) {
    save_inputs(ctx, {grad, vv});
    ctx->saved_data["eps"] = eps;
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return handles::painn_update_input_backward().call(grad, vv, eps);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const double eps = ctx->saved_data["eps"].toDouble();
    variable_list grads = composite_backward(
        ctx, grad_outputs, [eps](const variable_list& in) { return painn_update_input_backward_composite(in, eps); });
    grads.push_back(at::Tensor());
    return grads;
  }
};

struct PainnUpdateInputFunction : torch::autograd::Function<PainnUpdateInputFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& s, const at::Tensor& vv, double eps) {
    save_for_backward(ctx, {vv});
    ctx->saved_data["eps"] = eps;
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return handles::painn_update_input().call(s, vv, eps);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& grad = grad_outputs[0];
    const at::Tensor vv = saved_tensors(ctx)[0];
    // Through the dispatcher's Autograd key: with create_graph the call is recorded for double
    // backward. s's gradient is the first half of grad, a view (chunk: no sizes read, so the
    // formula stays symbolic under torch.compile).
    return {grad.chunk(2, 1)[0],
            handles::painn_update_input_backward().call(grad, vv, ctx->saved_data["eps"].toDouble()),
            at::Tensor()};
  }
};

// The gradients in uv, vv and a of painn_update. in = (grad_s, grad_v, uv, vv, a).
variable_list painn_update_backward_composite(const variable_list& in) {
  const at::Tensor grad_s = to_compute_dtype(in[0]), grad_v = to_compute_dtype(in[1]);
  const at::Tensor uv = to_compute_dtype(in[2]), vv = to_compute_dtype(in[3]);
  const std::vector<at::Tensor> a = to_compute_dtype(in[4]).chunk(3, 1);  // a_vv, a_sv, a_ss
  const at::Tensor grad_dot = (grad_s * a[1]).unsqueeze(1);
  const auto dtype = in[0].scalar_type();
  return {(grad_v * a[0].unsqueeze(1) + grad_dot * vv).to(dtype), (grad_dot * uv).to(dtype),
          at::cat({(grad_v * uv).sum(1), grad_s * (uv * vv).sum(1), grad_s}, 1).to(dtype)};
}

struct PainnUpdateBackwardFunction : torch::autograd::Function<PainnUpdateBackwardFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad_s, const at::Tensor& grad_v,
                               const at::Tensor& uv, const at::Tensor& vv, const at::Tensor& a) {
    save_inputs(ctx, {grad_s, grad_v, uv, vv, a});
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_uv, grad_vv, grad_a] = handles::painn_update_backward().call(grad_s, grad_v, uv, vv, a);
    return {grad_uv, grad_vv, grad_a};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    return composite_backward(ctx, grad_outputs, &painn_update_backward_composite);
  }
};

struct PainnUpdateFunction : torch::autograd::Function<PainnUpdateFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& s, const at::Tensor& v,
                               const at::Tensor& uv, const at::Tensor& vv, const at::Tensor& a) {
    save_for_backward(ctx, {uv, vv, a});
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [s_out, v_out] = handles::painn_update().call(s, v, uv, vv, a);
    return {s_out, v_out};
  }

  // Undefined output gradients arrive as zeros (materialized), so the fused op always runs.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = saved_tensors(ctx);
    auto [grad_uv, grad_vv, grad_a] = handles::painn_update_backward().call(
        grad_outputs[0], grad_outputs[1], saved[0], saved[1], saved[2]);
    return {grad_outputs[0], grad_outputs[1], grad_uv, grad_vv, grad_a};
  }
};

at::Tensor painn_update_input_autograd(const at::Tensor& s, const at::Tensor& vv, double eps) {
  return PainnUpdateInputFunction::apply(s, vv, eps);
}

at::Tensor painn_update_input_backward_autograd(const at::Tensor& grad, const at::Tensor& vv, double eps) {
  return PainnUpdateInputBackwardFunction::apply(grad, vv, eps);
}

std::tuple<at::Tensor, at::Tensor> painn_update_autograd(const at::Tensor& s, const at::Tensor& v,
                                                         const at::Tensor& uv, const at::Tensor& vv,
                                                         const at::Tensor& a) {
  const variable_list out = PainnUpdateFunction::apply(s, v, uv, vv, a);
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> painn_update_backward_autograd(
    const at::Tensor& grad_s, const at::Tensor& grad_v, const at::Tensor& uv, const at::Tensor& vv,
    const at::Tensor& a) {
  const variable_list out = PainnUpdateBackwardFunction::apply(grad_s, grad_v, uv, vv, a);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, Autograd, m) {
  m.impl("painn_update_input", given<&handles::painn_update_input, &painn_update_input_autograd>);
  m.impl("painn_update_input_backward",
         given<&handles::painn_update_input_backward, &painn_update_input_backward_autograd>);
  m.impl("painn_update", given<&handles::painn_update, &painn_update_autograd>);
  m.impl("painn_update_backward", given<&handles::painn_update_backward, &painn_update_backward_autograd>);
}

// mirage::schnet_energy and mirage::painn_energy compute the energy's gradient in the pair vectors
// with the energy (schnet_energy_all_pairs: in the positions), so their backward is one product
// (it serves forces, -dE/dr, and the stress).
// They have no gradient in the model's parameters and no double backward: training on forces
// takes the layer-by-layer path (mirage.ff.fused.SchNet and PaiNN in training mode). Asking for either
// is an error, never a silent zero.
namespace {

// The op's outputs: the energy, its gradient in the differentiable input, then any others.
using EnergyCall = std::function<variable_list()>;

struct EnergyFunction : torch::autograd::Function<EnergyFunction> {
  // `energy` runs the op (below autograd) on these tensors, `input` the one with a gradient (the
  // vectors or positions); `op` names it in errors.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& embedding,
                               at::TensorList weights, std::string_view op, const EnergyCall& energy_call) {
    variable_list out;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      out = energy_call();
    }
    save_for_backward(ctx, {out[1]});
    ctx->saved_data["parameters"] = static_cast<int64_t>(1 + weights.size());
    ctx->saved_data["op"] = std::string(op);
    ctx->mark_non_differentiable(variable_list(out.begin() + 1, out.end()));
    ctx->set_materialize_grads(false);  // the gradients' gradients: undefined, not fills of zeros
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const std::string op = ctx->saved_data["op"].toStringRef();
    MIRAGE_CHECK(!at::GradMode::is_enabled(), op,
                 ": double backward (create_graph=True, as training on forces needs) is not available; "
                 "put the model in training mode (model.train()) to take the layer-by-layer path");
    const int64_t parameters = ctx->saved_data["parameters"].toInt();
    for (int64_t k = 1; k <= parameters; ++k)
      MIRAGE_CHECK(!ctx->needs_input_grad(k), op,
                   ": no gradient in the model's parameters (embedding, weights); put the model in training "
                   "mode (model.train()) to take the layer-by-layer path");
    variable_list grads(parameters + 3);  // the input, the parameters, two non-tensors
    if (grad_outputs[0].defined()) grads[0] = grad_outputs[0] * saved_tensors(ctx)[0];
    return grads;
  }
};

ops::EnergyOutputs schnet_energy_autograd(const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                                          const at::Tensor& pairs, const at::Tensor& vectors, double cutoff,
                                          int64_t num_rbf, at::TensorList weights, c10::string_view activations,
                                          const std::optional<at::Tensor>& prepared) {
  // prepared is a function of the weights, whose gradient the op refuses: it needs none of its own.
  const variable_list out = EnergyFunction::apply(vectors, embedding, weights, ops::kSchnetEnergy, EnergyCall([&] {
    const auto [energy, grad_vectors, grad_positions] = handles::schnet_energy().call(
        atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights, activations, prepared);
    return variable_list{energy, grad_vectors, grad_positions};
  }));
  return {out[0], out[1], out[2]};
}

std::tuple<at::Tensor, at::Tensor> schnet_energy_all_pairs_autograd(
    const at::Tensor& atomic_numbers, const at::Tensor& embedding, const at::Tensor& positions, double cutoff,
    int64_t num_rbf, at::TensorList weights, c10::string_view activations, const std::optional<at::Tensor>& prepared,
    const std::optional<at::Tensor>& num_pairs) {
  const variable_list out =
      EnergyFunction::apply(positions, embedding, weights, ops::kSchnetEnergyAllPairs, EnergyCall([&] {
        const auto [energy, grad_positions] = handles::schnet_energy_all_pairs().call(
            atomic_numbers, embedding, positions, cutoff, num_rbf, weights, activations, prepared, num_pairs);
        return variable_list{energy, grad_positions};
      }));
  // The count was written below ADInplaceOrView, which would have bumped its version (as an
  // in-place op's output's): bumped here.
  if (present(num_pairs)) torch::autograd::impl::bump_version(*num_pairs);
  return {out[0], out[1]};
}

ops::EnergyOutputs painn_energy_autograd(const at::Tensor& atomic_numbers, const at::Tensor& embedding,
                                         const at::Tensor& pairs, const at::Tensor& vectors, double cutoff,
                                         int64_t num_rbf, at::TensorList weights, c10::string_view activations,
                                         double norm_eps) {
  const variable_list out = EnergyFunction::apply(vectors, embedding, weights, ops::kPainnEnergy, EnergyCall([&] {
    const auto [energy, grad_vectors, grad_positions] = handles::painn_energy().call(
        atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights, activations, norm_eps);
    return variable_list{energy, grad_vectors, grad_positions};
  }));
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, Autograd, m) {
  m.impl("schnet_energy", given<&handles::schnet_energy, &schnet_energy_autograd>);
  m.impl("schnet_energy_all_pairs", given<&handles::schnet_energy_all_pairs, &schnet_energy_all_pairs_autograd>);
  m.impl("painn_energy", given<&handles::painn_energy, &painn_energy_autograd>);
}

// mirage::cfconv: the gradients in x, basis and envelope come from the fused backward op, which
// reads the filters the forward returned. Like schnet_energy it serves forces (and stress) of a
// model in eval mode: no gradient in the filter network's parameters and no double backward
// (mirage.ff.fused.SchNet in training mode takes the layer-by-layer path); asking for either raises.
namespace {

// Absent biases travel through the autograd Function as empty tensors (its inputs must be defined);
// a present one has at least one element (checked).
at::Tensor or_empty(const std::optional<at::Tensor>& bias, const at::Tensor& like) {
  return present(bias) ? *bias : like.new_empty({0});
}

std::optional<at::Tensor> optional(const at::Tensor& bias) {
  return bias.sym_numel() != 0 ? std::optional<at::Tensor>(bias) : std::nullopt;  // symbolic under opcheck
}

// The contract of the filter-network ops' backwards: first order, and no gradient in the four
// parameters (weight1, bias1, weight2, bias2), the Function's inputs from `first_parameter` on.
void check_first_order(AutogradContext* ctx, std::string_view op, int first_parameter) {
  MIRAGE_CHECK(!at::GradMode::is_enabled(), op,
               ": double backward (create_graph=True, as training on forces needs) is not available; "
               "put the model in training mode (model.train()) or set mirage.ff.fused.SchNet.fused_interactions "
               "= False to take the layer-by-layer path");
  for (int k = first_parameter; k < first_parameter + 4; ++k)
    MIRAGE_CHECK(!ctx->needs_input_grad(k), op,
                 ": no gradient in the filter network's parameters (weight1, bias1, weight2, bias2); put the "
                 "model in training mode (model.train()) or set mirage.ff.fused.SchNet.fused_interactions = False "
                 "to take the layer-by-layer path");
}

struct CfconvFunction : torch::autograd::Function<CfconvFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& basis,
                               const at::Tensor& envelope, const at::Tensor& weight1, const at::Tensor& bias1,
                               const at::Tensor& weight2, const at::Tensor& bias2, const at::Tensor& pairs,
                               c10::string_view activation, bool tf32,
                               const std::optional<at::Tensor>& sender_order,
                               const std::optional<at::Tensor>& num_pairs) {
    at::Tensor out, filters;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, filters) = handles::cfconv().call(x, basis, envelope, pairs, weight1, optional(bias1), weight2,
                                                      optional(bias2), activation, tf32, sender_order, num_pairs);
    }
    save_for_backward(ctx, {x, basis, envelope, pairs, filters, weight1, bias1, weight2,
                            value_or_undefined(sender_order), value_or_undefined(num_pairs)});
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["tf32"] = tf32;
    ctx->mark_non_differentiable({filters});
    // The filters' gradient would otherwise arrive as a [P, M] tensor of zeros, written for
    // nothing (about 20 us an interaction at 3,000 atoms on an H200); an undefined one is skipped.
    ctx->set_materialize_grads(false);
    return {out, filters};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    check_first_order(ctx, ops::kCfconv, 3);
    // x, basis, envelope, four parameters, pairs, activation, tf32, sender_order, num_pairs
    variable_list grads(12);
    if (!grad_outputs[0].defined()) return grads;
    const variable_list s = saved_tensors(ctx);
    std::tie(grads[0], grads[1], grads[2]) = handles::cfconv_backward().call(
        grad_outputs[0], s[0], s[1], s[2], s[3], s[4], s[5], optional(s[6]), s[7],
        ctx->saved_data["activation"].toStringRef(), ctx->saved_data["tf32"].toBool(), defined_or_none(s[8]),
        defined_or_none(s[9]));
    return grads;
  }
};

std::tuple<at::Tensor, at::Tensor> cfconv_autograd(const at::Tensor& x, const at::Tensor& basis,
                                                   const at::Tensor& envelope, const at::Tensor& pairs,
                                                   const at::Tensor& weight1, const std::optional<at::Tensor>& bias1,
                                                   const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
                                                   c10::string_view activation, bool tf32,
                                                   const std::optional<at::Tensor>& sender_order,
                                                   const std::optional<at::Tensor>& num_pairs) {
  // Checked here first: past this point an empty bias would read as an absent one.
  ops::check_cfconv(ops::kCfconv, x, basis, envelope, pairs, weight1, bias1, weight2, bias2, activation,
                    sender_order, num_pairs);
  const variable_list out = CfconvFunction::apply(x, basis, envelope, weight1, or_empty(bias1, weight1), weight2,
                                                  or_empty(bias2, weight2), pairs, activation, tf32, sender_order,
                                                  num_pairs);
  return {out[0], out[1]};
}

}  // namespace

// mirage::radial_cfconv: gradients in x and the distances from the fused backward, which reads the
// table the forward returned; first order only and no gradient in the filter network's
// parameters, as cfconv.
namespace {

struct RadialCfconvFunction : torch::autograd::Function<RadialCfconvFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& distances,
                               const at::Tensor& weight1, const at::Tensor& bias1, const at::Tensor& weight2,
                               const at::Tensor& bias2, const at::Tensor& pairs, c10::string_view activation,
                               c10::string_view basis, double cutoff, c10::string_view envelope,
                               const std::optional<at::Tensor>& sender_order) {
    at::Tensor out, table;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, table) = handles::radial_cfconv().call(x, distances, pairs, weight1, optional(bias1), weight2,
                                                           optional(bias2), activation, basis, cutoff, envelope,
                                                           sender_order);
    }
    save_for_backward(ctx, {x, distances, pairs, table, value_or_undefined(sender_order)});
    ctx->saved_data["cutoff"] = cutoff;
    ctx->mark_non_differentiable({table});
    ctx->set_materialize_grads(false);  // as cfconv's: no zero gradient for the table
    return {out, table};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    check_first_order(ctx, ops::kRadialCfconv, 2);
    // x, distances, four parameters, pairs, activation, basis, cutoff, envelope, sender_order
    variable_list grads(12);
    if (!grad_outputs[0].defined()) return grads;
    const variable_list s = saved_tensors(ctx);
    std::tie(grads[0], grads[1]) = handles::radial_cfconv_backward().call(
        grad_outputs[0], s[0], s[1], s[2], s[3], ctx->saved_data["cutoff"].toDouble(), defined_or_none(s[4]));
    return grads;
  }
};

std::tuple<at::Tensor, at::Tensor> radial_cfconv_autograd(
    const at::Tensor& x, const at::Tensor& distances, const at::Tensor& pairs, const at::Tensor& weight1,
    const std::optional<at::Tensor>& bias1, const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
    c10::string_view activation, c10::string_view basis, double cutoff, c10::string_view envelope,
    const std::optional<at::Tensor>& sender_order) {
  // Checked here first: past this point an empty bias would read as an absent one.
  ops::check_radial_cfconv(x, distances, pairs, weight1, bias1, weight2, bias2, activation, basis, cutoff, envelope,
                           sender_order);
  const variable_list out =
      RadialCfconvFunction::apply(x, distances, weight1, or_empty(bias1, weight1), weight2, or_empty(bias2, weight2),
                                  pairs, activation, basis, cutoff, envelope, sender_order);
  return {out[0], out[1]};
}

// mirage::verlet_*: not differentiable (docs/ops.md). They write the MD state in place below
// autograd, so, as PyTorch's in-place ops do:
//  - under grad mode a written tensor that requires grad is refused by name (its graph would no
//    longer describe its values; PyTorch's own message named neither the op nor the argument, and
//    a non-leaf was overwritten with its stale history kept);
//  - each written tensor's version counter is bumped once: a graph that saved one of them refuses
//    to backpropagate through the overwritten value instead of reading the new one (the CUDA and
//    Meta kernels had bumped nothing).
// The read-only inputs (`grad`, `model_energy`, ...) are taken as constants: mirage.ff.md passes the
// model's energy, which requires grad.
using Written = std::initializer_list<std::pair<std::string_view, const at::Tensor*>>;

void refuse_gradients(std::string_view op, Written written) {
  if (!at::GradMode::is_enabled()) return;
  for (const auto& [name, t] : written)
    MIRAGE_CHECK(!(t->defined() && t->requires_grad()), op, ": ", name,
                 " requires grad, but it is written in place and the Verlet ops are not differentiable; pass it "
                 "detached, or call under torch.no_grad()");
}

void bump_versions(Written written) {
  for (const auto& [name, t] : written)
    if (t->defined()) torch::autograd::impl::bump_version(*t);
}

const at::Tensor* or_null(const std::optional<at::Tensor>& t) {
  static const at::Tensor undefined;
  return present(t) ? &*t : &undefined;
}

// The three ops' Autograd kernel: the refusal, `call` (the op below autograd), then the versions.
template <class Call>
auto written_in_place(std::string_view op, Written written, Call call) {
  refuse_gradients(op, written);
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  if constexpr (std::is_void_v<decltype(call())>) {
    call();
    bump_versions(written);
  } else {
    auto result = call();
    bump_versions(written);
    return result;
  }
}

at::Tensor verlet_kick_drift_autograd(at::Tensor& positions, at::Tensor& velocities, const at::Tensor& forces,
                                      const at::Tensor& inverse_masses, double kick, double drift,
                                      at::ScalarType dtype) {
  return written_in_place("mirage::verlet_kick_drift", {{"positions", &positions}, {"velocities", &velocities}}, [&] {
    return handles::verlet_kick_drift().call(positions, velocities, forces, inverse_masses, kick, drift, dtype);
  });
}

void verlet_forces_kick_autograd(at::Tensor& velocities, at::Tensor& forces, at::Tensor& energy,
                                 const at::Tensor& grad, const at::Tensor& model_energy,
                                 const at::Tensor& inverse_masses, double kick,
                                 const std::optional<at::Tensor>& pair_count,
                                 const std::optional<at::Tensor>& pair_count_range) {
  written_in_place("mirage::verlet_forces_kick",
                   {{"velocities", &velocities},
                    {"forces", &forces},
                    {"energy", &energy},
                    {"pair_count_range", or_null(pair_count_range)}},
                   [&] {
                     handles::verlet_forces_kick().call(velocities, forces, energy, grad, model_energy,
                                                        inverse_masses, kick, pair_count, pair_count_range);
                   });
}

at::Tensor verlet_forces_kick_drift_autograd(at::Tensor& positions, at::Tensor& velocities, at::Tensor& forces,
                                             at::Tensor& energy, const at::Tensor& grad,
                                             const at::Tensor& model_energy, const at::Tensor& inverse_masses,
                                             double kick, double drift, at::ScalarType dtype,
                                             const std::optional<at::Tensor>& pair_count,
                                             const std::optional<at::Tensor>& pair_count_range) {
  return written_in_place("mirage::verlet_forces_kick_drift",
                          {{"positions", &positions},
                           {"velocities", &velocities},
                           {"forces", &forces},
                           {"energy", &energy},
                           {"pair_count_range", or_null(pair_count_range)}},
                          [&] {
                            return handles::verlet_forces_kick_drift().call(
                                positions, velocities, forces, energy, grad, model_energy, inverse_masses, kick,
                                drift, dtype, pair_count, pair_count_range);
                          });
}

}  // namespace

// The backward ops themselves are not differentiable (see above): a clear error if asked to be.
TORCH_LIBRARY_IMPL(mirage, Autograd, m) {
  m.impl("cfconv", given<&handles::cfconv, &cfconv_autograd>);
  m.impl("cfconv_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("radial_cfconv", given<&handles::radial_cfconv, &radial_cfconv_autograd>);
  m.impl("radial_cfconv_backward", torch::autograd::autogradNotImplementedFallback());
  // A constant of the weights (schnet_energy reads it in place of forming it): not differentiable.
  m.impl("schnet_energy_prepare", torch::autograd::autogradNotImplementedFallback());
  m.impl("verlet_kick_drift", given<&handles::verlet_kick_drift, &verlet_kick_drift_autograd>);
  m.impl("verlet_forces_kick", given<&handles::verlet_forces_kick, &verlet_forces_kick_autograd>);
  m.impl("verlet_forces_kick_drift", given<&handles::verlet_forces_kick_drift, &verlet_forces_kick_drift_autograd>);
}

}  // namespace mirage::autograd
