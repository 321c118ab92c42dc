// mirage::painn_update(_input) and their backward ops: checks, CPU references and Meta kernels.
#include "painn_update.h"

#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "message.h"

namespace mirage::ops {
namespace {

// The first argument: floating, [N, width * F]; returns (N, F).
PainnUpdateShape check_first(std::string_view op, std::string_view arg, const at::Tensor& t,
                             int64_t width) {
  check_activation_dtype(op, arg, t);
  MIRAGE_CHECK(t.dim() == 2 && t.size(1) % width == 0, op, ": ", arg, " must be [N, ",
               width == 1 ? "F" : std::to_string(width) + "F", "], got ", t.sizes());
  return {t.size(0), t.size(1) / width};
}

// CUDA computes in float32: eps must survive the rounding (0 or a normal float32).
void check_eps(std::string_view op, double eps) {
  MIRAGE_CHECK(eps == 0 || (eps >= std::numeric_limits<float>::min() && finite_as_float32(eps)),
               op, ": eps must be 0 or a normal float32 in [1.2e-38, 3.4e+38] (finite, >= 0), got ", eps);
}

}  // namespace

PainnUpdateShape check_painn_update_input(const at::Tensor& s, const at::Tensor& vv, double eps) {
  constexpr std::string_view op = kPainnUpdateInput;
  const PainnUpdateShape shape = check_first(op, "s", s, 1);
  check_like(op, "vv", vv, "s's", s, "[N, 3, F]", {shape.nodes, 3, shape.features});
  check_eps(op, eps);
  return shape;
}

PainnUpdateShape check_painn_update_input_backward(const at::Tensor& grad, const at::Tensor& vv,
                                                   double eps) {
  constexpr std::string_view op = kPainnUpdateInputBackward;
  const PainnUpdateShape shape = check_first(op, "grad", grad, 2);
  check_like(op, "vv", vv, "grad's", grad, "[N, 3, F]", {shape.nodes, 3, shape.features});
  check_eps(op, eps);
  return shape;
}

PainnUpdateShape check_painn_update(std::string_view op, std::string_view s_name, const at::Tensor& s,
                                    std::string_view v_name, const at::Tensor& v, const at::Tensor& uv,
                                    const at::Tensor& vv, const at::Tensor& a) {
  const PainnUpdateShape shape = check_first(op, s_name, s, 1);
  const int64_t N = shape.nodes, F = shape.features;
  const std::string owner = std::string(s_name) + "'s";
  check_like(op, v_name, v, owner, s, "[N, 3, F]", {N, 3, F});
  check_like(op, "uv", uv, owner, s, "[N, 3, F]", {N, 3, F});
  check_like(op, "vv", vv, owner, s, "[N, 3, F]", {N, 3, F});
  check_like(op, "a", a, owner, s, "[N, 3F]", {N, 3 * F});
  return shape;
}

namespace {

at::Tensor as_double(const at::Tensor& t) { return t.to(at::kDouble).contiguous(); }
const double* data(const at::Tensor& t) { return t.const_data_ptr<double>(); }

// The references: float64, element by element, straight from the formulas in
// cuda/painn_update.cuh. Plain on purpose.
at::Tensor painn_update_input_cpu(const at::Tensor& s, const at::Tensor& vv, double eps) {
  const auto [N, F] = check_painn_update_input(s, vv, eps);
  const at::Tensor s64 = as_double(s), vv64 = as_double(vv);
  at::Tensor input = at::empty({N, 2 * F}, s64.options());
  double* out = input.mutable_data_ptr<double>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t f = 0; f < F; ++f) {
      double sum = 0;
      for (int64_t c = 0; c < 3; ++c) sum += std::pow(data(vv64)[(n * 3 + c) * F + f], 2);
      out[n * 2 * F + f] = data(s64)[n * F + f];
      out[n * 2 * F + F + f] = std::sqrt(sum + eps);
    }
  }
  return input.to(s.scalar_type());
}

