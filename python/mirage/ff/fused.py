"""mirage's fused SchNet and PaiNN: what :func:`mirage.ff.optimize` swaps in.

Both compute the models of ``examples/forcefield/models.py`` (Schütt et al. 2017; Schütt, Unke,
Gastegger 2021) with mirage's ops, with the same call::

    energy = model(atomic_numbers, positions, cell=None, pbc=None)

- the radius graph is ``mirage::neighbor_list`` (fixed capacity ``max_pairs``, no host sync);
- the radial basis is ``mirage::radial_basis``, and so is the cosine cutoff (its kind "none"),
  which is multiplied into the filters (SchNet) or the basis (PaiNN);
- the filter networks' first Linear of every interaction is one batched GEMM (they all read the
  same basis), their second Linear too where they have one;
- message passing is ``mirage::message_passing`` (SchNet) or ``mirage::vector_message_passing``
  (PaiNN).

Padding pairs of the neighbor list (``distances == cutoff``) get a cutoff weight of exactly zero,
value and gradient, so they add nothing without a mask. The parameters' names are those of the
reference models (``interactions.0.filter.0.weight``, ...), and their state dicts carry the
reference's basis buffer (``centers`` or ``frequencies``, computed, and checked when loaded), so
checkpoints load both ways, strictly.

The neighbor-capacity protocol (see :mod:`mirage.ff`): ``max_pairs`` (None until the first
forward chooses it from the system) and the ``[1]`` int64 buffer ``num_pairs``, written with
``copy_`` on every forward (graph-safe). A call outside a CUDA-graph capture and outside
torch.compile also reads the count back (one host sync) and, when the pairs overflowed the
capacity, grows it and computes again: a direct call never returns the energy of a truncated
pair list. Under a capture the caller checks (mirage.ff.Calculator and mirage.ff.md do).
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import graphs, ops
from ..nn.calls import forward_extras
from . import capacity

__all__ = ["ACTIVATIONS", "Activation", "PaiNN", "SchNet", "identify_activation"]

_LOG2 = math.log(2.0)


def _shifted_softplus(x: Tensor) -> Tensor:
    return F.softplus(x) - _LOG2


#: The activations the fused models compute, by name.
ACTIVATIONS: Dict[str, Callable[[Tensor], Tensor]] = {
    "shifted_softplus": _shifted_softplus,
    "softplus": F.softplus,
    "silu": F.silu,
    "tanh": torch.tanh,
    "gelu": F.gelu,
    "relu": F.relu,
}

# Open systems with at most this many ordered pairs get a capacity of every pair (N * (N - 1)) on
# the first forward: they can never overflow, and the capacity costs little (benzene: 132).
_ALL_PAIRS_UP_TO = 4096
# Headroom over the counted pairs for a capacity chosen on the first forward: MD moves the count
# by a few percent in a liquid, more when a molecule folds or a gas condenses.
_CAPACITY_HEADROOM = 1.25
_CAPACITY_ROUNDING = 64


class Activation(nn.Module):
    """One of :data:`ACTIVATIONS` as a module (the fused models' own, when built from sizes)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        if name not in ACTIVATIONS:
            raise ValueError(f"mirage.ff.fused.Activation: name must be one of {sorted(ACTIVATIONS)}, got {name!r}")
        self.name = name

    def forward(self, x: Tensor) -> Tensor:
        return ACTIVATIONS[self.name](x)

    def extra_repr(self) -> str:
        return repr(self.name)


def identify_activation(module: nn.Module, where: str) -> str:
    """The name in :data:`ACTIVATIONS` of the function ``module`` computes.

    Found by evaluating the module on sample values (its class is never looked at), so a user's
    own ``ShiftedSoftplus`` is recognised as well as ``nn.SiLU``.

    Raises:
        ValueError: the module has parameters or buffers, fails, or matches no known activation.
    """
    if isinstance(module, Activation):
        return module.name
    kind = type(module).__name__
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        raise ValueError(f"{where} ({kind}) has parameters or buffers: not a plain activation")
    sample = torch.linspace(-12.0, 12.0, 7 * 23, dtype=torch.float64).reshape(7, 23)
    try:
        with torch.no_grad():
            out = module(sample)
    except Exception as error:  # a user module: any failure means "not an activation we know"
        raise ValueError(f"{where} ({kind}) failed on a sample input: {type(error).__name__}: {error}") from None
    if isinstance(out, Tensor) and out.shape == sample.shape and out.dtype == sample.dtype:
        for name, function in ACTIVATIONS.items():
            # To 1e-6: PyTorch Geometric's ShiftedSoftplus subtracts log 2 rounded to float32 (1.9e-9
            # off); the probe compares the whole models afterwards. The activations mirage knows
            # differ by 5e-4 at least (GELU's two forms).
            if torch.allclose(out, function(sample), rtol=1e-6, atol=1e-6):
                return name
    raise ValueError(f"{where} ({kind}) computes none of the activations mirage knows "
                     f"({', '.join(sorted(ACTIVATIONS))})")


def _cosine_cutoff(d: Tensor, cutoff: float) -> Tensor:
    """0.5 (cos(pi d / c) + 1) for d < c, else 0 (exactly, and its gradient, at the neighbor
    list's padding, d == c), ``[*, 1]``: ``mirage::radial_basis`` with no basis, one kernel forward
    and one backward where PyTorch's cos, square and where took 15 between them."""
    return ops.radial_basis(d, "none", 1, cutoff, "cosine")


def _stack(tensors: Sequence[Tensor]) -> Tensor:
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def _batched_linear(x: Tensor, linears: Sequence[nn.Linear]) -> Tensor:
    """``[linear(x[t]) for t]`` as one batched GEMM: x ``[T, P, in]`` -> ``[T, P, out]``."""
    weight = _stack([linear.weight for linear in linears]).transpose(1, 2)
    if linears[0].bias is None:
        return torch.bmm(x, weight)
    return torch.baddbmm(_stack([linear.bias for linear in linears]).unsqueeze(1), x, weight)


def _with_bias_column(linear: nn.Linear) -> Tensor:
    """``[W; b]^T`` ``[in (+1), out]``: ``[x, 1] @ it == linear(x)`` (just ``W^T`` without a bias)."""
    if linear.bias is None:
        return linear.weight.t()
    return torch.cat([linear.weight, linear.bias.unsqueeze(-1)], dim=1).t()


def _apply_linear(x: Tensor, linear: nn.Linear, residual: Optional[Tensor] = None) -> Tensor:
    """``linear(x) + residual`` by ``mirage::linear`` (the timed fastest of cuBLASLt's algorithms
    and its own tiled kernel, for x's gradient too; the residual in the epilogue): PyTorch's cuBLAS
    matmuls of a molecule's few rows are slow (float32 [12, 384] x [384, 128] took 52 us on an
    H200, mirage::linear 3.4; docs/perf/forcefield.md)."""
    return ops.linear(x, linear.weight, linear.bias, residual)


def _mlp(x: Tensor, sequential: nn.Sequential, activation: str, residual: Optional[Tensor] = None) -> Tensor:
    first, second = sequential[0], sequential[2]
    return _apply_linear(ACTIVATIONS[activation](_apply_linear(x, first)), second, residual)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _mlp_module(inputs: int, hidden: int, outputs: int, activation: str) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, hidden), Activation(activation), nn.Linear(hidden, outputs))


class _Block(nn.Module):
    """A container of named modules (an interaction, message or update); it has no forward."""

    def __init__(self, **modules: nn.Module) -> None:
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)


class _Neighbors(NamedTuple):
    pairs: Tensor
    shifts: Tensor
    num_pairs: Tensor
    order: Optional[Tensor]
    vectors: Tensor
    distances: Tensor


@torch.compiler.assume_constant_result  # a property of the device, fixed per process
def _whole_model_clusters(device: str) -> bool:
    """Whether the whole-model ops run as a thread-block cluster on ``device`` (a tensor's device,
    with its index): sm_90 on, unless MIRAGE_CLUSTER_LIMIT=1; else as one block (docs/ops.md).
    The cache is a function of its own: torch.compile traces into an lru_cache wrapper, and
    from there into the C++ query, which it cannot."""
    return _whole_model_clusters_on(device)


@functools.lru_cache(maxsize=None)  # asked on every forward
def _whole_model_clusters_on(device: str) -> bool:
    from .. import _C

    return bool(_C.whole_model_clusters(device))


