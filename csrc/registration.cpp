// Every mirage operator schema, in one list. Kernels register per dispatch key in ops/,
// autograd.cpp and autocast.cpp.
#include <torch/library.h>

TORCH_LIBRARY(mirage, m) {
  m.def("group_norm(Tensor x, int num_groups, Tensor? weight=None, Tensor? bias=None, "
        "float eps=1e-05, str activation=\"none\") -> Tensor");
  m.def("layer_norm(Tensor x, Tensor? weight=None, Tensor? bias=None, float eps=1e-05) -> Tensor");
  m.def("add_layer_norm(Tensor x, Tensor residual, Tensor? weight=None, Tensor? bias=None, "
        "float eps=1e-05) -> (Tensor out, Tensor sum)");
  m.def("geglu(Tensor x, str approximate=\"none\") -> Tensor");
}
