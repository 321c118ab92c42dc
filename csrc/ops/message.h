// Error messages built without iostreams.
//
// On the GPU machine (Ubuntu 24.04, gcc 13.3, torch 2.11.0+cu130) a TORCH_CHECK message that
// streamed an integer crashed the Python process inside std::ostream::_M_insert<long> called from
// libmirage, while the same check called from a C++ program passed. Building the text with
// std::to_string / snprintf keeps libmirage off that path wherever the cause lies.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace mirage::ops {
namespace detail {

inline void append(std::string& out, std::string_view s) { out.append(s.data(), s.size()); }
inline void append(std::string& out, const char* s) { out.append(s); }
inline void append(std::string& out, const std::string& s) { out.append(s); }
inline void append(std::string& out, at::ScalarType t) { out.append(c10::toString(t)); }
inline void append(std::string& out, const c10::Device& d) { out.append(d.str()); }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
void append(std::string& out, T v) {
  out.append(std::to_string(v));
}
// A size under torch.compile's dynamic shapes may be a symbol: written as its expression and the
// value it has in the example being traced, "s0=5" (reading the value guards on it, which does no
// harm here: the message is built only for a check that fails).
inline void append(std::string& out, const c10::SymInt& v) {
  if (const auto concrete = v.maybe_as_int()) {
    out.append(std::to_string(*concrete));
    return;
  }
  c10::SymNodeImpl* node = v.toSymNodeImplUnowned();
  out.append(node->str());
  if (node->has_hint()) out.append("=" + std::to_string(node->int_()));
}
// Sizes (IntArrayRef, SymIntArrayRef): "[2, 3]".
template <typename T>
void append(std::string& out, c10::ArrayRef<T> sizes) {
  out.push_back('[');
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) out.append(", ");
    append(out, sizes[i]);
  }
  out.push_back(']');
}
inline void append(std::string& out, double v) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", v);
  out.append(buffer);
}

}  // namespace detail

template <typename... Args>
std::string message(const Args&... args) {
  std::string out;
  (detail::append(out, args), ...);
  return out;
}

}  // namespace mirage::ops

// TORCH_CHECK with the message built by mirage::ops::message.
#define MIRAGE_CHECK(cond, ...) TORCH_CHECK(cond, ::mirage::ops::message(__VA_ARGS__))
