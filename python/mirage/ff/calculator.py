"""An ASE calculator around any force-field model, with one CUDA graph per atom count.

The model is any callable ``energy = model(atomic_numbers, positions, cell, pbc)`` (the reference
SchNet/PaiNN of examples/forcefield, or what :func:`mirage.ff.optimize` makes of them). Forces
are ``-dE/dpositions`` by autograd (for mirage's fused models that run as one op, from the op's own
gradient: ``energy_and_gradient``); for periodic systems the stress comes from the strain
derivative. On a GPU the whole evaluation (forward and backward) is one CUDA-graph replay.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ase.calculators.calculator import Calculator as _AseCalculator
from ase.calculators.calculator import PropertyNotImplementedError, all_changes

from .. import graphs
from .._arguments import count
from . import capacity
from .fused import _FusedModel
from .precision import PRECISIONS, check_precision, matmul_precision  # noqa: F401 (re-exported)

__all__ = ["Calculator", "PRECISIONS", "evaluate"]

def _close(a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    """``ase.calculators.calculator.equal(a, b, atol=tol)`` (shapes, then ``np.allclose`` with
    ``rtol=0``), by cheaper means where the answer is the same: equal arrays, finite differences."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if (a == b).all():
        return True
    if a.dtype.kind != "f" or b.dtype.kind != "f" or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return bool(np.allclose(a, b, rtol=0, atol=tol))
    return bool((np.abs(a - b) <= tol).all())


def _fingerprint(array: np.ndarray) -> Tuple[np.dtype, Tuple[int, ...], bytes]:
    return array.dtype, array.shape, array.tobytes()


def _same(old: np.ndarray, new: np.ndarray, tol: float, calculated: Optional[Tuple]) -> bool:
    """``_close(old, new, tol)``, by one comparison of bytes where ``new`` is what the last
    calculation saw (``calculated``: its fingerprint, kept only where it held no NaN, which is never
    close to itself): an MD step checks three times, twice against atoms that did not move."""
    if calculated is not None and _fingerprint(new) == calculated:
        return True
    return _close(old, new, tol)


def _autocast(precision: str, device_type: str):
    if precision == "bf16-mixed":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _strained(x: Tensor, strain: Tensor) -> Tensor:
    """``x @ (I + strain)`` as a broadcast sum: exact at ``strain = 0`` whatever the matmul precision
    (a TF32 ``x @ I`` would round the positions to 10 mantissa bits)."""
    return x + (x[..., :, None] * strain).sum(dim=-2)


def _volume(cell: Tensor) -> Tensor:
    # The triple product instead of linalg.det: no solver, no host synchronisation (graph-safe).
    return torch.linalg.cross(cell[0], cell[1]).mul(cell[2]).sum().abs()


