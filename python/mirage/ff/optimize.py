"""``mirage.ff.optimize``: swap a SchNet- or PaiNN-style model for mirage's fused one.

The top-level forward of such a model builds the radius graph itself, so the whole model is what
gets swapped. An explicit registry of structural recognizers looks at the model's modules and
attributes (never at its class or where it is defined) and builds :mod:`mirage.ff.fused`'s model
sharing the parameters. Before the swap is accepted both run on probe systems and their energies
and forces are compared: a structure that matches but computes something else (another cutoff
function, an extra term in the forward) is reported and left alone, never silently changed.
Nothing is patched: the user's model and classes stay as they are.
"""

from __future__ import annotations

import inspect
import math
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import graphs
from ..patterns import altered_submodule
from .fused import PaiNN, SchNet, _FusedModel
from .precision import matmul_precision

__all__ = ["FFOptimizeReport", "Recognizer", "RECOGNIZERS", "optimize", "report"]


@dataclass(frozen=True)
class Recognizer:
    """One registry entry.

    Attributes:
        name: the report's name for the style (``"SchNet-style"``).
        replacement: what it becomes, for the report.
        marks: attributes whose presence says the model is meant to be of this style; a model
            with them whose details cannot be reproduced is reported as left alone (with the
            reason), one without them as not recognised.
        build: ``build(model, max_pairs)`` returns the fused model sharing ``model``'s
            parameters, or raises ``ValueError(reason)``.
    """

    name: str
    replacement: str
    marks: Tuple[str, ...]
    build: Callable[[nn.Module, Optional[int]], nn.Module]

    def matches(self, model: nn.Module) -> bool:
        return all(isinstance(getattr(model, mark, None), nn.Module) for mark in self.marks)


RECOGNIZERS: Tuple[Recognizer, ...] = (
    Recognizer("SchNet-style", "mirage.ff.fused.SchNet", ("embedding", "interactions"), SchNet.from_model),
    Recognizer("PaiNN-style", "mirage.ff.fused.PaiNN", ("embedding", "messages", "updates"), PaiNN.from_model),
)

_REPLACEMENTS = {
    "neighbor_list": "mirage::neighbor_list (the pair vectors and distances, with their gradient: mirage::pair_vectors)",
    "radial_basis": "mirage::radial_basis (the cosine cutoff multiplied into the filters, for PaiNN into the basis)",
    "batched_filters": "one batched GEMM per layer (every interaction reads the same basis)",
    "message_passing": "mirage::message_passing",
    "vector_message_passing": "mirage::vector_message_passing",
    "painn_update": "mirage::painn_update_input and mirage::painn_update (the norm |V v|, the MLP's input and the gated update)",
    "linear": "mirage::linear (its x gradient too)",
}


