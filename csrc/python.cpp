// mirage._C: what Python needs from the C++ library that is not a tensor op. Importing it loads
// libmirage, which registers the torch.ops.mirage operators.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "mirage/mirage.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "mirage's compiled core";
  m.def(
      "build_info",
      [] {
        const mirage::BuildInfo info = mirage::build_info();
        py::dict d;
        d["version"] = info.version;
        d["torch_version"] = info.torch_version;
        d["cuda_version"] = info.cuda_version;
        d["cuda_archs"] = info.cuda_archs;
        return d;
      },
      "What the library was built with: version, torch and CUDA versions, GPU architectures.");
  m.def(
      "cfconv_supported",
      [](int64_t num_rbf, int64_t hidden, int64_t width, const std::string& device) {
        return mirage::cfconv_supported(num_rbf, hidden, width, c10::Device(device));
      },
      "Whether mirage::cfconv takes a filter network of these sizes on this device (a torch device string).");
  m.def(
      "radial_cfconv_supported",
      [](int64_t num_rbf, int64_t hidden, int64_t width, const std::string& device) {
        return mirage::radial_cfconv_supported(num_rbf, hidden, width, c10::Device(device));
      },
      "Whether mirage::radial_cfconv takes a filter network of these sizes on this device (a torch device string).");
  m.def(
      "fused_filter_supported",
      [](int64_t features, int64_t basis, const std::string& device) {
        return mirage::fused_filter_supported(features, basis, c10::Device(device));
      },
      "Whether mirage::vector_message_passing's CUDA kernels form a float32 filter of 3 * features columns "
      "from a basis of this width themselves (a torch device string).");
  m.def(
      "overlapped_launches", [](const std::string& device) { return mirage::overlapped_launches(c10::Device(device)); },
      "Whether mirage's kernels are launched overlapped on this device (a torch device string).");
  m.def(
      "whole_model_clusters", [](const std::string& device) { return mirage::whole_model_clusters(c10::Device(device)); },
      "Whether the whole-model force-field ops run as a thread-block cluster on this device (a torch device string).");
}