class _FusedModel(nn.Module):
    """The neighbor search and the capacity protocol, shared by SchNet and PaiNN."""

    num_pairs: Tensor
    # The shape of the energy forward returns: (), or the one-element shape of the model this one
    # was built from ((1,), (1, 1): mirage.ff.optimize's probe reads it), so that callers see no
    # difference.
    energy_shape: Tuple[int, ...] = ()

    def __init__(self, cutoff: float, max_pairs: Optional[int]) -> None:
        super().__init__()
        cutoff = float(cutoff)
        if not (math.isfinite(cutoff) and cutoff > 0):
            raise ValueError(f"{self._who}: cutoff must be finite and > 0, got {cutoff}")
        self.cutoff = cutoff
        self.max_pairs = max_pairs
        # How far the basis of the model this one was built from (its `centers` or `frequencies`)
        # is from the exact one computed here, relative: float32 rounding in the reference models
        # even in float64, since they build their buffers in float32 before any .double().
        self.basis_rounding = 0.0
        self.register_buffer("num_pairs", torch.zeros(1, dtype=torch.int64), persistent=False)
        # pbc patterns that are neither all-open nor all-periodic, as device tensors: made on the
        # first call that sees the pattern (eagerly, before any capture), read by later ones.
        self._pbc_tensors: Dict[Tuple[torch.device, Tuple[bool, ...]], Tensor] = {}
        # SchNet.prepared_weights: the prepared tensor, the weights it was made from (their values,
        # concatenated), and whether the whole-model op reads it (inside the context).
        self._prepared_weights: Optional[Tensor] = None
        self._prepared_from: Optional[Tensor] = None
        self._use_prepared = False

    @property
    def _who(self) -> str:
        """The class's name in messages: ``mirage.ff.fused.SchNet`` (a subclass: its own name)."""
        return f"mirage.ff.fused.{type(self).__name__}"

    @property
    def max_pairs(self) -> Optional[int]:
        """The neighbor-list capacity of the next forward; None: chosen by the next forward."""
        return self._max_pairs

    @max_pairs.setter
    def max_pairs(self, value: Optional[int]) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{self._who}: max_pairs must be None or an int >= 1, "
                             f"got {value!r}")
        self._max_pairs = value

    @staticmethod
    def _may_sync(positions: Tensor) -> bool:
        """Whether this call may read device values on the host: not under a CUDA-graph capture
        nor torch.compile."""
        return not (torch.compiler.is_compiling() or (positions.is_cuda and torch.cuda.is_current_stream_capturing()))

    def _grown(self, positions: Tensor) -> bool:
        """After a call that ran the neighbor search: whether its pairs overflowed the capacity,
        which is then grown for the call to be made again. Only outside a CUDA-graph capture and
        torch.compile, where reading the count back (one host sync) is allowed, and outside
        :func:`mirage.ff.capacity.checked_by_caller`; there the caller checks ``num_pairs`` (the
        capacity protocol)."""
        if capacity.caller_checks() or torch.compiler.is_compiling():
            return False
        if positions.is_cuda and torch.cuda.is_current_stream_capturing():
            # Asked only outside torch.compile, which cannot trace the question.
            capacity.refuse_unchecked_capture(self._who)
            return False
        found = int(self.num_pairs)
        needed = capacity.needed_pairs(self, found)  # raises on -1, the search's invalid-input flag
        if needed is None:
            return False
        graphs.progress(f"{self._who}: {found} neighbor pairs exceed the capacity of "
                        f"{self._max_pairs} (max_pairs); growing it to {needed} and computing again")
        self.max_pairs = needed
        return True

    def _shaped(self, energy: Tensor) -> Tensor:
        return energy.reshape(self.energy_shape) if self.energy_shape else energy

    def _energy_of_no_atoms(self, positions: Tensor) -> Tensor:
        """0, the reference models' sum over no atoms, connected as theirs is to the positions and
        to every parameter (with zero gradients): a training step's ``autograd.grad`` over the
        parameters then needs no ``allow_unused`` for an empty system in its batch."""
        return positions.sum() + sum(p.flatten()[:0].sum() for p in self.parameters())

    def _checked(self, compute: Callable[[], Any], atomic_numbers: Tensor, positions: Tensor,
                 empty: Callable[[], Any]) -> Any:
        """``compute()`` (a forward; None when it ran no neighbor search) on checked inputs,
        computed again with a grown capacity for as long as its neighbor list overflows
        (:meth:`_grown`); ``empty()`` for a system without atoms (no pairs to search: the
        reference models' energy is their sum over no atoms, 0). The atomic numbers' range is
        read (a host sync) where the count is."""
        name = self._who
        if positions.dim() != 2 or positions.shape[-1] != 3:
            raise ValueError(f"{name}: positions must be [N, 3], got {list(positions.shape)}")
        if positions.dtype != self.embedding.weight.dtype:
            raise ValueError(f"{name}: positions are {str(positions.dtype).replace('torch.', '')} but the model's "
                             f"parameters are {str(self.embedding.weight.dtype).replace('torch.', '')}; pass positions "
                             "(and cell) in the model's dtype")
        if atomic_numbers.shape != positions.shape[:1]:
            raise ValueError(f"{name}: atomic_numbers must be [N] for positions [N, 3] (N = {positions.shape[0]}), "
                             f"got {list(atomic_numbers.shape)}")
        if positions.shape[0] == 0:
            return empty()
        if self._may_sync(positions) and atomic_numbers.numel():
            # Before the embedding reads them: on CUDA an index past its rows is a device-side assert.
            low, high = torch.stack(torch.aminmax(atomic_numbers)).tolist()
            species = self.embedding.num_embeddings
            if low < 0 or high >= species:
                raise ValueError(f"{name}: atomic numbers must be in [0, {species}) (the embedding's rows, max_z), "
                                 f"got {low} to {high}")
        for _ in range(capacity.MAX_GROWS):
            result = compute()
            if result is None or not self._grown(positions):
                return result
        raise RuntimeError(f"{name}: the neighbor list still overflows after {capacity.MAX_GROWS} grows of max_pairs")

    # The reference models keep their radial basis as a buffer, which the fused ones compute
    # instead (mirage::radial_basis): its state-dict key and its float64 values, so that state
    # dicts load both ways and a checkpoint of another basis is refused rather than ignored.
    basis_key: str

    def basis_values(self) -> Tensor:
        raise NotImplementedError  # SchNet's and PaiNN's

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        weight = self.embedding.weight
        destination[prefix + self.basis_key] = self.basis_values().to(weight.device, weight.dtype)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + self.basis_key
        if key not in state_dict:
            return
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        values, expected = state_dict[key].detach().to("cpu", torch.float64).reshape(-1), self.basis_values()
        scale = float(expected.abs().max())
        if values.shape != expected.shape or not torch.allclose(values, expected, rtol=1e-6, atol=1e-6 * scale):
            error_msgs.append(f"{key}: the checkpoint's basis ({values.numel()} values from {float(values[0]):.6g} "
                              f"to {float(values[-1]):.6g}) is not the one this model computes "
                              f"({expected.numel()} from {float(expected[0]):.6g} to {float(expected[-1]):.6g})")

    def _boundaries(self, positions: Tensor, cell, pbc) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """(cell, pbc) as mirage::neighbor_list takes them, read like the reference models: no pbc
        means open boundaries whatever the cell; pbc needs a cell."""
        if pbc is None:
            return None, None
        if cell is None:
            raise ValueError(f"{self._who}: pbc was given without a cell; pass the cell too "
                             "(or pbc=None for open boundaries)")
        cell = torch.as_tensor(cell, dtype=positions.dtype, device=positions.device)
        if isinstance(pbc, Tensor) and pbc.device.type != "cpu":
            # Flags on the GPU are never read on the host (graph-safe): all three are passed on.
            return cell, pbc if pbc.dtype == torch.bool else pbc.bool()
        flags = tuple(bool(flag) for flag in torch.as_tensor(pbc).reshape(-1).tolist())
        if len(flags) != 3:
            raise ValueError(f"{self._who}: pbc must have 3 flags, got {len(flags)}")
        if not any(flags):
            return None, None  # ASE's molecules carry a zero cell with pbc all False
        if all(flags):
            return cell, None  # neighbor_list's pbc=None: every axis of the cell periodic
        key = (positions.device, flags)
        if key not in self._pbc_tensors:
            self._pbc_tensors[key] = torch.tensor(flags, dtype=torch.bool, device=positions.device)
        return cell, self._pbc_tensors[key]

    def _capacity(self, positions: Tensor, cell: Optional[Tensor], pbc: Optional[Tensor]) -> int:
        """The neighbor-list capacity (``cell``, ``pbc`` as :meth:`_boundaries` gives them); when none
        was set, the first call (a forward or ``energy_and_gradient``) chooses it."""
        if self._max_pairs is None:
            self._max_pairs = self._chosen_capacity(positions, cell, pbc)
        return self._max_pairs

    def _chosen_capacity(self, positions: Tensor, cell: Optional[Tensor], pbc: Optional[Tensor]) -> int:
        """Every pair of a small open system, otherwise the pairs counted (one host sync, this once)
        with headroom, rounded up."""
        n = positions.shape[0]
        all_pairs = max(n * (n - 1), 1)
        if cell is None and all_pairs <= _ALL_PAIRS_UP_TO:
            return all_pairs
        with torch.no_grad():
            count = int(ops.neighbor_list(positions.detach(), self.cutoff, None if cell is None else cell.detach(),
                                          pbc, max_pairs=max(n, 1)).num_pairs)
        if count < 0:
            raise ValueError(f"{self._who}: the neighbor list found invalid input "
                             "(non-finite positions or cell, or a singular cell)")
        capacity = _round_up(int(count * _CAPACITY_HEADROOM) + _CAPACITY_ROUNDING, _CAPACITY_ROUNDING)
        return min(capacity, all_pairs) if cell is None else capacity

    def _neighbors(self, positions: Tensor, cell: Optional[Tensor], pbc: Optional[Tensor]) -> _Neighbors:
        """The pairs [2, P], their shifts [P, 3], their true count, their sender order, the vectors
        r_j - r_i + shift [P, 3] and distances [P], with P = max_pairs; ``cell`` and ``pbc`` as
        :meth:`_boundaries` gives them. The order (CUDA only;
        mirage::sender_order, the padding past the count last) is formed once for the backwards of
        every op over the pairs, which would otherwise each sort them again (three to four times a
        call at 3,000 atoms, ~18 us each on an H200)."""
        pairs, shifts, _, num_pairs = ops.neighbor_list(positions, self.cutoff, cell, pbc,
                                                        max_pairs=self._capacity(positions, cell, pbc))
        self.num_pairs.copy_(num_pairs)
        # The vectors are formed again by mirage::pair_vectors: its backward is a scatter onto the
        # atoms, cheaper than neighbor_list's (which recomputes its outputs) and than PyTorch's
        # index_select backward (131 us at 3,000 atoms on an H200). The shifts carry a gradient for
        # the cell only; detached otherwise, so that no shift gradient is formed for forces alone.
        if cell is None or not cell.requires_grad:
            shifts = shifts.detach()
        order = ops.sender_order(pairs, positions.shape[0], num_pairs) if pairs.is_cuda else None
        vectors, distances = ops.pair_vectors(positions, pairs, shifts, sender_order=order)
        return _Neighbors(pairs, shifts, num_pairs, order, vectors, distances)

    @classmethod
    def _assemble(cls, model: nn.Module, cutoff: float, max_pairs: Optional[int], num_rbf: int,
                  basis_rounding: float, readout_activation: str, **parts) -> "_FusedModel":
        """The fused model of ``model`` from its recognised parts (``from_model``'s last step):
        the embedding and readout shared with ``model``, ``parts`` set as attributes, on the
        embedding's device (the num_pairs buffer) and in ``model``'s training mode."""
        fused = cls.__new__(cls)
        _FusedModel.__init__(fused, cutoff, max_pairs)
        fused.num_rbf = num_rbf
        fused.basis_rounding = basis_rounding
        fused.embedding = model.embedding
        fused.readout = _shared_mlp(model.readout, readout_activation)
        fused.readout_activation = readout_activation
        for name, value in parts.items():
            setattr(fused, name, value)
        fused.to(device=model.embedding.weight.device)
        # The model's mode on mirage's own modules only: fused.train() would set it on the Linears
        # and the embedding it shares with the model too, changing the model passed in.
        shared = {id(module) for module in model.modules()}
        for module in fused.modules():
            if id(module) not in shared:
                module.training = model.training
        return fused

    def _readout(self, x: Tensor) -> Tensor:
        atomic = _mlp(x, self.readout, self.readout_activation)
        # Under autocast the atomic energies come out in float16/bfloat16; their sum is taken in
        # float32 at least (in the same kernel), so the total keeps what precision they have.
        return atomic.sum(dtype=torch.promote_types(atomic.dtype, torch.float32))

    def _eval_kernels(self, positions: Tensor) -> bool:
        """Whether the eval-mode kernels (schnet_energy, painn_energy, cfconv) may run: eval mode,
        on CUDA, float32 positions and parameters. Under autocast too: they are float32 kernels
        and run in float32 there (cfconv by its autocast policy; the whole-model ops take the
        model's float32 parameters and pair vectors as they are), which for these models is
        faster than the layers in bfloat16 (docs/perf/forcefield.md). Static, like the choices
        built on it: never the data, so they are graph-safe."""
        return (not self.training and positions.is_cuda and positions.dtype == torch.float32
                and self.embedding.weight.dtype == torch.float32)

    def _whole_model_kernel(self, atomic_numbers: Tensor, positions: Tensor) -> bool:
        """Whether this forward runs as the model's one whole-model op (mirage::schnet_energy,
        mirage::painn_energy): eval-mode kernels allowed, a capacity and an atom count within the
        model's whole_model_max_pairs and whole_model_max_atoms (one_block_max_pairs and
        one_block_max_atoms where the op runs as one block: GPUs before sm_90), a structure the op
        takes (:meth:`_whole_model_structure`). Static, never the data, so the choice is
        graph-safe. The ops take int64 atomic numbers only; nn.Embedding takes int32 too, so those
        keep the layers."""
        if not (self._eval_kernels(positions) and atomic_numbers.dtype == torch.int64 and self._max_pairs is not None):
            return False
        if _whole_model_clusters(str(positions.device)):
            max_pairs, max_atoms = self.whole_model_max_pairs, self.whole_model_max_atoms
        else:
            max_pairs, max_atoms = self.one_block_max_pairs, self.one_block_max_atoms
        return self._max_pairs <= max_pairs and positions.shape[0] <= max_atoms and self._whole_model_structure()

    def energy_and_gradient(self, atomic_numbers: Tensor, positions: Tensor, cell: Optional[Tensor] = None,
                            pbc: Optional[Tensor] = None) -> Optional[Tuple[Tensor, Tensor]]:
        """(energy ``[]``, its gradient in ``positions`` ``[N, 3]``) without autograd, when
        ``forward`` would run as the model's whole-model op (see :meth:`forward`: eval mode, CUDA,
        float32, int64 atomic numbers, the capacity and atom limits, the structure the op takes);
        None otherwise, and when ``forward`` is not this class's own (a subclass overrides it) or
        forward hooks are registered, which this path would skip. The kernels that ``forward`` and
        ``torch.autograd.grad`` run, less autograd's own work (a fill of the energy's gradient, the
        product of the op's pair-vector gradient with it, and the host's bookkeeping) and the
        scatter of that gradient onto the atoms, which the op does itself (mirage.ff.Calculator and
        mirage.ff.md call this; a few µs of a small molecule's step). The
        first call chooses the neighbor capacity, as the first forward does; an overflow outside a
        capture grows it, as in a forward."""
        if not self._eval_kernels(positions) or not self._forward_is_plain():
            return None
        return self._checked(lambda: self._whole_model_energy_and_gradient(atomic_numbers, positions, cell, pbc),
                             atomic_numbers, positions, lambda: (positions.new_zeros(()), torch.zeros_like(positions)))

    def _whole_model_energy_and_gradient(self, atomic_numbers: Tensor, positions: Tensor, cell: Optional[Tensor],
                                         pbc: Optional[Tensor]) -> Optional[Tuple[Tensor, Tensor]]:
        cell, pbc = self._boundaries(positions, cell, pbc)
        self._capacity(positions, cell, pbc)
        if not self._whole_model_kernel(atomic_numbers, positions):
            return None
        with torch.no_grad():
            searched = self._all_pairs_energy(atomic_numbers, positions, cell)
            if searched is not None:
                return searched
            found = self._neighbors(positions, cell, pbc)
            # The op scatters its pair-vector gradient onto the atoms itself (no pair_vectors_backward).
            energy, _, grad = self._whole_model_op(atomic_numbers, found.pairs, found.vectors)
        return energy, grad

    def _all_pairs_energy(self, atomic_numbers: Tensor, positions: Tensor,
                          cell: Optional[Tensor]) -> Optional[Tuple[Tensor, Tensor]]:
        """Where the model has a whole-model op that searches the pairs itself and may use it:
        (energy, its gradient in the positions), the pair count written into ``num_pairs``; None
        otherwise (the neighbor list's path). Called where the whole-model op runs."""
        return None

    def _forward_is_plain(self) -> bool:
        """Whether calling the model runs SchNet's or PaiNN's forward as written here: no subclass
        overriding it, nothing a call adds (:func:`mirage.nn.calls.forward_extras`: hooks, a
        forward set on the instance), no global forward hooks (energy_and_gradient would skip any
        of them)."""
        global_hooks = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks)
        return (type(self).forward in (SchNet.forward, PaiNN.forward) and forward_extras(self) is None
                and not any(global_hooks))

    def _with_biases(self, linears: Sequence[nn.Linear]) -> List[Tensor]:
        """Each Linear's weight and bias, the parameters themselves (shared, never copied), an
        empty tensor for an absent bias: the whole-model ops' ``weights``."""
        none = self.embedding.weight.new_empty(0)
        return [t for linear in linears for t in (linear.weight, none if linear.bias is None else linear.bias)]

    def extra_repr(self) -> str:
        return f"cutoff={self.cutoff}, max_pairs={self._max_pairs}"