at::Tensor painn_update_input_backward_cpu(const at::Tensor& grad, const at::Tensor& vv, double eps) {
  const auto [N, F] = check_painn_update_input_backward(grad, vv, eps);
  const at::Tensor g64 = as_double(grad), vv64 = as_double(vv);
  at::Tensor grad_vv = at::empty({N, 3, F}, g64.options());
  double* out = grad_vv.mutable_data_ptr<double>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t f = 0; f < F; ++f) {
      double sum = 0;
      for (int64_t c = 0; c < 3; ++c) sum += std::pow(data(vv64)[(n * 3 + c) * F + f], 2);
      const double norm = std::sqrt(sum + eps);
      for (int64_t c = 0; c < 3; ++c) {
        const int64_t i = (n * 3 + c) * F + f;
        out[i] = data(g64)[n * 2 * F + F + f] * data(vv64)[i] / norm;
      }
    }
  }
  return grad_vv.to(grad.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> painn_update_cpu(const at::Tensor& s, const at::Tensor& v,
                                                    const at::Tensor& uv, const at::Tensor& vv,
                                                    const at::Tensor& a) {
  const auto [N, F] = check_painn_update(kPainnUpdate, "s", s, "v", v, uv, vv, a);
  const at::Tensor s64 = as_double(s), v64 = as_double(v), uv64 = as_double(uv),
                   vv64 = as_double(vv), a64 = as_double(a);
  at::Tensor s_out = at::empty({N, F}, s64.options()), v_out = at::empty({N, 3, F}, s64.options());
  double *so = s_out.mutable_data_ptr<double>(), *vo = v_out.mutable_data_ptr<double>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t f = 0; f < F; ++f) {
      const double* an = data(a64) + n * 3 * F + f;
      const double a_vv = an[0], a_sv = an[F], a_ss = an[2 * F];
      double dot = 0;
      for (int64_t c = 0; c < 3; ++c) {
        const int64_t i = (n * 3 + c) * F + f;
        dot += data(uv64)[i] * data(vv64)[i];
        vo[i] = data(v64)[i] + a_vv * data(uv64)[i];
      }
      so[n * F + f] = data(s64)[n * F + f] + a_ss + a_sv * dot;
    }
  }
  return {s_out.to(s.scalar_type()), v_out.to(s.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> painn_update_backward_cpu(
    const at::Tensor& grad_s, const at::Tensor& grad_v, const at::Tensor& uv, const at::Tensor& vv,
    const at::Tensor& a) {
  const auto [N, F] =
      check_painn_update(kPainnUpdateBackward, "grad_s", grad_s, "grad_v", grad_v, uv, vv, a);
  const at::Tensor gs64 = as_double(grad_s), gv64 = as_double(grad_v), uv64 = as_double(uv),
                   vv64 = as_double(vv), a64 = as_double(a);
  const auto options = gs64.options();
  at::Tensor grad_uv = at::empty({N, 3, F}, options), grad_vv = at::empty({N, 3, F}, options),
             grad_a = at::empty({N, 3 * F}, options);
  double *guv = grad_uv.mutable_data_ptr<double>(), *gvv = grad_vv.mutable_data_ptr<double>(),
         *ga = grad_a.mutable_data_ptr<double>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t f = 0; f < F; ++f) {
      const double* an = data(a64) + n * 3 * F + f;
      const double a_vv = an[0], a_sv = an[F], g_s = data(gs64)[n * F + f];
      double dot = 0, g_a_vv = 0;
      for (int64_t c = 0; c < 3; ++c) {
        const int64_t i = (n * 3 + c) * F + f;
        const double u = data(uv64)[i], w = data(vv64)[i], g_v = data(gv64)[i];
        dot += u * w;
        g_a_vv += g_v * u;
        guv[i] = g_v * a_vv + g_s * a_sv * w;
        gvv[i] = g_s * a_sv * u;
      }
      ga[n * 3 * F + f] = g_a_vv;
      ga[n * 3 * F + F + f] = g_s * dot;
      ga[n * 3 * F + 2 * F + f] = g_s;
    }
  }
  const auto dtype = grad_s.scalar_type();
  return {grad_uv.to(dtype), grad_vv.to(dtype), grad_a.to(dtype)};
}

at::Tensor painn_update_input_meta(const at::Tensor& s, const at::Tensor& vv, double eps) {
  const auto [N, F] = check_painn_update_input(s, vv, eps);
  return at::empty({N, 2 * F}, s.options());
}

at::Tensor painn_update_input_backward_meta(const at::Tensor& grad, const at::Tensor& vv, double eps) {
  const auto [N, F] = check_painn_update_input_backward(grad, vv, eps);
  return at::empty({N, 3, F}, grad.options());
}

std::tuple<at::Tensor, at::Tensor> painn_update_meta(const at::Tensor& s, const at::Tensor& v,
                                                     const at::Tensor& uv, const at::Tensor& vv,
                                                     const at::Tensor& a) {
  const auto [N, F] = check_painn_update(kPainnUpdate, "s", s, "v", v, uv, vv, a);
  return {at::empty({N, F}, s.options()), at::empty({N, 3, F}, s.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> painn_update_backward_meta(
    const at::Tensor& grad_s, const at::Tensor& grad_v, const at::Tensor& uv, const at::Tensor& vv,
    const at::Tensor& a) {
  const auto [N, F] =
      check_painn_update(kPainnUpdateBackward, "grad_s", grad_s, "grad_v", grad_v, uv, vv, a);
  const auto options = grad_s.options();
  return {at::empty({N, 3, F}, options), at::empty({N, 3, F}, options), at::empty({N, 3 * F}, options)};
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CPU, m) {
  m.impl("painn_update_input", &painn_update_input_cpu);
  m.impl("painn_update_input_backward", &painn_update_input_backward_cpu);
  m.impl("painn_update", &painn_update_cpu);
  m.impl("painn_update_backward", &painn_update_backward_cpu);
}
TORCH_LIBRARY_IMPL(mirage, Meta, m) {
  m.impl("painn_update_input", &painn_update_input_meta);
  m.impl("painn_update_input_backward", &painn_update_input_backward_meta);
  m.impl("painn_update", &painn_update_meta);
  m.impl("painn_update_backward", &painn_update_backward_meta);
}

}  // namespace mirage::ops