@dataclass
class FFOptimizeReport:
    """What :func:`optimize` did to a model (``str()`` gives a readable summary).

    Attributes:
        model: the class name of the model passed in.
        style: the recognizer that matched (``"SchNet-style"``), or None.
        replacement: the fused model's class, when swapped.
        swaps: ``(kind, where)`` of every part computed by mirage's ops.
        left_alone: ``(where, reason)``: why the model was not swapped.
        verification: what the probe compared and the differences it found.
        seconds: time optimize took.
        inner: for a model not recognised, where inside it a recognised one sits (``"model"``), if anywhere.
        strict: whether optimize ran with ``strict=True``.
    """

    model: str
    style: Optional[str] = None
    replacement: Optional[str] = None
    swaps: List[Tuple[str, str]] = field(default_factory=list)
    left_alone: List[Tuple[str, str]] = field(default_factory=list)
    verification: List[str] = field(default_factory=list)
    seconds: float = 0.0
    inner: Optional[str] = None
    strict: bool = False

    @property
    def counts(self) -> Dict[str, int]:
        """Swaps by kind (``{"message_passing": 3, ...}``)."""
        return dict(Counter(kind for kind, _ in self.swaps))

    @property
    def swapped(self) -> bool:
        return bool(self.swaps)

    def __str__(self) -> str:
        head = f"mirage.ff.optimize({self.model})"
        outcome = "not swapped" if self.strict else "the model was returned untouched"
        if self.style is None:
            inner = (f"; a recognised model sits at `{self.inner}`: optimize that one (mirage.ff.optimize(model."
                     f"{self.inner})) and put the result in its place") if self.inner else ""
            return (f"{head}: not recognised (no SchNet-style `embedding` + `interactions`, no PaiNN-style "
                    f"`embedding` + `messages` + `updates`); {outcome}{inner}")
        if not self.swapped:
            lines = [f"{head}: {self.style}, left alone; {outcome} ({self.seconds:.1f} s)"]
            lines += [f"  {where or '(model)'}: {reason}" for where, reason in self.left_alone]
            return "\n".join(lines)
        lines = [f"{head}: {self.style} -> {self.replacement} (parameters shared), {self.seconds:.1f} s",
                 "  swapped:"]
        for kind, count in self.counts.items():
            where = [w for k, w in self.swaps if k == kind]
            lines.append(f"    {count:3d} x {kind}: {_where(where)} -> {_REPLACEMENTS.get(kind, 'fused')}")
        lines.append("  kept as PyTorch ops inside it: the embedding lookup, the activations (computed by name, not "
                     "by the model's activation modules)")
        if self.style == "SchNet-style":
            lines.append("  in eval mode on CUDA (float32 positions and parameters, under autocast too; at most 8 "
                         f"interactions), systems of up to {SchNet.whole_model_max_pairs} pairs of neighbor "
                         f"capacity and {SchNet.whole_model_max_atoms} atoms "
                         "(SchNet.whole_model_max_pairs, whole_model_max_atoms; before sm_90, where the op runs "
                         f"as one block, {SchNet.one_block_max_pairs} and {SchNet.one_block_max_atoms}: "
                         "one_block_max_pairs, one_block_max_atoms) "
                         "run as one mirage::schnet_energy op (two kernels) instead (molecules whose capacity holds "
                         "every pair: mirage::schnet_energy_all_pairs, the pair search inside its kernel), and "
                         "larger ones each "
                         "interaction as one mirage::radial_cfconv, its filters read from a table of the filter "
                         "network built per call in float64 (SchNet.radial_interactions; a smooth activation, "
                         "mirage.ops.radial_cfconv_supported), or else one mirage::cfconv, filter network and "
                         "message passing fused (SchNet.fused_interactions; H == M = 64 or 128 that fit the GPU: "
                         "mirage.ops.cfconv_supported)")
        if self.style == "PaiNN-style":
            lines.append("  in eval mode on CUDA (float32 positions and parameters, under autocast too; at most 8 "
                         f"interactions, U and V without bias), systems of up to {PaiNN.whole_model_max_pairs} pairs "
                         f"of neighbor capacity and {PaiNN.whole_model_max_atoms} atoms "
                         "(PaiNN.whole_model_max_pairs, whole_model_max_atoms; before sm_90, where the op runs "
                         f"as one block, {PaiNN.one_block_max_pairs} and {PaiNN.one_block_max_atoms}: "
                         "one_block_max_pairs, one_block_max_atoms) "
                         "run as one mirage::painn_energy op (two kernels; on sm_90 one, its features split over "
                         "a cluster, for a molecule of benzene's size: docs/ops.md) instead")
        lines += [f"  verified: {line}" for line in self.verification]
        return "\n".join(lines)


def _where(places: List[str]) -> str:
    return places[0] if len(places) == 1 else ", ".join(places)


# What optimize returned (or left alone) -> its report. Weak: a report never keeps a model alive.
_REPORTS: "weakref.WeakKeyDictionary[nn.Module, FFOptimizeReport]" = weakref.WeakKeyDictionary()


def report(model: nn.Module) -> FFOptimizeReport:
    """The report of :func:`optimize` for ``model`` (what it returned).

    Raises:
        ValueError: ``model`` did not come from :func:`optimize`.
    """
    found = _REPORTS.get(model) if isinstance(model, nn.Module) else None
    if found is None:
        raise ValueError(f"mirage.ff.report: this {type(model).__name__} was not returned by mirage.ff.optimize")
    return found


# ------------------------------------------------------------------------------------------------
# The probe

# Largest relative difference accepted between the original and the fused model: energies
# relative to max(|E|, 1), forces to the largest force component. float32 rounding differences
# reach ~1e-6 on these systems; a different model differs by far more than the bounds.
PROBE_TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
}