# ------------------------------------------------------------------------------------------------
# Structure recognition: what a model must hold to be rebuilt. Classes are never looked at, only
# the modules and attributes that the reference models' forward uses.


def _child(parent: nn.Module, name: str, where: str) -> nn.Module:
    child = getattr(parent, name, None)
    if not isinstance(child, nn.Module):
        raise ValueError(f"{where} has no submodule `{name}`")
    return child


def _linear(parent: nn.Module, name: str, where: str, in_features: Optional[int] = None,
            out_features: Optional[int] = None, bias: Optional[bool] = None) -> nn.Linear:
    path = f"{where}.{name}" if where else name
    module = _child(parent, name, where or "the model")
    return _check_linear(module, path, in_features, out_features, bias)


def _check_linear(module: nn.Module, path: str, in_features: Optional[int], out_features: Optional[int],
                  bias: Optional[bool] = None) -> nn.Linear:
    # Exact type: a subclass of nn.Linear may compute something else in its forward.
    if type(module) is not nn.Linear:
        raise ValueError(f"{path} is a {type(module).__name__}, not an nn.Linear")
    if in_features is not None and module.in_features != in_features:
        raise ValueError(f"{path} takes {module.in_features} features, expected {in_features}")
    if out_features is not None and module.out_features != out_features:
        raise ValueError(f"{path} gives {module.out_features} features, expected {out_features}")
    if bias is not None and (module.bias is not None) != bias:
        raise ValueError(f"{path} {'has no' if bias else 'has a'} bias, unlike the others of its kind")
    return module


