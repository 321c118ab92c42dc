// Python's None for a `Tensor` argument (not `Tensor?`) reaches a kernel as an undefined tensor,
// which torch::autograd::Function and the kernels' own checks reject with "tensor does not have a
// device", naming neither the op nor the argument. Two wrappers check first, one message:
// `given<handle, kernel>` in front of each Autograd kernel (autograd.cpp), which runs first under
// grad mode, and each op's BackendSelect kernel (tensors_given.cpp), which runs in every mode,
// torch.inference_mode() and ops without a gradient formula included, and for calls whose tensors
// are all None (which then have no backend to dispatch to).
#pragma once

#include <cstddef>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace mirage {

inline bool missing(const at::Tensor& t) { return !t.defined(); }
template <class T>
bool missing(const T&) {
  return false;
}

// "mirage::<op>: <argument> must be a tensor, got None", the argument named from the schema.
[[noreturn]] void missing_tensor(const c10::OperatorHandle& op, size_t index);

template <auto Handle, class... Args>
void check_given(const Args&... args) {
  size_t index = 0;
  ((missing(args) ? missing_tensor(Handle(), index) : void(), ++index), ...);
}

template <auto Handle, auto Kernel>
struct GivenTensors;
template <auto Handle, class Ret, class... Args, Ret (*Kernel)(Args...)>
struct GivenTensors<Handle, Kernel> {
  static Ret call(Args... args) {
    check_given<Handle>(args...);
    return Kernel(args...);
  }
};
// Kernel, behind the check.
template <auto Handle, auto Kernel>
constexpr auto given = &GivenTensors<Handle, Kernel>::call;

}  // namespace mirage