# Atomic numbers of the probe atoms (H, C, N, O), where the embedding has them.
_PROBE_ELEMENTS = (1, 6, 7, 8)


def _probe_systems(cutoff: float, num_species: int, dtype: torch.dtype, device: torch.device):
    """(name, Z, positions, cell, pbc), deterministic: an open cluster spanning past the cutoff; a
    triclinic box at least twice the cutoff wide (where any periodic implementation agrees:
    minimum image) with a few atoms outside it; and a slab periodic along a and b only (as wide),
    for mixed periodicity, which the other two cannot check: its c vector is short, so a model
    that made c periodic too would find pairs across it (244 pairs instead of 144, whatever the
    cutoff), and one that took the slab as open would lose those across the a and b faces (54)."""
    gen = torch.Generator().manual_seed(20240611)
    elements = [z for z in _PROBE_ELEMENTS if z < num_species] or list(range(num_species))

    def lattice(counts, jitter):  # fractional coordinates: a jittered grid of counts[0] x [1] x [2] points
        grid = torch.tensor([[a, b, c] for a in range(counts[0]) for b in range(counts[1]) for c in range(counts[2])],
                            dtype=torch.float64)
        spacing = torch.tensor(counts, dtype=torch.float64)
        return (grid + 0.5) / spacing + (torch.rand(grid.shape, generator=gen, dtype=torch.float64) - 0.5) * jitter

    grid = torch.tensor([[a, b, c] for a in range(3) for b in range(2) for c in range(2)], dtype=torch.float64)
    cluster = (grid * 0.55 + (torch.rand(grid.shape, generator=gen, dtype=torch.float64) - 0.5) * 0.2) * cutoff
    cell = torch.tensor([[2.2, 0.0, 0.0], [0.3, 2.1, 0.0], [0.2, 0.25, 2.3]], dtype=torch.float64) * cutoff
    frac = lattice((3, 3, 3), 0.1)
    frac[::5] += torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64)  # unwrapped atoms
    # Two layers 0.55 cutoff apart, 1.1 cutoff per c vector: across c the layers would be 0.55 apart too.
    slab_cell = torch.tensor([[2.2, 0.0, 0.0], [0.3, 2.1, 0.0], [0.2, 0.1, 1.1]], dtype=torch.float64) * cutoff
    slab_frac = lattice((3, 3, 2), 0.1)
    slab_frac[::5] += torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64)  # unwrapped along the periodic axes
    slab_frac[1::6, 2] += 0.5  # upper-layer atoms above the cell: the open axis bounds nothing
    systems = []
    for name, positions, system_cell, pbc in (
            ("open cluster", cluster, None, None),
            ("triclinic periodic box", frac @ cell, cell, (True, True, True)),
            ("slab periodic along a and b", slab_frac @ slab_cell, slab_cell, (True, True, False))):
        picks = torch.randint(len(elements), (positions.shape[0],), generator=gen)
        z = torch.tensor(elements, dtype=torch.long)[picks].to(device)
        systems.append((f"{name} ({positions.shape[0]} atoms)", z, positions.to(device, dtype),
                        None if system_cell is None else system_cell.to(device, dtype),
                        None if pbc is None else torch.tensor(pbc, dtype=torch.bool, device=device)))
    return systems


def _energy_forces(model: nn.Module, z: Tensor, positions: Tensor, cell, pbc) -> Tuple[Tensor, Tensor]:
    positions = positions.detach().clone().requires_grad_(True)
    energy = model(z, positions, cell, pbc)
    if energy.numel() != 1:
        raise ValueError(f"its energy has shape {list(energy.shape)}, where mirage's models return one energy "
                         "(of any shape of one element): sum it first")
    (gradient,) = torch.autograd.grad(energy, positions)
    return energy.detach().double(), -gradient.detach().double()