def _sequential_mlp(parent: nn.Module, name: str, where: str, in_features: int,
                    out_features: int) -> Tuple[nn.Linear, str, nn.Linear]:
    """(first Linear, activation name, second Linear) of ``Sequential(Linear, activation, Linear)``."""
    path = f"{where}.{name}" if where else name
    module = _child(parent, name, where or "the model")
    if type(module) is not nn.Sequential or len(module) != 3:
        raise ValueError(f"{path} is not an nn.Sequential of (Linear, activation, Linear)")
    first = _check_linear(module[0], f"{path}.0", in_features, None)
    second = _check_linear(module[2], f"{path}.2", first.out_features, out_features)
    return first, identify_activation(module[1], f"{path}.1"), second


def _module_list(model: nn.Module, name: str) -> List[nn.Module]:
    modules = getattr(model, name, None)
    if type(modules) not in (nn.ModuleList, nn.Sequential) or len(modules) == 0:
        raise ValueError(f"`{name}` is not a non-empty nn.ModuleList")
    return list(modules)


def _cutoff(model: nn.Module) -> float:
    cutoff = getattr(model, "cutoff", None)
    if isinstance(cutoff, Tensor) and cutoff.numel() == 1:
        cutoff = cutoff.item()
    if isinstance(cutoff, bool) or not isinstance(cutoff, (int, float)) or not math.isfinite(cutoff) or cutoff <= 0:
        raise ValueError(f"no finite positive `cutoff` attribute (got {cutoff!r})")
    return float(cutoff)


def _embedding(model: nn.Module) -> nn.Embedding:
    embedding = _child(model, "embedding", "the model")
    if type(embedding) is not nn.Embedding:
        raise ValueError(f"embedding is a {type(embedding).__name__}, not an nn.Embedding")
    if embedding.max_norm is not None:
        raise ValueError("embedding has max_norm set (it renormalizes its weights in place on lookup)")
    return embedding


def _check_tensors(model: nn.Module) -> None:
    tensors = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
    dtypes = {t.dtype for t in model.parameters()}
    devices = {t.device for t in tensors}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise ValueError(f"the parameters must share one floating dtype, got {sorted(map(str, dtypes))}")
    if len(devices) != 1:
        raise ValueError(f"the parameters and buffers are on several devices: {sorted(map(str, devices))}")


def _gaussian_centers(cutoff: float, num_rbf: int) -> Tensor:
    """SchNet's basis: Gaussians centered evenly over [0, cutoff] (float64)."""
    return torch.linspace(0.0, cutoff, num_rbf, dtype=torch.float64)


def _bessel_frequencies(cutoff: float, num_rbf: int) -> Tensor:
    """PaiNN's basis: sin(n pi d / cutoff) / d, n = 1..num_rbf (float64)."""
    return torch.arange(1, num_rbf + 1, dtype=torch.float64) * (math.pi / cutoff)


def _buffer(model: nn.Module, name: str, expected: Tensor, what: str) -> float:
    """The model's RBF buffer equals what mirage::radial_basis computes, to float32 rounding;
    returns the largest difference relative to the largest value."""
    values = getattr(model, name, None)
    if not isinstance(values, Tensor):
        raise ValueError(f"no `{name}` tensor (the {what})")
    values = values.detach().to("cpu", torch.float64).reshape(-1)
    if values.shape != expected.shape:
        raise ValueError(f"`{name}` has {values.numel()} entries, the filters read {expected.numel()}")
    scale = float(expected.abs().max())
    if not torch.allclose(values, expected, rtol=1e-6, atol=1e-6 * scale):
        raise ValueError(f"`{name}` is not {what}, which is what mirage::radial_basis computes")
    return float((values - expected).abs().max()) / scale


# ------------------------------------------------------------------------------------------------
# SchNet


