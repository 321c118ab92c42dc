// Every op's BackendSelect kernel: the None check of tensors_given.h, then on to the backend.
// BackendSelect is in every call's dispatch keys (PyTorch's default included set, which
// inference mode leaves alone), below Autograd and above the backends.
#include "tensors_given.h"

#include <torch/library.h>

#include "op_handles.h"
#include "ops/message.h"

namespace mirage {

void missing_tensor(const c10::OperatorHandle& op, size_t index) {
  const c10::FunctionSchema& schema = op.schema();
  TORCH_CHECK(false,
              ops::message(schema.name(), ": ", schema.arguments().at(index).name(), " must be a tensor, got None"));
}

namespace {

template <class Handle>
struct SignatureOf;
template <class Sig>
struct SignatureOf<c10::TypedOperatorHandle<Sig>> {
  using type = Sig;
};

template <auto Handle, class Sig = typename SignatureOf<std::decay_t<decltype(Handle())>>::type>
struct Checked;
template <auto Handle, class Ret, class... Args>
struct Checked<Handle, Ret(Args...)> {
  static Ret call(c10::DispatchKeySet keys, Args... args) {
    check_given<Handle>(args...);
    static const c10::DispatchKeySet below(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::BackendSelect);
    return Handle().redispatch(keys & below, args...);
  }
};

template <auto Handle>
void checked(torch::Library& m, const char* name) {
  m.impl(name, torch::CppFunction::makeFromUnboxedFunction(TORCH_FN(Checked<Handle>::call)));
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, BackendSelect, m) {
  checked<&handles::group_norm>(m, "group_norm");
  checked<&handles::layer_norm>(m, "layer_norm");
  checked<&handles::add_layer_norm>(m, "add_layer_norm");
  checked<&handles::geglu>(m, "geglu");
  checked<&handles::bias_act>(m, "bias_act");
  checked<&handles::linear>(m, "linear");
  checked<&handles::subpixel_shuffle>(m, "subpixel_shuffle");
  checked<&handles::neighbor_list>(m, "neighbor_list");
  checked<&handles::radial_basis>(m, "radial_basis");
  checked<&handles::radial_basis_backward>(m, "radial_basis_backward");
  checked<&handles::message_passing>(m, "message_passing");
  checked<&handles::pair_product>(m, "pair_product");
  checked<&handles::vector_message_passing>(m, "vector_message_passing");
  checked<&handles::vector_message_passing_backward>(m, "vector_message_passing_backward");
  checked<&handles::schnet_energy>(m, "schnet_energy");
  checked<&handles::schnet_energy_prepare>(m, "schnet_energy_prepare");
  checked<&handles::schnet_energy_all_pairs>(m, "schnet_energy_all_pairs");
  checked<&handles::painn_energy>(m, "painn_energy");
  checked<&handles::cfconv>(m, "cfconv");
  checked<&handles::cfconv_backward>(m, "cfconv_backward");
  checked<&handles::radial_cfconv>(m, "radial_cfconv");
  checked<&handles::radial_cfconv_backward>(m, "radial_cfconv_backward");
  checked<&handles::sender_order>(m, "sender_order");
  checked<&handles::pair_vectors>(m, "pair_vectors");
  checked<&handles::pair_vectors_backward>(m, "pair_vectors_backward");
  checked<&handles::painn_update_input>(m, "painn_update_input");
  checked<&handles::painn_update_input_backward>(m, "painn_update_input_backward");
  checked<&handles::painn_update>(m, "painn_update");
  checked<&handles::painn_update_backward>(m, "painn_update_backward");
  checked<&handles::verlet_kick_drift>(m, "verlet_kick_drift");
  checked<&handles::verlet_forces_kick>(m, "verlet_forces_kick");
  checked<&handles::verlet_forces_kick_drift>(m, "verlet_forces_kick_drift");
}

}  // namespace mirage