def _verify(original: nn.Module, fused: nn.Module) -> List[str]:
    """Energies and forces of both models on the probe systems; ValueError(numbers) on a mismatch."""
    reference = next(original.parameters())
    dtype, device = reference.dtype, reference.device
    # A basis buffer rounded to float32 (accepted by the recognizers) moves the original's
    # results by about ten times its rounding, whatever the dtype.
    tolerance = max(PROBE_TOLERANCE[dtype], 100 * fused.basis_rounding)
    lines = []
    for name, z, positions, cell, pbc in _probe_systems(fused.cutoff, fused.embedding.num_embeddings, dtype, device):
        try:
            energy, forces = _energy_forces(original, z, positions, cell, pbc)
        except Exception as error:  # user code: whatever it raises is the reason to leave it alone
            raise ValueError(f"the model itself failed on the probe {name}: {type(error).__name__}: {error}") from None
        if lines and tuple(energy.shape) != fused.energy_shape:
            raise ValueError(f"its energy's shape changes with the system: {list(fused.energy_shape)}, then "
                             f"{list(energy.shape)} for the probe {name}")
        fused.energy_shape = tuple(energy.shape)
        fused.max_pairs = None  # each probe system chooses its own capacity
        try:
            fused_energy, fused_forces = _energy_forces(fused, z, positions, cell, pbc)
        except Exception as error:
            raise ValueError(f"mirage's model failed on the probe {name}: {type(error).__name__}: {error}") from None
        energy_error = float((fused_energy - energy).abs()) / max(float(energy.abs()), 1.0)
        force_scale = float(forces.abs().max()) if forces.numel() else 1.0
        force_error = float((fused_forces - forces).abs().max()) / max(force_scale, 1e-12) if forces.numel() else 0.0
        numbers = (f"{name} in {str(dtype).replace('torch.', '')}: energy {float(energy):.6g}, relative difference "
                   f"{energy_error:.2g}; forces up to {force_scale:.3g}, max difference {force_error:.2g} of that "
                   f"(tolerance {tolerance:.0e})")
        finite = all(math.isfinite(v) for v in (energy_error, force_error))
        if not finite or energy_error > tolerance or force_error > tolerance:
            raise ValueError(f"mirage's model does not compute the same energy/forces: {numbers}")
        lines.append(numbers)
    return lines


# ------------------------------------------------------------------------------------------------
# optimize