class SchNet(_FusedModel):
    """SchNet (continuous-filter convolutions) on mirage's ops.

    ``x = embedding(Z)``; per interaction ``x += f2out(sum_j in2f(x)_j * filter(rbf_ij) * fcut_ij)``;
    ``energy = readout(x).sum()``; Gaussian basis over ``[0, cutoff]`` (width the spacing), cosine
    cutoff. Build it from sizes, or from a SchNet-style model with :meth:`from_model` (sharing its
    parameters), which :func:`mirage.ff.optimize` does.

    Attributes:
        max_pairs: neighbor-list capacity (None: the first forward chooses it).
        num_pairs: ``[1]`` int64 buffer, the true pair count of the last forward.
        whole_model_max_pairs: the largest capacity that runs as one schnet_energy op in eval mode (see
            :meth:`forward`; schnet_energy_all_pairs for an open system whose capacity holds every
            pair); 0 turns that path off.
        whole_model_max_atoms: ... and the most atoms. Measured crossover: docs/perf/forcefield.md.
        one_block_max_pairs, one_block_max_atoms: the same limits on GPUs before sm_90, where the
            op runs as one block instead of a thread-block cluster.
    """

    # H200, 2026-11-24 11:50 UTC, with the filter networks in a kernel of their own (profile_forcefield's
    # time_whole_model, molecules at liquid density, µs per energy+forces, one kernel vs layers):
    # 75 vs 292 at 132 pairs, 134 vs 329 at 552, 251 vs 349 at 2,256 (48 atoms), 354 vs 391 at 4,032
    # (64 atoms), 440 vs 380 at 3,968 (96 atoms), 599 vs 412 at 5,440 (docs/perf/forcefield.md). The
    # crossover depends on the atoms too (more of them a block, more row tiles a product), hence
    # both limits.
    whole_model_max_pairs = 2560
    whole_model_max_atoms = 64
    # Before sm_90 the op runs as one block, whose crossover is far lower. Measured as one block
    # on an H200 (MIRAGE_CLUSTER_LIMIT=1; 2026-11-30 22:26 UTC, the same profile, the layers
    # beside): 96 vs 236 µs at 3 atoms, 149 vs 254 at 6, 243 vs 257 at 12 (132 pairs), 333 vs 262
    # at 16 (240), 594 vs 275 at 24. Not measured on an sm_80-sm_89 GPU.
    one_block_max_pairs = 132
    one_block_max_atoms = 12
    #: Larger systems in eval mode on CUDA run each interaction as one mirage::cfconv (filter
    #: network, cutoff and message passing fused) where its kernels take the sizes; False keeps
    #: the batched filter GEMMs (for comparisons).
    fused_interactions = True
    #: True (the default): where mirage::radial_cfconv takes the sizes (CUDA: M a multiple of 4)
    #: and the filter activation is smooth (not relu), the interactions run as that op instead of
    #: cfconv: the filters read from a table of the filter network built per call in float64, both
    #: passes over the pairs without products. H200, 2026-11-27: SchNet's 3,000-atom box 0.755 ms
    #: per energy+forces against 1.134 with cfconv (docs/perf/forcefield.md). False keeps cfconv.
    radial_interactions = True
    basis_key = "centers"

    def basis_values(self) -> Tensor:
        """The Gaussian centers (float64): the reference model's ``centers`` buffer."""
        return _gaussian_centers(self.cutoff, self.num_rbf)

    def __init__(self, hidden: int = 128, num_interactions: int = 3, num_rbf: int = 20, cutoff: float = 5.0,
                 max_z: int = 100, activation: str = "shifted_softplus", max_pairs: Optional[int] = None) -> None:
        super().__init__(cutoff, max_pairs)
        if num_rbf < 1 or hidden < 2 or num_interactions < 1:
            raise ValueError(f"mirage.ff.fused.SchNet: need num_rbf >= 1, hidden >= 2, num_interactions >= 1, got "
                             f"{num_rbf}, {hidden}, {num_interactions}")
        self.num_rbf = num_rbf
        self.embedding = nn.Embedding(max_z, hidden)
        self.interactions = nn.ModuleList(
            _Block(filter=_mlp_module(num_rbf, hidden, hidden, activation),
                   in2f=nn.Linear(hidden, hidden, bias=False),
                   f2out=_mlp_module(hidden, hidden, hidden, activation))
            for _ in range(num_interactions))
        self.readout = _mlp_module(hidden, hidden // 2, 1, activation)
        self.filter_activation = activation
        self.update_activations = [activation] * num_interactions
        self.readout_activation = activation

    @classmethod
    def from_model(cls, model: nn.Module, max_pairs: Optional[int] = None) -> "SchNet":
        """The fused model computing ``model``, a SchNet-style model, sharing its parameters.

        ``model`` must hold: ``cutoff``; ``embedding`` (nn.Embedding); ``interactions``, each with
        ``filter`` = Sequential(Linear(R, H), act, Linear(H, M)), ``in2f`` = Linear(F, M) and
        ``f2out`` = Sequential(Linear(M, K), act, Linear(K, F)); ``readout`` = Sequential(Linear,
        act, Linear(., 1)); the Gaussian centers ``centers`` (evenly over [0, cutoff]) and
        ``width`` (their spacing). What its forward does with them is not seen here:
        :func:`mirage.ff.optimize` compares the two on a probe.

        Raises:
            ValueError: the reason, when the structure is not one this model reproduces.
        """
        cutoff = _cutoff(model)
        _check_tensors(model)
        embedding = _embedding(model)
        features = embedding.embedding_dim
        num_rbf = None
        blocks, filter_activations, update_activations = [], set(), []
        filter_bias = None
        for t, interaction in enumerate(_module_list(model, "interactions")):
            where = f"interactions.{t}"
            first, activation, second = _sequential_mlp(interaction, "filter", where, num_rbf, None)
            num_rbf, message_width = first.in_features, second.out_features
            if filter_bias is None:
                filter_bias = (first.bias is not None, second.bias is not None)
            elif filter_bias != (first.bias is not None, second.bias is not None):
                raise ValueError(f"{where}.filter's Linear biases differ from interactions.0's "
                                 "(the filters run as one batched GEMM)")
            filter_activations.add(activation)
            in2f = _linear(interaction, "in2f", where, features, message_width)
            _, update_activation, _ = _sequential_mlp(interaction, "f2out", where, message_width, features)
            update_activations.append(update_activation)
            blocks.append(_Block(filter=nn.Sequential(first, Activation(activation), second), in2f=in2f,
                                 f2out=_shared_mlp(interaction.f2out, update_activation)))
        if len(filter_activations) != 1:
            raise ValueError(f"the filter networks use different activations ({sorted(filter_activations)}); "
                             "they run as one batched GEMM")
        if len({(block.filter[0].weight.shape, block.filter[2].weight.shape) for block in blocks}) != 1:
            raise ValueError("the filter networks have different widths (they run as one batched GEMM)")
        _, readout_activation, _ = _sequential_mlp(model, "readout", "", features, 1)
        spacing = cutoff / (num_rbf - 1) if num_rbf > 1 else cutoff
        basis_rounding = _buffer(model, "centers", _gaussian_centers(cutoff, num_rbf),
                                 f"{num_rbf} Gaussian centers evenly over [0, {cutoff}]")
        width = getattr(model, "width", None)
        width = width.item() if isinstance(width, Tensor) and width.numel() == 1 else width
        if not isinstance(width, (int, float)) or not math.isclose(width, spacing, rel_tol=1e-6):
            raise ValueError(f"`width` is {width!r}, not the centers' spacing {spacing:.6g} that "
                             "mirage::radial_basis uses")

        return cls._assemble(model, cutoff, max_pairs, num_rbf, basis_rounding, readout_activation,
                             interactions=nn.ModuleList(blocks), filter_activation=filter_activations.pop(),
                             update_activations=update_activations)

    def swaps(self) -> List[Tuple[str, str]]:
        """``(kind, where)`` of what this model computes with mirage's ops, for the report."""
        count = len(self.interactions)
        return ([("neighbor_list", "radius graph (forward)"),
                 ("radial_basis", f"Gaussian basis ({self.num_rbf} centers, `centers`/`width`)"),
                 ("batched_filters", f"first and second Linear of the {count} filter networks "
                                     "(interactions.*.filter)")]
                + [("message_passing", f"interactions.{t}") for t in range(count)]
                + [("linear", f"interactions.{t}.{name}") for t in range(count)
                   for name in ("in2f", "f2out.0", "f2out.2")]
                + [("linear", "readout.0"), ("linear", "readout.2")])

    def forward(self, atomic_numbers: Tensor, positions: Tensor, cell: Optional[Tensor] = None,
                pbc: Optional[Tensor] = None) -> Tensor:
        """Energy (0-dim, or :attr:`energy_shape`) of atoms ``atomic_numbers`` [N] at ``positions`` [N, 3] (Å), in an
        optional ``cell`` [3, 3] (rows the lattice vectors) with ``pbc`` [3] bools (no pbc: open
        boundaries, as in the reference models).

        In eval mode, on CUDA in float32 (under autocast too, where these ops run in float32),
        systems of at most :attr:`whole_model_max_pairs` pairs (the neighbor-list capacity) and
        :attr:`whole_model_max_atoms` atoms run as one op,
        ``mirage::schnet_energy`` (``mirage::schnet_energy_all_pairs`` for an open system whose
        capacity holds every pair: the pair search inside its kernel): energy and forces (and
        stress), but no gradient in the parameters and no double backward. Larger systems under
        the same conditions run each interaction as one ``mirage::radial_cfconv`` (the filters from a float64-built table of
        the filter network) or ``mirage::cfconv`` (filter network, cutoff and message passing
        fused; :attr:`fused_interactions`, :attr:`radial_interactions`). Training mode takes the
        layer-by-layer path, which has both.

        Outside a CUDA-graph capture, an overflow of the neighbor capacity grows it and the
        energy is computed again (one host sync a call; see the module's docstring)."""
        return self._shaped(self._checked(lambda: self._energy(atomic_numbers, positions, cell, pbc), atomic_numbers,
                                          positions, lambda: self._energy_of_no_atoms(positions)))

    def _energy(self, atomic_numbers: Tensor, positions: Tensor, cell: Optional[Tensor],
                pbc: Optional[Tensor]) -> Tensor:
        """The forward without the capacity check: what a CUDA graph of it records."""
        cell, pbc = self._boundaries(positions, cell, pbc)
        self._capacity(positions, cell, pbc)
        whole_model = self._whole_model_kernel(atomic_numbers, positions)
        if whole_model:
            searched = self._all_pairs_energy(atomic_numbers, positions, cell)
            if searched is not None:
                return searched[0]
        pairs, _, num_pairs, order, vectors, distances = self._neighbors(positions, cell, pbc)
        if whole_model:
            return self._whole_model_op(atomic_numbers, pairs, vectors)[0]
        interactions = self._interaction_op(positions)
        if interactions == "radial_cfconv":
            def messages(t: int, block: nn.Module, h: Tensor) -> Tensor:
                first, second = block.filter[0], block.filter[2]
                return ops.radial_cfconv(h, distances, pairs, first.weight, first.bias, second.weight, second.bias,
                                         self.filter_activation, "gaussian", self.cutoff, "cosine", sender_order=order)
        elif interactions == "cfconv":
            rbf = ops.radial_basis(distances, "gaussian", self.num_rbf, self.cutoff, "none")
            envelope = _cosine_cutoff(distances, self.cutoff).squeeze(-1)

            def messages(t: int, block: nn.Module, h: Tensor) -> Tensor:
                first, second = block.filter[0], block.filter[2]
                # The padding past the count skipped (a fifth of the pairs at the default capacity).
                return ops.cfconv(h, rbf, envelope, pairs, first.weight, first.bias, second.weight, second.bias,
                                  self.filter_activation, sender_order=order, num_pairs=num_pairs)
        else:
            rbf = ops.radial_basis(distances, "gaussian", self.num_rbf, self.cutoff, "none")
            # unbind, not filters[t]: its backward stacks the T gradients in one pass, where each
            # select's backward would fill a zero [T, P, M] tensor and the T of them be summed.
            filters = self._filters(rbf, distances).unbind(0)

            def messages(t: int, block: nn.Module, h: Tensor) -> Tensor:
                return ops.message_passing(h, filters[t], pairs)

        x = self.embedding(atomic_numbers)
        for t, block in enumerate(self.interactions):
            h = _apply_linear(x, block.in2f)
            x = _mlp(messages(t, block, h), block.f2out, self.update_activations[t], residual=x)
        return self._readout(x)

    def _filters(self, rbf: Tensor, distances: Tensor) -> Tensor:
        """Every interaction's filters times the cutoff, ``[T, P, M]``, as batched GEMMs."""
        count = len(self.interactions)
        blocks = list(self.interactions)
        first, second = [block.filter[0] for block in blocks], [block.filter[2] for block in blocks]
        # The first bias rides in the GEMM as a column of ones beside the [P, R] basis (baddbmm
        # would first copy it over the whole [T, P, H] output).
        basis = torch.cat([rbf, rbf.new_ones(rbf.shape[0], 1)], dim=-1) if first[0].bias is not None else rbf
        hidden = torch.bmm(basis.expand(count, -1, -1), _stack([_with_bias_column(linear) for linear in first]))
        if self.filter_activation == "shifted_softplus":
            # (softplus(h) - log 2) W + b = softplus(h) W + (b - log 2 * sum_k W_k): the shift
            # folds into the second bias instead of a pass over the [T, P, H] hidden layer.
            weight = _stack([linear.weight for linear in second]).transpose(1, 2)  # [T, H, M]
            bias = -_LOG2 * weight.sum(dim=1)
            if second[0].bias is not None:
                bias = bias + _stack([linear.bias for linear in second])
            filters = torch.baddbmm(bias.unsqueeze(1), F.softplus(hidden), weight)
        else:
            filters = _batched_linear(ACTIVATIONS[self.filter_activation](hidden), second)
        return filters * _cosine_cutoff(distances, self.cutoff)

    def _interaction_op(self, positions: Tensor) -> str:
        """How the interactions run outside the whole-model op: ``"radial_cfconv"`` or
        ``"cfconv"`` (the filter network fused with the message passing; eval-mode kernels
        allowed, :attr:`fused_interactions` and :attr:`radial_interactions`, sizes the op's CUDA
        kernels take), else ``"layers"`` (batched filter GEMMs and message_passing). Static, never
        the data: graph-safe."""
        if not (self.fused_interactions and self._eval_kernels(positions)):
            return "layers"
        if self.radial_interactions and self._tables_supported(positions.device):
            return "radial_cfconv"
        return "cfconv" if ops.cfconv_supported(*self._filter_sizes(), positions.device) else "layers"

    def _filter_sizes(self) -> Tuple[int, int, int]:
        """The filter networks' (inputs, hidden width, outputs), as the fused kernels' checks take them."""
        return self.num_rbf, self.interactions[0].filter[0].out_features, self.interactions[0].filter[2].out_features

    def _tables_supported(self, device: torch.device) -> bool:
        """Whether the filter networks can be tabulated on ``device`` (radial_cfconv's tables, and
        schnet_energy_prepare's): a smooth activation, sizes the table kernel takes (on CUDA a
        width that is a multiple of 4)."""
        return self.filter_activation != "relu" and ops.radial_cfconv_supported(*self._filter_sizes(), device)

    def _whole_model_structure(self) -> bool:
        return len(self.interactions) <= 8 and _same_widths(
            self.interactions,
            lambda block: (block.filter[0], block.filter[2], block.in2f, block.f2out[0], block.f2out[2]))

    def _whole_model_op(self, atomic_numbers: Tensor, pairs: Tensor,
                        vectors: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """mirage::schnet_energy: (energy, its gradient in the pair vectors, in the positions)."""
        return ops.schnet_energy(atomic_numbers, self.embedding.weight, pairs, vectors, self.cutoff, self.num_rbf,
                                 self._kernel_weights(), self._kernel_activations(),
                                 self._prepared_weights if self._use_prepared else None)

    def _all_pairs_energy(self, atomic_numbers: Tensor, positions: Tensor,
                          cell: Optional[Tensor]) -> Optional[Tuple[Tensor, Tensor]]:
        """mirage::schnet_energy_all_pairs for an open system whose capacity holds every pair (a
        molecule of up to 51 atoms at the default capacity and limits): the search inside the
        op's kernel, so that the neighbor list, the count's copy into ``num_pairs`` and the pair
        vectors are no kernels of their own (docs/perf/forcefield.md, "The pair search inside SchNet's
        kernel"). The op counts the pairs within the cutoff as the neighbor list does."""
        atoms = positions.shape[0]
        if cell is not None or self._max_pairs < atoms * (atoms - 1):
            return None
        return ops.schnet_energy_all_pairs(atomic_numbers, self.embedding.weight, positions, self.cutoff,
                                           self.num_rbf, self._kernel_weights(), self._kernel_activations(),
                                           self._prepared_weights if self._use_prepared else None,
                                           num_pairs=self.num_pairs)

    @contextlib.contextmanager
    def prepared_weights(self) -> Iterator[None]:
        """A context in which the whole-model op (mirage::schnet_energy: :meth:`forward` and
        :meth:`energy_and_gradient` on small systems in eval mode) reads its filter tables, its
        transposed weights and the first interaction's in2f of each embedding row from
        :func:`mirage.ops.schnet_energy_prepare`'s output, made on entry, instead of forming them
        in every call: one CUDA kernel a call instead of two, and one product less. For runs of
        many calls with weights that do not change: :class:`mirage.ff.md.VelocityVerlet` enters it
        for each run.

        On entry the weights, the embedding's included, are compared with those the tensor was made
        from (one comparison on the device, which waits for it): if any differs, however it was
        changed, the tensor is made again, into the same memory where it can, so that CUDA graphs
        captured inside an earlier entry and replayed inside a later one read it. Weights must not
        change *inside* the context: the op would then mix them with the prepared ones (the
        forward reads the current atom-wise weights, the filters, the first h and the backward's
        products the prepared), and its forces would not be its energy's gradient. Where the op
        could not take it, nothing is made: in training mode, off CUDA, not float32, a ``relu``
        filter activation (the tables interpolate), a filter width that is not a multiple of 4,
        sizes the table kernel does not take, or interactions the whole-model op does not take.
        Entering it during a CUDA-graph capture raises ``RuntimeError``. The tensor is derived
        state: copies, pickles and ``.to()`` drop it (it is made again at the next entry)."""
        self._refresh_prepared()
        outer, self._use_prepared = self._use_prepared, self._prepared_weights is not None
        try:
            yield
        finally:
            self._use_prepared = outer

    def _refresh_prepared(self) -> None:
        weight = self.embedding.weight
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{self._who}.prepared_weights: entered during a CUDA-graph capture, which "
                               "would capture the preparation too; enter it before the capture")
        if not (not self.training and weight.is_cuda and weight.dtype == torch.float32
                and self._whole_model_structure() and self._tables_supported(weight.device)):
            self._drop_prepared()
            return
        weights = self._kernel_weights()
        # Outside inference mode, so that the tensor can be made again in place after a later
        # entry outside it; without autograd (it is a constant of the weights).
        with torch.inference_mode(False), torch.no_grad():
            # By value: an in-place change through .data keeps the version counter, and a new
            # Parameter may be given a freed one's address. The embedding too: the tensor holds
            # the first interaction's in2f of its rows.
            current = torch.cat([w.detach().reshape(-1) for w in [weight, *weights]])
            old = self._prepared_from
            if old is not None and old.shape == current.shape and old.device == current.device \
                    and torch.equal(old, current):
                return
            fresh = ops.schnet_energy_prepare(weight, self.cutoff, self.num_rbf, weights, self._kernel_activations())
            if self._prepared_weights is not None and self._prepared_weights.shape == fresh.shape \
                    and self._prepared_weights.device == fresh.device:
                self._prepared_weights.copy_(fresh)
            else:
                self._prepared_weights = fresh
        self._prepared_from = current

    def _drop_prepared(self) -> None:
        self._prepared_weights = self._prepared_from = None

    def __getstate__(self):
        state = super().__getstate__()  # the prepared tensor is derived (10 MiB on the device): not kept
        state.update(_prepared_weights=None, _prepared_from=None, _use_prepared=False)
        return state

    def _apply(self, fn, *args, **kwargs):
        self._drop_prepared()  # .to(), .cpu(): made again, from the converted weights, at the next entry
        return super()._apply(fn, *args, **kwargs)

    def _kernel_weights(self) -> List[Tensor]:
        """mirage::schnet_energy's ``weights``."""
        linears = [linear for block in self.interactions
                   for linear in (block.filter[0], block.filter[2], block.in2f, block.f2out[0], block.f2out[2])]
        return self._with_biases(linears + [self.readout[0], self.readout[2]])

    def _kernel_activations(self) -> List[str]:
        return [self.filter_activation, *self.update_activations, self.readout_activation]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_rbf={self.num_rbf}, filter_activation={self.filter_activation!r}"


def _same_widths(blocks: Sequence[nn.Module], linears: Callable[[nn.Module], Sequence[nn.Linear]]) -> bool:
    """Whether every block's Linears have the first block's weight shapes: the whole-model ops take
    one width per layer for all interactions (the layer-by-layer path takes any)."""
    first = [linear.weight.shape for linear in linears(blocks[0])]
    return all([linear.weight.shape for linear in linears(block)] == first for block in blocks)


def _norm_eps(value, what: str) -> float:
    """PaiNN's norm_eps as a float: a real number or one-element tensor, finite and > 0. The fused
    model takes its value when it is built: a learnable one (requiring grad) is refused."""
    if isinstance(value, Tensor) and value.numel() == 1:
        if value.requires_grad:
            raise ValueError(f"{what} is a learnable tensor; the fused model takes a fixed number")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


def _shared_mlp(sequential: nn.Module, activation: str) -> nn.Sequential:
    """A Sequential holding the same two Linear modules (shared parameters, same names) with
    mirage's own activation module between them."""
    return nn.Sequential(sequential[0], Activation(activation), sequential[2])


# ------------------------------------------------------------------------------------------------
# PaiNN


class PaiNN(_FusedModel):
    """PaiNN (polarizable atom interaction network) on mirage's ops.

    Scalars ``s = embedding(Z)`` and vectors ``v = 0``; per interaction a message
    (``phi(s)_j * filter(rbf_ij) * fcut_ij`` split into scalar, vector-vector and vector-direction
    parts, summed over neighbors by ``mirage::vector_message_passing``) then an update
    (``U v``, ``V v``, ``mlp([s, |V v|])``); ``energy = readout(s).sum()``; sinc (Bessel) basis,
    cosine cutoff. Build it from sizes, or from a PaiNN-style model with :meth:`from_model`.

    Attributes:
        max_pairs: neighbor-list capacity (None: the first forward chooses it).
        num_pairs: ``[1]`` int64 buffer, the true pair count of the last forward.
        norm_eps: added under the square root of ``|V v|`` (default 1e-8, the reference's;
            :meth:`from_model` takes the model's): keeps its gradient finite where ``V v``
            vanishes (every atom's ``v`` starts at zero). The norm is a cone's tip there, smoothed
            over ``sqrt(norm_eps)``: in molecular dynamics a larger value makes a smoother energy
            (docs/perf/forcefield.md, the PaiNN student's NVE).
        fused_filters_min_pairs: from this neighbor capacity on, each interaction's filter is
            formed from the basis inside ``mirage::vector_message_passing`` (its ``filter_weight``)
            where its kernels can (``mirage.ops.fused_filter_supported``, float32 outside autocast;
            and on the CPU), else its own GEMM; below it the three are one batched GEMM (fewer
            launches for small molecules).
        whole_model_max_pairs, whole_model_max_atoms: the largest capacity and atom count that run
            as one painn_energy op in eval mode (see :meth:`forward`); one_block_max_pairs and
            one_block_max_atoms on GPUs before sm_90, where the op runs as one block (0: never).
    """

    norm_eps = 1e-8
    norm_eps_assumed = False  # from_model found no norm_eps on the updates (the report says so)
    fused_filters_min_pairs = 8192
    # H200, 2026-11-30 02:53 UTC (profile_forcefield.py --models painn --whole-model, molecules at
    # liquid density, µs per energy+forces, one op vs layers): 187 vs 330 at 132 pairs (12 atoms),
    # 219 vs 330 at 240 (16), 344 vs 359 at 306 (18), 362 vs 359 at 380 (20), 387 vs 362 at 552
    # (24), 569 vs 425 at 2,256 (48 atoms): past 16 atoms a block of the cluster takes two.
    whole_model_max_pairs = 320
    whole_model_max_atoms = 18
    # Before sm_90 (the op as one block) the layers: as one block on an H200 (MIRAGE_CLUSTER_LIMIT=1,
    # 2026-11-30 22:33 UTC, the same profile) the op took 310 vs 294 µs at 3 atoms, 579 vs 316 at
    # 6, 1,152 vs 326 at 12. Not measured on an sm_80-sm_89 GPU.
    one_block_max_pairs = 0
    one_block_max_atoms = 0
    basis_key = "frequencies"

    def basis_values(self) -> Tensor:
        """The Bessel frequencies (float64): the reference model's ``frequencies`` buffer."""
        return _bessel_frequencies(self.cutoff, self.num_rbf)

    def __init__(self, hidden: int = 128, num_interactions: int = 3, num_rbf: int = 20, cutoff: float = 5.0,
                 max_z: int = 100, activation: str = "silu", max_pairs: Optional[int] = None,
                 norm_eps: float = 1e-8) -> None:
        super().__init__(cutoff, max_pairs)
        if num_rbf < 1 or hidden < 2 or num_interactions < 1:
            raise ValueError(f"mirage.ff.fused.PaiNN: need num_rbf >= 1, hidden >= 2, num_interactions >= 1, got "
                             f"{num_rbf}, {hidden}, {num_interactions}")
        self.norm_eps = _norm_eps(norm_eps, "mirage.ff.fused.PaiNN: norm_eps")
        self.num_rbf = num_rbf
        self.hidden = hidden
        self.embedding = nn.Embedding(max_z, hidden)
        self.messages = nn.ModuleList(
            _Block(phi=_mlp_module(hidden, hidden, 3 * hidden, activation), filter=nn.Linear(num_rbf, 3 * hidden))
            for _ in range(num_interactions))
        self.updates = nn.ModuleList(
            _Block(U=nn.Linear(hidden, hidden, bias=False), V=nn.Linear(hidden, hidden, bias=False),
                   mlp=_mlp_module(2 * hidden, hidden, 3 * hidden, activation))
            for _ in range(num_interactions))
        self.readout = _mlp_module(hidden, hidden // 2, 1, activation)
        self.phi_activations = [activation] * num_interactions
        self.update_activations = [activation] * num_interactions
        self.readout_activation = activation

    @classmethod
    def from_model(cls, model: nn.Module, max_pairs: Optional[int] = None) -> "PaiNN":
        """The fused model computing ``model``, a PaiNN-style model, sharing its parameters.

        ``model`` must hold: ``cutoff``; ``embedding`` (nn.Embedding, width F); ``messages``, each
        with ``phi`` = Sequential(Linear(F, H), act, Linear(H, 3F)) and ``filter`` = Linear(R, 3F);
        as many ``updates``, each with ``U``, ``V`` = Linear(F, F) and ``mlp`` =
        Sequential(Linear(2F, K), act, Linear(K, 3F)); ``readout`` = Sequential(Linear, act,
        Linear(., 1)); the basis frequencies ``frequencies`` = n pi / cutoff, n = 1..R. The
        updates' ``norm_eps`` (one value for all, under the square root of ``|V v|``) is taken
        where they have it; without it the reference's 1e-8 is assumed (another value used but not
        kept there changes results only where some ``|V v|`` is small, which the probe may miss).

        Raises:
            ValueError: the reason, when the structure is not one this model reproduces.
        """
        cutoff = _cutoff(model)
        _check_tensors(model)
        embedding = _embedding(model)
        features = embedding.embedding_dim
        messages, updates = _module_list(model, "messages"), _module_list(model, "updates")
        if len(messages) != len(updates):
            raise ValueError(f"{len(messages)} messages but {len(updates)} updates")
        num_rbf, filter_bias = None, None
        kept = [_norm_eps(update.norm_eps, f"updates.{t}.norm_eps")
                for t, update in enumerate(updates) if hasattr(update, "norm_eps")]
        if (kept and len(kept) != len(updates)) or len(set(kept)) > 1:
            values = ", ".join(f"updates.{t}: {getattr(u, 'norm_eps', 'none')}" for t, u in enumerate(updates))
            raise ValueError(f"the updates' norm_eps differ ({values}); the fused model takes one")
        message_blocks, update_blocks, phi_activations, update_activations = [], [], [], []
        for t, (message, update) in enumerate(zip(messages, updates)):
            where = f"messages.{t}"
            _, phi_activation, _ = _sequential_mlp(message, "phi", where, features, 3 * features)
            filter_linear = _linear(message, "filter", where, num_rbf, 3 * features, filter_bias)
            num_rbf, filter_bias = filter_linear.in_features, filter_linear.bias is not None
            where = f"updates.{t}"
            u = _linear(update, "U", where, features, features)
            v = _linear(update, "V", where, features, features)
            _, update_activation, _ = _sequential_mlp(update, "mlp", where, 2 * features, 3 * features)
            phi_activations.append(phi_activation)
            update_activations.append(update_activation)
            message_blocks.append(_Block(phi=_shared_mlp(message.phi, phi_activation), filter=filter_linear))
            update_blocks.append(_Block(U=u, V=v, mlp=_shared_mlp(update.mlp, update_activation)))
        _, readout_activation, _ = _sequential_mlp(model, "readout", "", features, 1)
        basis_rounding = _buffer(model, "frequencies", _bessel_frequencies(cutoff, num_rbf),
                                 f"frequencies n pi / {cutoff}, n = 1..{num_rbf}")

        return cls._assemble(model, cutoff, max_pairs, num_rbf, basis_rounding, readout_activation,
                             hidden=features, messages=nn.ModuleList(message_blocks),
                             updates=nn.ModuleList(update_blocks), phi_activations=phi_activations,
                             update_activations=update_activations, norm_eps=kept[0] if kept else cls.norm_eps,
                             norm_eps_assumed=not kept)

    def swaps(self) -> List[Tuple[str, str]]:
        """``(kind, where)`` of what this model computes with mirage's ops, for the report."""
        count = len(self.messages)
        return ([("neighbor_list", "radius graph (forward)"),
                 ("radial_basis", f"sinc (Bessel) basis ({self.num_rbf} `frequencies`)"),
                 ("batched_filters", f"the {count} filter Linears (messages.*.filter; from "
                                     f"{self.fused_filters_min_pairs} pairs of neighbor capacity on, formed inside "
                                     "vector_message_passing instead, or a GEMM each where its kernels cannot)")]
                + [("vector_message_passing", f"messages.{t}") for t in range(count)]
                + [("painn_update", f"updates.{t} (norm_eps {self.norm_eps:g}"
                                    f"{', assumed: the model keeps none' if self.norm_eps_assumed else ''})")
                   for t in range(count)]
                + [("linear", f"{block}.{t}.{name}") for t in range(count)
                   for block, name in (("messages", "phi.0"), ("messages", "phi.2"), ("updates", "U"), ("updates", "V"),
                                       ("updates", "mlp.0"), ("updates", "mlp.2"))]
                + [("linear", "readout.0"), ("linear", "readout.2")])

    def forward(self, atomic_numbers: Tensor, positions: Tensor, cell: Optional[Tensor] = None,
                pbc: Optional[Tensor] = None) -> Tensor:
        """Energy (0-dim, or :attr:`energy_shape`); arguments as :meth:`SchNet.forward`.

        In eval mode, on CUDA in float32 (under autocast too, where the op runs in float32),
        systems of at most :attr:`whole_model_max_pairs` pairs (the neighbor-list capacity) and
        :attr:`whole_model_max_atoms` atoms whose ``U`` and ``V`` have no bias run as one op,
        ``mirage::painn_energy``: energy and forces (and stress), but no gradient in the
        parameters and no double backward. Training mode takes the layer-by-layer path, which has
        both. Neighbor capacity: as :meth:`SchNet.forward`."""
        return self._shaped(self._checked(lambda: self._energy(atomic_numbers, positions, cell, pbc), atomic_numbers,
                                          positions, lambda: self._energy_of_no_atoms(positions)))

    def _energy(self, atomic_numbers: Tensor, positions: Tensor, cell: Optional[Tensor],
                pbc: Optional[Tensor]) -> Tensor:
        """The forward without the capacity check: what a CUDA graph of it records."""
        pairs, _, num_pairs, order, vectors, distances = self._neighbors(positions,
                                                                         *self._boundaries(positions, cell, pbc))
        if self._whole_model_kernel(atomic_numbers, positions):
            return self._whole_model_op(atomic_numbers, pairs, vectors)[0]
        directions = vectors / distances.unsqueeze(-1)
        messages, updates = list(self.messages), list(self.updates)
        count = len(messages)
        # filter(rbf) * fcut = [rbf * fcut, fcut] @ [W; b]^T: the cutoff scales the [P, R] basis
        # and rides in the GEMM as one more input column in place of the bias, instead of a pass
        # over the [T, P, 3F] filters forward and two backward (a third of PaiNN's time at 3,000
        # atoms went to such passes on the H200). rbf * fcut is radial_basis's own envelope: no
        # broadcast product, nor its two products and sum backward.
        basis = ops.radial_basis(distances, "bessel", self.num_rbf, self.cutoff, "cosine")
        if messages[0].filter.bias is not None:
            basis = torch.cat([basis, _cosine_cutoff(distances, self.cutoff)], dim=-1)
        weights = [_with_bias_column(m.filter) for m in messages]
        if pairs.shape[1] >= self.fused_filters_min_pairs and self._forms_filters(positions, basis.shape[1]):
            # Each layer's filter formed from the basis inside vector_message_passing's kernels,
            # never written as a [P, 3F] tensor: at 3,000 atoms its GEMM and its gradient's took
            # ~300 us a layer on an H200 (docs/perf/forcefield.md).
            filters, filter_weights = [basis] * count, [weight.t() for weight in weights]
        elif pairs.shape[1] >= self.fused_filters_min_pairs:
            # One GEMM per layer: the batched one's backward stacks the layers' [P, 3F] gradients
            # into a copy first (at 3,000 atoms the three filters forward and backward took 755
            # instead of 1,020 us on an H200).
            filters, filter_weights = [basis @ weight for weight in weights], [None] * count
        else:  # one launch instead of three: 18 instead of 43 us at 132 pairs
            filters = torch.bmm(basis.expand(count, -1, -1), _stack(weights)).unbind(0)
            filter_weights = [None] * count
        s = self.embedding(atomic_numbers)
        v = s.new_zeros(s.shape[0], 3, self.hidden)
        for t, (message, update, layer_filter) in enumerate(zip(messages, updates, filters)):
            x = _mlp(s, message.phi, self.phi_activations[t])
            # The padding past the count skipped (a fifth of the pairs at the default capacity).
            ds, dv = ops.vector_message_passing(x, layer_filter, v, directions, pairs, filter_weights[t],
                                                sender_order=order, num_pairs=num_pairs)
            s, v = s + ds, v + dv
            # Two GEMMs rather than one on [U; V]: slicing that one's output would cost two
            # zero-fills and copies in the backward, more than the GEMM saved.
            uv, vv = _apply_linear(v, update.U), _apply_linear(v, update.V)
            # The norm, the cat and the gated update: 2 kernels forward and 2 backward where
            # PyTorch's ops took about 35 (a launch each inside a graph: most of a small molecule's time).
            a = _mlp(ops.painn_update_input(s, vv, self.norm_eps), update.mlp, self.update_activations[t])
            s, v = ops.painn_update(s, v, uv, vv, a)
        return self._readout(s)

    def _whole_model_structure(self) -> bool:
        return (len(self.messages) <= 8 and all(u.U.bias is None and u.V.bias is None for u in self.updates)
                and _same_widths(self.messages, lambda block: (block.phi[0], block.phi[2], block.filter))
                and _same_widths(self.updates, lambda block: (block.U, block.V, block.mlp[0], block.mlp[2])))

    def _whole_model_op(self, atomic_numbers: Tensor, pairs: Tensor,
                        vectors: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """mirage::painn_energy: (energy, its gradient in the pair vectors, in the positions)."""
        return ops.painn_energy(atomic_numbers, self.embedding.weight, pairs, vectors, self.cutoff, self.num_rbf,
                                self._kernel_weights(), self._kernel_activations(), self.norm_eps)

    def _kernel_weights(self) -> List[Tensor]:
        """mirage::painn_energy's ``weights`` (U and V without a bias slot)."""
        tensors: List[Tensor] = []
        for message, update in zip(self.messages, self.updates):
            tensors += self._with_biases((message.phi[0], message.phi[2], message.filter))
            tensors += [update.U.weight, update.V.weight]
            tensors += self._with_biases((update.mlp[0], update.mlp[2]))
        return tensors + self._with_biases((self.readout[0], self.readout[2]))

    def _kernel_activations(self) -> List[str]:
        return [*self.phi_activations, *self.update_activations, self.readout_activation]

    def _forms_filters(self, positions: Tensor, basis_width: int) -> bool:
        """Whether vector_message_passing forms the filters from the basis without a GEMM of its
        own: on CUDA in float32 outside autocast where its kernels take the sizes (static, so
        graph-safe), and on the CPU (its reference forms them in float64)."""
        if positions.device.type != "cuda":
            return True
        return (positions.dtype == torch.float32 and not torch.is_autocast_enabled("cuda")
                and ops.fused_filter_supported(self.hidden, basis_width, positions.device))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_rbf={self.num_rbf}, hidden={self.hidden}, norm_eps={self.norm_eps:g}"

