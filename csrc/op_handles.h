// Typed dispatcher handles of the mirage ops, for C++ code that calls them (the public API and
// the autograd and autocast kernels, which re-dispatch below their own key).
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace mirage::handles {

using GroupNormSig = at::Tensor(const at::Tensor&, int64_t, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, double, c10::string_view);
using LayerNormSig = at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, double);
using AddLayerNormSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                           const std::optional<at::Tensor>&,
                                                           const std::optional<at::Tensor>&,
                                                           double);
using GegluSig = at::Tensor(const at::Tensor&, c10::string_view);
using BiasActSig = at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&, c10::string_view, double);
using LinearSig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                             const std::optional<at::Tensor>&, c10::string_view);
using SubpixelShuffleSig = at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&);
using NeighborListSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, double, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, int64_t, bool, c10::string_view);
using RadialBasisSig = at::Tensor(const at::Tensor&, c10::string_view, int64_t, double,
                                  c10::string_view);
using RadialBasisBackwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view,
                                          int64_t, double, c10::string_view);
using PairOpSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
// The ops' trailing `Tensor? sender_order` (mirage::sender_order's result).
using SenderOrderArg = const std::optional<at::Tensor>&;
using SenderOrderSig = at::Tensor(const at::Tensor&, int64_t, const std::optional<at::Tensor>&);
using VectorMessagePassingSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, SenderOrderArg, const std::optional<at::Tensor>&);
using VectorMessagePassingBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, SenderOrderArg,
    const std::optional<at::Tensor>&);
using SchnetEnergySig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                            const at::Tensor&, const at::Tensor&, double,
                                                            int64_t, at::TensorList, c10::string_view,
                                                            const std::optional<at::Tensor>&);
using SchnetEnergyAllPairsSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, at::TensorList, c10::string_view,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);
using SchnetEnergyPrepareSig = at::Tensor(const at::Tensor&, double, int64_t, at::TensorList, c10::string_view);

using PainnEnergySig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                           const at::Tensor&, double, int64_t, at::TensorList,
                                                           c10::string_view, double);

using CfconvSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&,
                                                     const std::optional<at::Tensor>&, const at::Tensor&,
                                                     const std::optional<at::Tensor>&, c10::string_view, bool,
                                                     SenderOrderArg, const std::optional<at::Tensor>&);
using CfconvBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, c10::string_view,
    bool, SenderOrderArg, const std::optional<at::Tensor>&);
using RadialCfconvSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view, c10::string_view, double,
    c10::string_view, SenderOrderArg);
using RadialCfconvBackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                   const at::Tensor&, const at::Tensor&,
                                                                   const at::Tensor&, double, SenderOrderArg);
using PairVectorsSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                          const std::optional<at::Tensor>&, SenderOrderArg);
using PairVectorsBackwardSig = at::Tensor(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                          const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                          SenderOrderArg);
using PainnUpdateInputSig = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using PainnUpdateSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                          const at::Tensor&, const at::Tensor&,
                                                          const at::Tensor&);
using PainnUpdateBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using VerletKickDriftSig = at::Tensor(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, double, double,
                                      at::ScalarType);
using VerletForcesKickSig = void(at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, double, const std::optional<at::Tensor>&,
                                 const std::optional<at::Tensor>&);
using VerletForcesKickDriftSig = at::Tensor(at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, const at::Tensor&, double, double, at::ScalarType,
                                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);

template <typename Sig>
c10::TypedOperatorHandle<Sig> lookup(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// One lookup per op; a handle stays valid while the library is loaded.
#define MIRAGE_OP_HANDLE(NAME, SIG)                                  \
  inline const c10::TypedOperatorHandle<SIG>& NAME() {               \
    static const auto handle = lookup<SIG>("mirage::" #NAME);        \
    return handle;                                                   \
  }
MIRAGE_OP_HANDLE(group_norm, GroupNormSig)
MIRAGE_OP_HANDLE(layer_norm, LayerNormSig)
MIRAGE_OP_HANDLE(add_layer_norm, AddLayerNormSig)
MIRAGE_OP_HANDLE(geglu, GegluSig)
MIRAGE_OP_HANDLE(bias_act, BiasActSig)
MIRAGE_OP_HANDLE(linear, LinearSig)
MIRAGE_OP_HANDLE(subpixel_shuffle, SubpixelShuffleSig)
MIRAGE_OP_HANDLE(neighbor_list, NeighborListSig)
MIRAGE_OP_HANDLE(radial_basis, RadialBasisSig)
MIRAGE_OP_HANDLE(radial_basis_backward, RadialBasisBackwardSig)
MIRAGE_OP_HANDLE(message_passing, PairOpSig)
MIRAGE_OP_HANDLE(pair_product, PairOpSig)
MIRAGE_OP_HANDLE(vector_message_passing, VectorMessagePassingSig)
MIRAGE_OP_HANDLE(vector_message_passing_backward, VectorMessagePassingBackwardSig)
MIRAGE_OP_HANDLE(schnet_energy, SchnetEnergySig)
MIRAGE_OP_HANDLE(schnet_energy_prepare, SchnetEnergyPrepareSig)
MIRAGE_OP_HANDLE(schnet_energy_all_pairs, SchnetEnergyAllPairsSig)
MIRAGE_OP_HANDLE(painn_energy, PainnEnergySig)
MIRAGE_OP_HANDLE(cfconv, CfconvSig)
MIRAGE_OP_HANDLE(cfconv_backward, CfconvBackwardSig)
MIRAGE_OP_HANDLE(radial_cfconv, RadialCfconvSig)
MIRAGE_OP_HANDLE(radial_cfconv_backward, RadialCfconvBackwardSig)
MIRAGE_OP_HANDLE(sender_order, SenderOrderSig)
MIRAGE_OP_HANDLE(pair_vectors, PairVectorsSig)
MIRAGE_OP_HANDLE(pair_vectors_backward, PairVectorsBackwardSig)
MIRAGE_OP_HANDLE(painn_update_input, PainnUpdateInputSig)
MIRAGE_OP_HANDLE(painn_update_input_backward, PainnUpdateInputSig)
MIRAGE_OP_HANDLE(painn_update, PainnUpdateSig)
MIRAGE_OP_HANDLE(painn_update_backward, PainnUpdateBackwardSig)
MIRAGE_OP_HANDLE(verlet_kick_drift, VerletKickDriftSig)
MIRAGE_OP_HANDLE(verlet_forces_kick, VerletForcesKickSig)
MIRAGE_OP_HANDLE(verlet_forces_kick_drift, VerletForcesKickDriftSig)
#undef MIRAGE_OP_HANDLE

}  // namespace mirage::handles