def evaluate(
    model,
    atomic_numbers: Tensor,
    positions: Tensor,
    cell: Optional[Tensor] = None,
    pbc: Optional[Tensor] = None,
    *,
    stress: bool = False,
    precision: str = "fp32",
    who: str = "mirage.ff.Calculator",
    capacity_checked: bool = False,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Energy, forces and (optionally) stress of one structure, by autograd (see
    :func:`energy_and_gradients`). Graph-safe.

    Args:
        model: ``energy = model(atomic_numbers, positions, cell, pbc)``.
        atomic_numbers: ``[N]`` int64. positions: ``[N, 3]`` (Å). cell: ``[3, 3]`` rows the
            lattice vectors, or None. pbc: ``[3]`` bool, or None.
        stress: also the stress: positions and cell are strained by ``(I + eps)`` and
            ``stress = (dE/deps, symmetrized) / volume``, in ASE's sign and Voigt order
            (xx, yy, zz, yz, xz, xy), eV/Å^3. Needs ``cell``.
        precision: one of :data:`PRECISIONS`; here only autocast is applied (the caller holds
            :func:`matmul_precision` around the call and any capture).
        capacity_checked: whether the caller checks the neighbor capacity of ``model`` after the
            call, as the protocol asks (see :func:`energy_and_gradients`; the Calculator and the MD
            driver do). Not by default: a fused model then grows its own capacity on an overflow
            (a capacity left to a caller who does not check it gave a truncated pair list, and
            energy, forces and stress wrong without a word).

    Returns:
        ``(energy [] , forces [N, 3], stress [6] or None)``, detached: forces and stress in
        ``positions``' dtype, the energy in the wider of that and the model's own (a float32
        network with float64 reference energies per element keeps its float64 sum).

    Raises:
        ValueError: shapes that do not make one structure (``atomic_numbers`` not ``[N]`` for
            ``positions [N, 3]``, ``cell`` not ``[3, 3]``, ``pbc`` not ``[3]``), or ``stress``
            without a cell and pbc.
    """
    check_structure(atomic_numbers, positions, cell, pbc, who)
    if stress and (cell is None or pbc is None):
        # The models read pbc=None as an open system whatever the cell: the "stress" would be an
        # open cluster's virial over an unrelated volume.
        raise ValueError(f"{who}: the stress needs the cell (strain derivative over its volume) and pbc (the "
                         f"periodic axes; None is an open system); got cell {'None' if cell is None else 'given'}, "
                         f"pbc {'None' if pbc is None else 'given'}")
    energy, grads = energy_and_gradients(model, atomic_numbers, positions, cell, pbc, stress=stress,
                                         precision=precision, who=who, capacity_checked=capacity_checked)
    energy = energy.to(torch.promote_types(energy.dtype, positions.dtype))
    forces = grads[0].neg().to(positions.dtype)
    if not stress:
        return energy, forces, None
    g = 0.5 * (grads[1] + grads[1].transpose(0, 1))
    voigt = torch.stack((g[0, 0], g[1, 1], g[2, 2], g[1, 2], g[0, 2], g[0, 1])) / _volume(cell.detach())
    return energy, forces, voigt.to(positions.dtype)


def check_structure(atomic_numbers: Tensor, positions: Tensor, cell: Optional[Tensor], pbc: Optional[Tensor],
                    who: str) -> None:
    """Refuses shapes that do not make one structure; shapes only (no host synchronisation)."""
    if positions.dim() != 2 or positions.shape[1] != 3:
        raise ValueError(f"{who}: positions must be [N, 3], got {list(positions.shape)}")
    if atomic_numbers.shape != positions.shape[:1]:
        raise ValueError(f"{who}: atomic_numbers must be [N] for positions [N, 3] (N = {positions.shape[0]}), "
                         f"got {list(atomic_numbers.shape)}")
    if cell is not None and cell.shape != (3, 3):
        raise ValueError(f"{who}: cell must be [3, 3] (the lattice vectors as rows), got {list(cell.shape)}")
    if pbc is not None and pbc.shape != (3,):
        raise ValueError(f"{who}: pbc must be [3], got {list(pbc.shape)}")


def check_finite_results(energy: float, forces: np.ndarray, positions: np.ndarray, who: str, where: str) -> None:
    """RuntimeError unless the model's energy and forces are finite: a NaN handed on would move
    the atoms to NaN (an optimizer, an MD step) and be reported later, far from its cause. Models
    divide by distances, so the message names the closest two atoms (up to 2,000 atoms)."""
    if math.isfinite(energy) and np.isfinite(forces).all():
        return
    closest = ""
    if 2 <= len(positions) <= 2000:
        best = (math.inf, 0, 0)
        for first in range(0, len(positions), 128):  # rows in chunks: a few MB at a time
            d = np.linalg.norm(positions[first:first + 128, None] - positions[None], axis=-1)
            d[np.arange(len(d)), np.arange(first, first + len(d))] = math.inf
            i, j = np.unravel_index(np.argmin(d), d.shape)
            best = min(best, (float(d[i, j]), first + int(i), int(j)))
        distance, i, j = best
        closest = f"; the closest atoms, {min(i, j)} and {max(i, j)}, are {distance:.3g} Å apart (periodic images aside)"
    raise RuntimeError(f"{who}: the model's energy ({energy}) or forces {where} are not finite{closest}; check the "
                       "structure and the model")


def check_atomic_numbers(model, numbers: np.ndarray, who: str) -> None:
    """ValueError unless ``numbers`` (``atoms.numbers``) lie in the rows of the model's embedding,
    where it says: an ``nn.Embedding`` attribute named ``embedding`` (the reference models' and
    mirage's fused ones'); a model without one is not checked. A replayed CUDA graph runs no
    Python, so an atomic number past the rows would be read out of bounds on the GPU instead."""
    embedding = getattr(model, "embedding", None)
    if not isinstance(embedding, torch.nn.Embedding) or len(numbers) == 0:
        return
    rows = embedding.num_embeddings
    if numbers.min() < 0 or numbers.max() >= rows:
        raise ValueError(f"{who}: atoms.numbers must be in [0, {rows}) (the rows of the model's embedding), "
                         f"got {numbers.min()} to {numbers.max()}")


def energy_and_gradients(model, atomic_numbers: Tensor, positions: Tensor, cell: Optional[Tensor] = None,
                         pbc: Optional[Tensor] = None, *, stress: bool = False, precision: str = "fp32",
                         who: str = "mirage.ff.Calculator", capacity_checked: bool = False
                         ) -> Tuple[Tensor, List[Tensor]]:
    """:func:`evaluate`'s autograd part: the model's energy (``[]``, detached, in the dtype the
    model returned it in: bfloat16 under ``precision="bf16-mixed"``, say) and its gradients in the
    positions and, with ``stress``, the strain (never None), as autograd returns them. mirage's
    fused models that run as one op give the same without autograd
    (:meth:`mirage.ff.fused.SchNet.energy_and_gradient`). With ``capacity_checked`` the caller
    checks the neighbor capacity of ``model`` after the call, and a fused model does not grow its
    own (:func:`mirage.ff.capacity.checked_by_caller`; the Calculator and the MD driver, when
    :func:`mirage.ff.capacity.holder` finds the model to check). Without (the default), a fused
    model grows its own, or refuses a CUDA-graph capture (:func:`mirage.ff.capacity.unchecked_by`)."""
    with capacity.checked_by_caller() if capacity_checked else capacity.unchecked_by(who):
        return _energy_and_gradients(model, atomic_numbers, positions, cell, pbc, stress, precision, who)


def _energy_and_gradients(model, atomic_numbers: Tensor, positions: Tensor, cell: Optional[Tensor],
                          pbc: Optional[Tensor], stress: bool, precision: str, who: str) -> Tuple[Tensor, List[Tensor]]:
    if not stress and isinstance(model, _FusedModel):
        with _autocast(precision, positions.device.type):
            direct = model.energy_and_gradient(atomic_numbers, positions.detach(), cell, pbc)
        if direct is not None:
            energy, grad = direct
            return energy.reshape(()), [grad]
    with torch.enable_grad():
        positions = positions.detach().requires_grad_(True)
        wrt = [positions]
        model_positions, model_cell = positions, cell
        if stress:
            strain = torch.zeros(3, 3, dtype=positions.dtype, device=positions.device, requires_grad=True)
            wrt.append(strain)
            model_positions, model_cell = _strained(positions, strain), _strained(cell, strain)
        with _autocast(precision, positions.device.type):
            try:
                energy = model(atomic_numbers, model_positions, model_cell, pbc)
            except RuntimeError as error:
                if precision != "bf16-mixed":
                    raise
                raise RuntimeError(f"{who}: the model failed under torch.autocast(bfloat16) (precision='bf16-mixed'): "
                                   f"{error}\nIts code mixes dtypes in a way autocast does not cover (an in-place "
                                   "op between float32 and bfloat16 tensors, say); use precision='fp32' or 'tf32'"
                                   ) from error
        if not isinstance(energy, Tensor) or energy.numel() != 1 or not energy.is_floating_point():
            got = f"a {type(energy).__name__}" if not isinstance(energy, Tensor) else \
                f"a {energy.dtype} tensor of shape {list(energy.shape)}"
            raise ValueError(f"{who}: the model must return the total energy as a scalar floating-point tensor, "
                             f"got {got}")
        grads = torch.autograd.grad(energy.reshape(()), wrt, allow_unused=True) if energy.requires_grad else [None]
    if grads[0] is None:
        raise ValueError(f"{who}: the model's energy does not depend on positions (autograd found no path), "
                         "so there are no forces; does the model detach its inputs?")
    if stress and grads[1] is None:  # positions are strained, so this means the energy ignores them: never zeros
        raise ValueError(f"{who}: the model's energy does not depend on the strain of the cell, so there is no stress")
    return energy.detach().reshape(()), list(grads)


def uncapturable(who: str, error: "graphs.CaptureError", eager: str) -> RuntimeError:
    """The error for a model that ``error`` says cannot be captured: what to do instead (mirage's
    fused models, or ``eager``, the caller's own switch to run without graphs)."""
    return RuntimeError(
        f"{who}: the model cannot be captured in a CUDA graph ({str(error).splitlines()[0]}). Pass it "
        f"through mirage.ff.optimize(model) first (mirage's fused models are capturable), or use {eager}. "
        "A failed capture can leave this process's CUDA random-number generator unusable: restart it")


def check_model(model, who: str) -> None:
    """Refuses a model that cannot be called as ``model(atomic_numbers, positions, cell, pbc)``."""
    if not callable(model):
        raise ValueError(f"{who}: model must be callable as model(atomic_numbers, positions, cell, pbc), "
                         f"got a {type(model).__name__}")
    try:
        signature = inspect.signature(model.forward if isinstance(model, torch.nn.Module) else model)
    except (TypeError, ValueError):
        return  # builtins and C++ callables have no inspectable signature: trust them
    try:
        signature.bind(None, None, None, None)
    except TypeError:
        raise ValueError(f"{who}: model must be callable as model(atomic_numbers, positions, cell, pbc); "
                         f"{type(model).__name__}{signature} does not take those four arguments") from None


def model_device_dtype(model, device: Any, who: str) -> Tuple[torch.device, torch.dtype]:
    """The device to run on (``device``, else the model's, else the CPU; the model is moved there)
    and the dtype of positions: that of most of the model's floating-point parameters (counted by
    element: a float64 table of energies per element beside a float32 network leaves float32),
    else of its buffers, else float32."""
    parameters, buffers = (list(model.parameters()), list(model.buffers())) if isinstance(model, torch.nn.Module) \
        else ([], [])
    tensors = parameters + buffers
    dtype = torch.float32
    for group in (parameters, buffers):
        elements: Dict[torch.dtype, int] = {}
        for t in group:
            if t.is_floating_point():
                elements[t.dtype] = elements.get(t.dtype, 0) + t.numel()
        if elements:
            dtype = max(elements, key=elements.get)
            break
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{who}: device {device!r} is not a torch device: {error}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{who}: device {device} requested but CUDA is not available; use device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    if isinstance(model, torch.nn.Module) and any(t.device != device for t in tensors):
        model.to(device)
    return device, dtype


def on_device(device: torch.device):
    """``torch.cuda.device(device)`` on a GPU. On the CPU nothing: graphs never run there, except
    in tests, which drive the graph path with a CPU stand-in for the capture."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class CapacityWatch:
    """Drops a driver's graphs when the model's capacity is no longer the one they were captured
    with: another user of the same model (a second calculator, an MD driver) may have grown it, and
    a replay would silently keep the old one."""

    def __init__(self, model, cache: graphs.GraphCache) -> None:
        self.model, self.cache = model, cache
        self.captured_with: Any = None

    def before(self) -> None:
        """Call before each call of the cache."""
        if self.captured_with is not None and getattr(self.model, "max_pairs", None) != self.captured_with:
            self.cache.clear()

    def after(self) -> None:
        """Call after each call of the cache that returned. Read after, not before: a first forward
        (in the warm-up before a capture) may pick the capacity."""
        self.captured_with = getattr(self.model, "max_pairs", None)


def _grow(model, needed: int, count: int, who: str, graphed: bool) -> None:
    again = " (CUDA graphs are captured again)" if graphed else ""
    graphs.progress(f"{who}: {count} neighbor pairs exceed the model's capacity of {model.max_pairs}; "
                    f"growing it to {needed} and recomputing{again}")
    model.max_pairs = needed


class Calculator(_AseCalculator):
    """ASE calculator for ``energy = model(atomic_numbers, positions, cell, pbc)``.

    Properties: ``energy`` and ``free_energy`` (eV, the same number), ``forces`` (eV/Å) and, when
    any axis of ``atoms.pbc`` is periodic, ``stress`` (eV/Å^3, Voigt order xx, yy, zz, yz, xz,
    xy, ASE's sign). All are computed together and cached by ASE until the atoms change.

    On a CUDA device with ``cuda_graph=True`` each evaluation (forward and backward) replays a
    CUDA graph, captured per atom count and periodicity (at most ``max_graphs`` held, least
    recently used released first); positions go in and results come out through pinned host
    buffers reused between calls. A model with a neighbor capacity (``max_pairs``/``num_pairs``,
    see :mod:`mirage.ff.capacity`) that overflows is grown, its graphs dropped and recaptured, and
    the evaluation redone, with a progress line on stderr. Elsewhere (CPU, ``cuda_graph=False``)
    the model runs eagerly with the same results.

    Args:
        model: the model (an ``nn.Module`` or callable); its floating-point parameters' dtype is
            the dtype positions are given in. Its mode is left alone: call ``model.eval()`` for
            inference, where :func:`mirage.ff.optimize`'s SchNet runs small systems as one op
            (``mirage::schnet_energy``; training mode keeps the layer-by-layer path).
        device: where to run; default the model's device. The model is moved there.
        precision: ``"fp32"`` (default), ``"tf32"`` or ``"bf16-mixed"`` (see :data:`PRECISIONS`
            and docs/ff.md for the force error of each).
        cuda_graph: capture CUDA graphs on a CUDA device. The reference models of
            examples/forcefield cannot be captured (``nonzero`` and other host synchronisation):
            pass them through :func:`mirage.ff.optimize`, or use ``cuda_graph=False``.
        max_graphs: graphs held at most.
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress"]
    who = "mirage.ff.Calculator"

    def __init__(self, model, *, device=None, precision: str = "fp32", cuda_graph: bool = True,
                 max_graphs: int = 8) -> None:
        super().__init__()
        who = self.who
        check_model(model, who)
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"{who}: cuda_graph must be a bool, got {cuda_graph!r}")
        max_graphs = count(max_graphs, f"{who}: max_graphs")
        self.model = model
        self._counted = capacity.holder(model, who)  # what has the neighbor capacity, if anything
        self.device, self.dtype = model_device_dtype(model, device, who)
        self.precision = precision
        self.cuda_graph = cuda_graph and self.device.type == "cuda"
        self._graphs = graphs.GraphCache(self._packed, max_graphs, copy_outputs=False) if self.cuda_graph else None
        self._watch = CapacityWatch(self._counted, self._graphs) if self.cuda_graph else None
        # Per (atom count, periodic): pinned staging buffers and their graph (_staging), as many as graphs.
        self._buffers: "OrderedDict[Tuple[int, bool], Dict[str, Any]]" = OrderedDict()
        self._max_buffers = max_graphs
        self._checked_cell: Optional[np.ndarray] = None  # the last periodic cell found valid
        self._checked_numbers: Optional[np.ndarray] = None  # the last atomic numbers found valid
        self._snapshot = None  # what self.atoms holds after a calculation (_remember)
        self._in_get_property = False  # inside ASE's get_property, whose reset() is ASE's alone
        self._calculated: Dict[str, Tuple] = {}  # _note_calculated
        self._made_directory: Optional[str] = None  # the directory calculate last made sure of

    def reset(self) -> None:
        """ASE's reset (the results are dropped) and every captured graph and staging buffer with
        it. The graphs hold the model as it was captured (its parameters' addresses, cutoff,
        training mode) and this calculator's precision: call reset() after changing any of them.
        The model's dtype is read again (after ``model.double()``, say); a model moved to another
        kind of device needs a new calculator."""
        super().reset()
        # ASE's __init__ resets before ours has run; ASE's get_property up to 3.23 or so resets on
        # every change of the atoms (an MD step), where only the results are stale: dropping the
        # graphs there would capture them again at every step.
        if getattr(self, "model", None) is None or self._in_get_property:
            return
        # Dropped first, so that a reset that raises below leaves nothing of the former model.
        if self._graphs is not None:
            self._graphs.clear()
        self._buffers.clear()
        self._checked_numbers = None  # a replaced embedding may have other rows
        device, self.dtype = model_device_dtype(self.model, None, self.who)
        if device.type != self.device.type:
            raise ValueError(f"{self.who}: the model moved from {self.device} to {device} since this calculator "
                             "was made; make a new mirage.ff.Calculator for it")
        self.device = device
        check_precision(self.precision, self.who, self.dtype)  # "tf32" means nothing for a float64 model

    @property
    def precision(self) -> str:
        """One of :data:`PRECISIONS`. Setting it checks the value and, when it changes, drops the
        graphs (each records the precision it was captured with)."""
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        value = check_precision(value, self.who, self.dtype)
        if getattr(self, "_precision", value) != value and getattr(self, "_graphs", None) is not None:
            self._graphs.clear()
        self._precision = value

    def get_property(self, name, atoms=None, allow_calculation=True):
        """ASE's, but the stress of a structure without a periodic axis is refused before any
        calculation (ASE would compute energy and forces again on every such request first)."""
        target = atoms if atoms is not None else self.atoms
        if name == "stress" and target is not None and not target.pbc.any():
            raise PropertyNotImplementedError(f"{self.who}: no stress without a periodic axis (atoms.pbc is all False)")
        self._in_get_property = True
        try:
            return super().get_property(name, atoms, allow_calculation)
        finally:
            self._in_get_property = False

    def graph_stats(self) -> Optional[graphs.GraphCacheStats]:
        """The graph cache's counters (captures, replays, evictions), or None when graphs are off."""
        return self._graphs.stats() if self._graphs is not None else None

    # ------------------------------------------------------------------------------------ ASE
    def check_state(self, atoms, tol: float = 1e-15):
        """ASE's check (the same changes under the same tolerance) without its ``np.allclose`` per
        array, which cost more than a replayed evaluation: an MD step checks three times. Anything
        unusual (arrays present on one side only, ignored changes) goes to ASE's own check."""
        old = self.atoms
        if old is None or self.ignored_changes or old.arrays.keys() != atoms.arrays.keys():
            return super().check_state(atoms, tol)
        calculated = self._calculated if old is self._snapshot and tol >= 0 else {}  # tol < 0: nothing is close
        changes = [] if _same(old.cell.array, atoms.cell.array, tol, calculated.get("cell")) else ["cell"]
        if not _same(old.pbc, atoms.pbc, 0.0, calculated.get("pbc")):
            changes.append("pbc")
        changes += [name for name in all_changes if name in old.arrays and
                    not _same(old.arrays[name], atoms.arrays[name], tol, calculated.get(name))]
        return changes

    # Forces need autograd, which a caller's torch.inference_mode would switch off.
    @torch.inference_mode(False)
    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        if atoms is not None:
            self._remember(atoms)
        elif self.atoms is None:
            raise ValueError(f"{self.who}: no atoms to calculate: pass them (calculate(atoms)) or attach the "
                             "calculator to them (atoms.calc = calculator)")
        elif self.atoms is self._snapshot:
            self._note_calculated()  # ASE calculates self.atoms, which the caller may have edited
        if self.directory != self._made_directory:  # as ASE's calculate: mirage writes nothing there
            os.makedirs(self.directory, exist_ok=True)
            self._made_directory = self.directory
        atoms = self.atoms
        who = self.who
        n = len(atoms)
        if n == 0:
            raise ValueError(f"{who}: the Atoms object has no atoms")
        positions = np.asarray(atoms.positions)
        if not np.isfinite(positions).all():
            raise ValueError(f"{who}: atoms.positions has non-finite values (did the simulation blow up?)")
        periodic = bool(atoms.pbc.any())
        cell = atoms.cell.array
        # An MD step keeps its cell: checked once, not per evaluation.
        if periodic and (self._checked_cell is None or not (cell == self._checked_cell).all()):
            cell = np.asarray(cell, dtype=np.float64)
            volume = abs(np.linalg.det(cell))
            if not np.isfinite(cell).all() or volume < 1e-9:
                raise ValueError(f"{who}: atoms.pbc is {atoms.pbc.tolist()} but the cell {cell.tolist()} has no "
                                 "volume; set atoms.cell (a periodic system needs its lattice vectors, and a "
                                 "non-periodic axis a length too, e.g. atoms.center(vacuum=10.0, axis=2))")
            self._checked_cell = cell.copy()
        if self._checked_numbers is None or not np.array_equal(atoms.numbers, self._checked_numbers):
            for model in (self.model, self._counted):  # a fused model inside a wrapper has the table
                check_atomic_numbers(model, atoms.numbers, who)
            self._checked_numbers = atoms.numbers.copy()
        if self.cuda_graph:
            energy, forces, stress = self._run_graph(atoms, periodic)
        else:
            energy, forces, stress = self._run_eager(atoms, periodic)
        check_finite_results(energy, forces, positions, who, "for these atoms")
        self.results = {"energy": energy, "free_energy": energy, "forces": forces}
        if stress is not None:
            self.results["stress"] = stress

    def _remember(self, atoms) -> None:
        """``self.atoms = atoms.copy()``, as ASE's ``calculate`` does (check_state compares the next
        atoms with it), but into the same snapshot object from step to step where the atoms keep
        their arrays: ``Atoms.copy`` took about 60 us per MD step on the GPU machine's host
        (2026-11-24), more than the rest of this calculator's host work. ASE drops ``self.atoms``
        on every change, so the snapshot is kept aside. ``calc.atoms`` is therefore this
        calculator's own copy, overwritten by its next calculation."""
        old = self._snapshot
        same = (old is not None and len(old) == len(atoms) and old.arrays.keys() == atoms.arrays.keys()
                and all(old.arrays[name].dtype == array.dtype and old.arrays[name].shape == array.shape
                        for name, array in atoms.arrays.items()))
        if same:
            for name, array in atoms.arrays.items():
                np.copyto(old.arrays[name], array)
            np.copyto(old.cell.array, atoms.cell.array)
            np.copyto(old.pbc, atoms.pbc)
            old.set_celldisp(atoms.get_celldisp())
            old.info = dict(atoms.info)
            old.constraints = copy.deepcopy(atoms.constraints) if atoms.constraints else []
        else:
            self._snapshot = atoms.copy()
        self.atoms = self._snapshot
        self._note_calculated()

    def _note_calculated(self) -> None:
        """The fingerprints of what this calculation saw, for check_state's ``_same``: kept here,
        not read back from the snapshot, which a caller could edit. None where a value is NaN."""
        snapshot = self._snapshot
        arrays = {"cell": snapshot.cell.array, "pbc": snapshot.pbc}
        arrays.update((name, snapshot.arrays[name]) for name in all_changes if name in snapshot.arrays)
        self._calculated = {name: _fingerprint(array) for name, array in arrays.items()
                            if array.dtype.kind not in "fc" or not np.isnan(array).any()}

    def __copy__(self) -> "Calculator":
        """A shallow copy (ASE's ``combine_mm`` makes them), but with a snapshot of its own: each
        calculator overwrites its snapshot in place, which must not be the other's ``atoms``."""
        clone = self.__class__.__new__(self.__class__)
        clone.__dict__.update(self.__dict__)
        clone.atoms = None if self.atoms is None else self.atoms.copy()
        clone._snapshot = clone.atoms if self.atoms is self._snapshot else None
        clone._calculated = dict(self._calculated) if clone._snapshot is not None else {}
        return clone

    # ------------------------------------------------------------------------------ evaluation
    def _evaluate(self, numbers: Tensor, positions: Tensor, cell: Optional[Tensor], pbc: Optional[Tensor],
                  periodic: bool) -> Dict[str, Tensor]:
        """What one graph computes. ``periodic`` is part of the graph's key (pbc's values are not)."""
        energy, forces, stress = evaluate(self.model, numbers, positions, cell, pbc, stress=periodic,
                                          precision=self.precision, who=self.who,
                                          capacity_checked=self._counted is not None)
        out = {"energy": energy, "forces": forces}
        if stress is not None:
            out["stress"] = stress
        if self._counted is not None:
            out["num_pairs"] = self._counted.num_pairs
        return out

    def _inputs(self, atoms, periodic: bool) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
        """The model's arguments on the CPU, in the model's dtype; no cell or pbc when nothing is periodic."""
        numbers = torch.as_tensor(np.asarray(atoms.numbers, dtype=np.int64))
        positions = torch.as_tensor(np.asarray(atoms.positions), dtype=self.dtype)
        cell = torch.as_tensor(np.asarray(atoms.cell[:]), dtype=self.dtype) if periodic else None
        pbc = torch.as_tensor(np.asarray(atoms.pbc, dtype=bool)) if periodic else None
        return numbers, positions, cell, pbc

    def _run_eager(self, atoms, periodic: bool):
        numbers, positions, cell, pbc = (None if t is None else t.to(self.device)
                                         for t in self._inputs(atoms, periodic))
        for _ in range(capacity.MAX_GROWS):
            with matmul_precision(self.precision):
                out = self._evaluate(numbers, positions, cell, pbc, periodic)
            count = out.get("num_pairs")
            count = None if count is None else int(count.reshape(-1)[0].item())
            needed = capacity.needed_pairs(self._counted, count) if count is not None else None
            if needed is None:
                stress = out.get("stress")
                return (float(out["energy"].item()), out["forces"].detach().cpu().double().numpy(),
                        None if stress is None else stress.detach().cpu().double().numpy())
            _grow(self._counted, needed, count, self.who, graphed=False)
        raise RuntimeError(f"{self.who}: the model's neighbor list still overflows after {capacity.MAX_GROWS} grows "
                           f"(capacity {self._counted.max_pairs}); its num_pairs does not follow max_pairs")

    def _packed(self, numbers: Tensor, positions: Tensor, cell: Optional[Tensor], pbc: Optional[Tensor],
                periodic: bool) -> Tensor:
        """What one graph computes: :meth:`_evaluate`'s results as the bytes of one flat tensor, so
        that one device-to-host copy brings all of them (layout: :meth:`_staging`). The pair count
        (int64) goes first, then the energy as float64 (the model's own dtype may be wider than its
        positions'): every later offset is then a multiple of its element size."""
        out = self._evaluate(numbers, positions, cell, pbc, periodic)
        out["energy"] = out["energy"].to(torch.float64)
        parts = [out[name] for name in ("num_pairs", "energy", "forces", "stress") if name in out]
        return torch.cat([part.reshape(-1).view(torch.uint8) for part in parts])

    def _staging(self, n: int, periodic: bool) -> Dict[str, Any]:
        """Per (atom count, periodic), reused: pinned host buffers for the inputs and for
        :meth:`_packed`'s bytes, numpy views of both, and the graph they feed once prepared."""
        key = (n, periodic)
        stage = self._buffers.get(key)
        if stage is not None:
            self._buffers.move_to_end(key)
            return stage
        while len(self._buffers) >= self._max_buffers:
            self._buffers.popitem(last=False)
        pin = self.device.type == "cuda"
        inputs = dict(numbers=torch.zeros(n, dtype=torch.int64), positions=torch.zeros(n, 3, dtype=self.dtype))
        if periodic:
            inputs.update(cell=torch.zeros(3, 3, dtype=self.dtype), pbc=torch.zeros(3, dtype=torch.bool))
        inputs = {name: t.pin_memory() if pin else t for name, t in inputs.items()}
        size = torch.empty((), dtype=self.dtype).element_size()
        counted = self._counted is not None
        lengths = dict(num_pairs=8 if counted else 0, energy=8, forces=3 * n * size, stress=6 * size if periodic else 0)
        packed = torch.empty(sum(lengths.values()), dtype=torch.uint8)
        packed = packed.pin_memory() if pin else packed
        views, offset, raw = {}, 0, packed.numpy()
        np_dtype = inputs["positions"].numpy().dtype
        for name, length in lengths.items():
            if length:
                views[name] = raw[offset:offset + length].view(
                    {"num_pairs": np.int64, "energy": np.float64}.get(name, np_dtype))
                offset += length
        views["forces"] = views["forces"].reshape(n, 3)
        stage = dict(inputs=inputs, host={name: t.numpy() for name, t in inputs.items()}, packed=packed,
                     results=views, key=None, entry=None, static={}, stale=set(), seen={})
        self._buffers[key] = stage
        return stage

    def _load(self, stage: Dict[str, Any], atoms, periodic: bool) -> None:
        """The atoms' inputs into the pinned buffers; numbers, cell and pbc only when they changed
        (then marked stale: the graph's static inputs need them again)."""
        host = stage["host"]
        np.copyto(host["positions"], atoms.positions)
        others = (("numbers", atoms.numbers), ("cell", atoms.cell.array), ("pbc", atoms.pbc)) if periodic else \
            (("numbers", atoms.numbers),)
        seen = stage["seen"]  # the values as given, compared before the cast to the model's dtype
        for name, value in others:
            if name not in seen or not (seen[name] == value).all():  # same shapes: same atom count
                seen[name] = np.array(value)
                np.copyto(host[name], value)
                stage["stale"].add(name)

    def _prepare(self, stage: Dict[str, Any], periodic: bool) -> None:
        """The graph for this stage's inputs (captured if new); all its static inputs are stale."""
        inputs = stage["inputs"]
        names = ("numbers", "positions", "cell", "pbc")
        args = [inputs[name].to(self.device) if name in inputs else None for name in names]
        with matmul_precision(self.precision):
            stage["key"], stage["entry"] = self._graphs.prepare(*args, periodic)
        stage["static"] = dict(zip([name for name in names if name in inputs], stage["entry"].static_inputs))
        stage["stale"] = set(stage["static"])

    def _run_graph(self, atoms, periodic: bool):
        # The hot path of an MD step: no signature or pytree work (the stage holds its graph), inputs
        # straight from pinned memory into the graph's static inputs, one copy back, one sync.
        stage = self._staging(len(atoms), periodic)
        self._load(stage, atoms, periodic)
        inputs, static, results = stage["inputs"], stage["static"], stage["results"]
        for _ in range(capacity.MAX_GROWS):
            with on_device(self.device):
                try:
                    self._watch.before()
                    if stage["entry"] is None or not self._graphs.holds(stage["key"], stage["entry"]):
                        self._prepare(stage, periodic)
                        static = stage["static"]
                    static["positions"].copy_(inputs["positions"], non_blocking=True)
                    for name in stage["stale"]:
                        static[name].copy_(inputs[name], non_blocking=True)
                    stage["stale"].clear()
                    out = self._graphs.replay(stage["key"], stage["entry"])
                    self._watch.after()
                except graphs.CaptureError as error:
                    raise uncapturable(self.who, error, "Calculator(model, cuda_graph=False)") from error
                stage["packed"].copy_(out, non_blocking=True)
                synchronize(self.device)
            count = int(results["num_pairs"][0]) if "num_pairs" in results else None
            needed = capacity.needed_pairs(self._counted, count) if count is not None else None
            if needed is None:
                # Copies: the pinned buffer is overwritten by the next evaluation.
                return (float(results["energy"][0]), results["forces"].astype(np.float64),
                        results["stress"].astype(np.float64) if periodic else None)
            _grow(self._counted, needed, count, self.who, graphed=True)
            self._graphs.clear()
        raise RuntimeError(f"{self.who}: the model's neighbor list still overflows after {capacity.MAX_GROWS} grows "
                           f"(capacity {self._counted.max_pairs}); its num_pairs does not follow max_pairs")
