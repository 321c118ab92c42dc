// Argument checks shared by the ops. Every failure is a MIRAGE_CHECK whose message names the op,
// the argument, what was expected and what was given (ARCHITECTURE.md rule 4).
#pragma once

#include <cmath>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <ATen/core/Tensor.h>

#include "message.h"

namespace mirage::ops {

// Activations: float32/float16/bfloat16 everywhere; float64 too on the CPU (gradcheck).
void check_activation_dtype(std::string_view op, std::string_view arg, const at::Tensor& t);

// Whether a scalar argument is finite as a float32, the type the CUDA kernels take it in (1e39 is a
// finite double but float's inf): compared with float's largest, not cast, since casting a double
// past float's range is undefined behaviour. False for NaN.
inline bool finite_as_float32(double value) { return std::abs(value) <= std::numeric_limits<float>::max(); }

// A cutoff: finite, > 0 and within float32's normal range, which the CUDA kernels take it in (the
// CPU references' tables of its powers then stay finite too: a cutoff of 1e200 gave NaN).
void check_cutoff(std::string_view op, double cutoff);

// `other` must live on x's device.
void check_same_device(std::string_view op, std::string_view arg, const at::Tensor& other,
                       const at::Tensor& x);

// t on ref's device, in ref's dtype, of shape `want` (written `expected` in the message, e.g.
// "[N, 3, F]"); `owner` is ref's name in the possessive ("s's", "positions'").
void check_like(std::string_view op, std::string_view arg, const at::Tensor& t, std::string_view owner,
                const at::Tensor& ref, std::string_view expected, at::IntArrayRef want);

// weight / bias: 1-D of `size` elements on x's device, in x's dtype or float32.
void check_param(std::string_view op, std::string_view arg, const std::optional<at::Tensor>& p,
                 const at::Tensor& x, const c10::SymInt& size);

// The dtype weight and bias share (x's when both are absent); they must agree.
at::ScalarType param_dtype(std::string_view op, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, const at::Tensor& x);

// Symbolic sizes: the checks and Meta kernels of the U-Net's ops (group_norm, layer_norm,
// add_layer_norm, geglu, bias_act, linear, subpixel_shuffle) read sizes as c10::SymInt
// (sym_size, sym_sizes) and allocate with at::empty_symint, so that under torch.compile's dynamic
// shapes and torch.export's Dims a size stays a symbol instead of being specialized (size() and
// sizes() would guard it to its example value). A check then adds a guard only where it compares.

// The memory format of the output of an op over [N, C, *spatial] (group_norm, bias_act): x's
// suggested one for 4-D/5-D x (channels-last or contiguous), contiguous otherwise.
at::MemoryFormat channels_layout(const at::Tensor& x);

// An uninitialized tensor of x's shape, dtype and device in `layout`: channels_layout(x), worked
// out once by the caller (a few stride comparisons, on every call of the op).
at::Tensor empty_in_channels_layout(const at::Tensor& x, at::MemoryFormat layout);

// x of shape [N, C, *spatial] as the kernels see it (concrete sizes: not for Meta kernels):
// spatial is the product of the trailing dimensions (1 for 2-D x), layout channels_layout(x).
struct ChannelsShape {
  int64_t batch, channels, spatial;
  at::MemoryFormat layout;
};
ChannelsShape channels_shape(const at::Tensor& x);

// Every entry of pairs ([2, P] int64 on the CPU, contiguous) in [0, num_nodes): the CPU
// references read the indices anyway, so out-of-range ones raise there.
void check_pair_indices(std::string_view op, const at::Tensor& pairs, int64_t num_nodes);

// make()'s result, with a failure to allocate (out of memory, or a size past what a tensor can
// hold) named: the op and the argument the size comes from (`arg` = `value`), not only the
// allocator's message, which names neither. Out of memory stays torch.OutOfMemoryError, which
// callers catch by type.
template <class Make>
auto allocate_named(std::string_view op, std::string_view arg, int64_t value, Make&& make) -> decltype(make()) {
  const auto named = [&](const c10::Error& error) {
    const std::string what = error.msg();
    return message(op, ": cannot allocate the outputs for ", arg, " = ", value, " (", what.substr(0, what.find('\n')),
                   ")");
  };
  try {
    return make();
  } catch (const c10::OutOfMemoryError& error) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, named(error));
  } catch (const c10::Error& error) {
    TORCH_CHECK(false, named(error));
  }
}

// A tensor argument and its name, for check_apart.
using Named = std::pair<std::string_view, const at::Tensor*>;

// What an op writes in place (`written`) must share no memory with its other tensors (`read`) nor
// with each other: it would read values half updated, or write one element twice. Where PyTorch
// cannot tell (a strided view of the same storage), the two are refused if their byte spans meet,
// which may refuse interleaved views that would not collide; tensors without memory (Meta, and
// the symbolic shapes of torch.compile's tracing) are not checked.
void check_apart(std::string_view op, std::initializer_list<Named> written, std::initializer_list<Named> read);

// Whether an optional tensor argument is given. An undefined tensor, which C++ callers may pass
// for "none", counts as absent, as in PyTorch's own ops: read as given, its device would raise
// the dispatcher's "tensor does not have a device", naming neither op nor argument.
inline bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The parameter as a contiguous tensor, or undefined when absent.
at::Tensor contiguous_or_undefined(const std::optional<at::Tensor>& p);

}  // namespace mirage::ops