# Called under torch.inference_mode the probe could not take gradients; optimize's own work is
# never inference-mode.
@torch.inference_mode(False)
def optimize(model: nn.Module, *, max_pairs: Optional[int] = None, strict: bool = False) -> nn.Module:
    """Returns mirage's fused version of a SchNet- or PaiNN-style force field, or ``model``.

    The model is recognised by its structure (see :meth:`mirage.ff.fused.SchNet.from_model` and
    :meth:`mirage.ff.fused.PaiNN.from_model`), rebuilt on mirage's ops with the same parameters
    (shared, not copied: training one trains the other), and checked against the original on
    probe systems (an open cluster, a triclinic periodic box and a slab periodic along two axes;
    energies and forces) in the model's dtype and on its device, at full precision (TF32 off, no
    autocast, whatever the caller holds). The model passed in is never changed.

    Args:
        model: the force field, ``energy = model(atomic_numbers, positions, cell=None, pbc=None)``.
        max_pairs: the fused model's neighbor-list capacity; None lets its first forward choose.
        strict: raise instead of returning ``model`` when it is not swapped.

    Returns:
        The fused model (same call, same energies), or ``model`` itself when it is not recognised
        or cannot be reproduced. :func:`report` says which and why.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: bad ``max_pairs``; or ``strict=True`` and the model was not swapped.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"mirage.ff.optimize: model must be an nn.Module, got {type(model).__name__}")
    if max_pairs is not None and (isinstance(max_pairs, bool) or not isinstance(max_pairs, int) or max_pairs < 1):
        raise ValueError(f"mirage.ff.optimize: max_pairs must be None or an int >= 1, got {max_pairs!r}")
    if isinstance(model, _FusedModel):
        # Its report stays: searching it again would find mirage's own model, not a reference.
        graphs.progress(f"mirage.ff.optimize: the model is already mirage's fused {type(model).__name__}; "
                        "returned as it is")
        return model
    start = time.perf_counter()
    result = FFOptimizeReport(model=type(model).__name__, strict=strict)
    recognizer = next((r for r in RECOGNIZERS if r.matches(model)), None)
    if recognizer is None:
        result.inner = next((name for name, sub in model.named_modules()
                             if name and any(r.matches(sub) for r in RECOGNIZERS)), None)
        return _untouched(model, result, strict, start)
    result.style = recognizer.name
    altered = altered_submodule(model)
    if altered is not None:
        # As mirage.optimize: the fused model would not run them, and weight_norm's hooks compute
        # the weights it reads (it would read them as the model's last forward left them).
        where, extras = altered
        result.left_alone.append((where or "(model)", f"has {extras}, which mirage's model would not run; "
                                  "remove them to optimize it"))
        return _untouched(model, result, strict, start)
    parameter = next(model.parameters(), None)
    if parameter is None:
        result.left_alone.append(("(model)", "it has no parameters: there is no network for mirage's fused "
                                  "models to take over"))
        return _untouched(model, result, strict, start)
    dtype = parameter.dtype
    if dtype not in (torch.float32, torch.float64):
        # Positions need float32 at least (the neighbor search takes no less); the products in
        # 16 bits are what precision="bf16-mixed" (autocast over a float32 model) gives.
        result.left_alone.append(("(model)", f"its parameters are {str(dtype).replace('torch.', '')}: mirage's fused "
                                  "models run float32 or float64 (positions need float32 at least); convert it with "
                                  "model.float() and use precision='bf16-mixed' for 16-bit products"))
        return _untouched(model, result, strict, start)
    try:
        fused = recognizer.build(model, max_pairs)
        _check_holds_everything(model, fused)
        _check_signature(model, fused)
        # The probe compares in the model's dtype at full precision: under the caller's autocast
        # or TF32 setting the two would differ by bfloat16's or TF32's rounding (and user code that
        # autocast breaks would be left alone).
        device_type = parameter.device.type
        with torch.enable_grad(), torch.autocast(device_type, enabled=False), matmul_precision("fp32"):
            result.verification = _verify(model, fused)
    except ValueError as reason:
        result.left_alone.append(("(model)", str(reason)))
        return _untouched(model, result, strict, start)
    # The probe's forwards chose a capacity for the probe systems, not the user's.
    fused.max_pairs = max_pairs
    fused.num_pairs.zero_()
    result.replacement = recognizer.replacement
    result.swaps = fused.swaps()
    result.seconds = time.perf_counter() - start
    _REPORTS[fused] = result
    return fused


def _check_holds_everything(model: nn.Module, fused: nn.Module) -> None:
    """ValueError unless ``fused`` holds every parameter and buffer of ``model`` (shared), but for
    the basis buffer it computes itself (``centers``/``frequencies``, checked when loaded). The
    probe compares outputs at the time of optimize: a term that is zero then (an atom-reference
    energy, a scale or shift before training, a trainable basis) would pass it and be lost."""
    held = {id(tensor) for tensor in list(fused.parameters()) + list(fused.buffers())}
    missing = [name for name, tensor in model.named_parameters() if id(tensor) not in held]
    missing += [name for name, tensor in model.named_buffers()
                if id(tensor) not in held and name.rpartition(".")[2] != fused.basis_key]
    if missing:
        raise ValueError(f"mirage's model would not use {', '.join(missing)} (the recognised {type(fused).__name__} "
                         "structure holds no such parameter or buffer: it computes the basis itself and reads the "
                         "cutoff's value once, here); the two would differ once they change (a trainable basis, a "
                         "checkpoint with another cutoff)")


def _check_signature(model: nn.Module, fused: nn.Module) -> None:
    """ValueError unless ``model.forward`` takes the fused model's arguments, by the same names: an
    extra argument (``return_atomic=False``) would be refused by the fused model, or worse, a
    keyword call by other names would fail."""
    def arguments(module: nn.Module) -> List[Tuple[str, object]]:
        return [(p.name, p.kind) for p in inspect.signature(module.forward).parameters.values()]

    try:
        theirs = arguments(model)
    except (TypeError, ValueError):
        raise ValueError("its forward's signature cannot be read") from None
    if theirs != arguments(fused):
        raise ValueError(f"its forward takes ({', '.join(name for name, _ in theirs)}), mirage's model takes "
                         f"({', '.join(name for name, _ in arguments(fused))}): calls that pass other arguments or "
                         "use other names would fail")


def _untouched(model: nn.Module, result: FFOptimizeReport, strict: bool, start: float) -> nn.Module:
    result.seconds = time.perf_counter() - start
    if strict:
        raise ValueError(f"mirage.ff.optimize(strict=True): {result}")
    _REPORTS[model] = result
    return model
