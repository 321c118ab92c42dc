"""GPU-resident molecular dynamics: velocity Verlet (NVE) and Langevin (NVT), K steps per CUDA graph.

The state (positions, velocities, forces, masses) lives in device tensors, in float64. One replay
of a CUDA graph advances it by ``steps_per_replay`` steps, force evaluations (forward and backward
of the model) included, with no host round trip inside; the host only looks at the state to write a
trajectory frame or a log line, and, for a model with a neighbor capacity, to read the largest
pair count of the replay, which it does after it has queued the next replay, so that the GPU does
not wait for it. Units are ASE's: eV, Å, amu, ASE time (``0.5 * ase.units.fs``).

Example::

    from ase.md.velocitydistribution import thermalize_momenta  # ASE >= 3.29 (before: MaxwellBoltzmannDistribution)
    thermalize_momenta(atoms, temperature_K=300)
    md = mirage.ff.md.VelocityVerlet(fast_model, atoms, 0.5 * ase.units.fs, steps_per_replay=50)
    md.run(100_000, trajectory="benzene.traj", write_every=1000, log="benzene.log")
    final = md.atoms
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import time
from dataclasses import dataclass
from typing import Any, ContextManager, Dict, List, Optional, TextIO, Tuple

import numpy as np
import torch
from torch import Tensor

import ase
import ase.io
from ase import units
from ase.calculators.singlepoint import SinglePointCalculator

from .. import graphs, ops
from .._arguments import count
from . import capacity
from .calculator import (CapacityWatch, check_atomic_numbers, check_finite_results, check_model, energy_and_gradients,
                         model_device_dtype, on_device, synchronize, uncapturable)
from .fused import SchNet
from .precision import check_precision, matmul_precision

__all__ = ["Langevin", "VelocityVerlet"]

_WHO = "mirage.ff.md.VelocityVerlet"
_NO_PAIRS = 2**62  # the running minimum of the pair count starts above any real count
# The integrator's state (positions, velocities, forces, energy) is float64 whatever the model's
# dtype; the model sees the positions rounded to its own. In float32, rounding x + v dt every step
# (~1e-7 Å, against a step of ~1e-3 of |x| at 0.25 fs) is a random walk in the energy, estimated
# at ~0.1% of <E_kin> over 100 ps of benzene (docs/perf/forcefield.md, "Where the drift comes
# from"). ASE's integrators hold float64 arrays, OpenMM's "mixed" precision a float64 state.
STATE_DTYPE = torch.float64
# What a replay changes, saved before it: an overflow takes the state back there.
_DYNAMIC = ("positions", "velocities", "forces", "energy")


def _positive(value: Any, name: str, who: str, zero: bool = False) -> float:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0
            or value == 0 and not zero):
        raise ValueError(f"{who}: {name} must be a finite number {'>=' if zero else '>'} 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Langevin:
    """Langevin thermostat (NVT) for :class:`VelocityVerlet`, integrated with the BAOAB splitting.

    Args:
        temperature_K: the bath temperature in kelvin.
        friction: the friction coefficient in inverse ASE time units, as ASE's ``Langevin``
            (e.g. ``0.01 / ase.units.fs``: velocities decorrelate over 100 fs).
        fix_com: keep the total momentum at its initial value, as ASE's ``Langevin(fixcm=True)``
            (its default) keeps the centre of mass unperturbed. Without it the random kicks make
            the centre of mass diffuse: the whole molecule drifts away, a periodic system flows
            through its cell. The thermostat's velocity change (friction and noise) loses its
            mass-weighted mean, so it acts on the motion relative to the centre of mass only,
            whose 3N - 3 degrees of freedom it samples at ``temperature_K`` exactly; the records'
            temperature counts those (as ``atoms.get_temperature()`` with ASE's ``FixCom``). ASE's
            ``fixcm`` differs in detail: it rescales the noise by ``sqrt(N / (N - 1))`` so that
            3N degrees of freedom read ``temperature_K`` (ASE deprecates it as not sampling NVT
            exactly), and its friction still damps an initial total momentum.
    """

    temperature_K: float
    friction: float
    fix_com: bool = True

    def __post_init__(self) -> None:
        # 0 K: friction alone, a quench (as ASE's Langevin allows).
        _positive(self.temperature_K, "temperature_K", "mirage.ff.md.Langevin", zero=True)
        _positive(self.friction, "friction", "mirage.ff.md.Langevin")
        if not isinstance(self.fix_com, bool):
            raise ValueError(f"mirage.ff.md.Langevin: fix_com must be a bool, got {self.fix_com!r}")


class _CountReadback:
    """A replay's pair-count range copied to the host behind it in the stream (pinned memory and
    an event on a GPU), read when the host gets to it."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._host = torch.empty(2, dtype=torch.int64, pin_memory=cuda)
        self._event = torch.cuda.Event() if cuda else None

    def start(self, counts: Tensor) -> None:
        if self._event is None:
            self._host.copy_(counts)
            return
        with torch.cuda.device(counts.device):  # the copy and the event on the counts' stream
            self._host.copy_(counts, non_blocking=True)
            self._event.record()

    def read(self) -> Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host


def _check_thermostat(thermostat: Any, atoms: int) -> None:
    if thermostat is not None and not isinstance(thermostat, Langevin):
        raise ValueError(f"{_WHO}: thermostat must be None or a mirage.ff.md.Langevin, got {thermostat!r}")
    # The centre-of-mass motion is outside the thermostat's reach with fix_com: one atom has no other.
    if thermostat is not None and thermostat.fix_com and atoms == 1:
        raise ValueError(f"{_WHO}: Langevin(fix_com=True) leaves a single atom nothing to thermostat "
                         "(its only motion is the centre of mass's); use Langevin(..., fix_com=False)")


class VelocityVerlet:
    """Velocity-Verlet molecular dynamics on the model's device, many steps per CUDA-graph replay.

    NVE without a thermostat; with ``thermostat=Langevin(T, friction)`` NVT by the BAOAB scheme
    (half kick, half drift, Ornstein-Uhlenbeck velocity update with ``torch.randn`` from the
    device's default generator, half drift, half kick; Leimkuhler and Matthews 2013), which keeps
    configurational averages accurate to O(dt^2). By default (``Langevin.fix_com``) the thermostat
    leaves the total momentum unchanged.

    Args:
        model: ``energy = model(atomic_numbers, positions, cell, pbc)``.
        atoms: the initial ``ase.Atoms``: numbers, positions, masses, momenta (zero unless set,
            e.g. by ``ase.md.velocitydistribution.thermalize_momenta``; ASE before 3.29:
            ``MaxwellBoltzmannDistribution``), cell and pbc.
            It is not modified; :attr:`atoms` gives the current state. Constraints are not supported.
        timestep: in ASE time units (``0.5 * ase.units.fs``).
        thermostat: None (NVE) or a :class:`Langevin`.
        steps_per_replay: ``K``, the steps one graph replay advances (and the steps between two
            checks of the neighbor capacity on the CPU path).
        precision: ``"fp32"``, ``"tf32"`` or ``"bf16-mixed"``, as :class:`mirage.ff.Calculator`.
        device: where to run; default the model's device (the model is moved there).
        cuda_graph: replay CUDA graphs on a CUDA device; otherwise (and on the CPU) the same steps
            run eagerly. The reference models cannot be captured: use :func:`mirage.ff.optimize`.
        progress_every: seconds between progress lines on stderr during :meth:`run`; None: silent.

    Attributes:
        step: steps done so far. records: one dict per written step (``step``, ``time_fs``,
        ``potential``, ``kinetic``, ``total`` in eV, ``temperature`` in K: ``2 E_kin / (3 N k_B)``,
        or with ``Langevin.fix_com`` the kinetic energy relative to the centre of mass over
        ``(3 N - 3) k_B``). steps_per_second:
        the rate of the last :meth:`run` (host writes included).
    """

    # Forces need autograd, which a caller's torch.inference_mode would switch off (and tensors
    # made under it could not take part in the graphs' autograd).
    @torch.inference_mode(False)
    def __init__(self, model, atoms: "ase.Atoms", timestep: float, *, thermostat: Optional[Langevin] = None,
                 steps_per_replay: int = 10, precision: str = "fp32", device=None, cuda_graph: bool = True,
                 progress_every: Optional[float] = 10.0) -> None:
        check_model(model, _WHO)
        if not isinstance(atoms, ase.Atoms):
            raise ValueError(f"{_WHO}: atoms must be an ase.Atoms, got a {type(atoms).__name__}")
        if len(atoms) == 0:
            raise ValueError(f"{_WHO}: atoms has no atoms")
        if atoms.constraints:
            raise ValueError(f"{_WHO}: atoms has constraints ({atoms.constraints}), which this integrator "
                             "does not apply; remove them (del atoms.constraints) or use ASE's integrators")
        self._timestep = _positive(timestep, "timestep", _WHO)
        _check_thermostat(thermostat, len(atoms))
        steps_per_replay = count(steps_per_replay, f"{_WHO}: steps_per_replay")
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"{_WHO}: cuda_graph must be a bool, got {cuda_graph!r}")
        if progress_every is not None:
            _positive(progress_every, "progress_every", _WHO)
        self._fix_com = thermostat is not None and thermostat.fix_com
        self.model = model
        self._thermostat = thermostat
        self.steps_per_replay = steps_per_replay
        self.progress_every = progress_every
        self.device, self.dtype = model_device_dtype(model, device, _WHO)
        if self.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{_WHO}: the model's parameters are {self.dtype}; it runs float32 or float64 models "
                             "(positions need float32's precision at least): convert it with model.float() and "
                             "pass precision='bf16-mixed' for bfloat16 products")
        self._precision = check_precision(precision, _WHO, self.dtype)
        self.cuda_graph = cuda_graph and self.device.type == "cuda"
        self.step = 0
        self._clock = (0, 0.0)  # (step, time) when the timestep was last set: the time of a step (_time)
        self.records: List[Dict[str, float]] = []
        self.steps_per_second: Optional[float] = None
        self._template = atoms.copy()
        self._template.calc = None
        self._masses = atoms.get_masses().astype(np.float64)
        if not (np.isfinite(self._masses).all() and (self._masses > 0).all()):
            raise ValueError(f"{_WHO}: every mass must be finite and > 0 (atoms.get_masses()), got "
                             f"{self._masses.min()} to {self._masses.max()}")
        if not np.isfinite(atoms.get_momenta()).all():
            raise ValueError(f"{_WHO}: atoms' momenta have non-finite values")
        self._periodic = bool(np.any(atoms.pbc))
        determinant = np.linalg.det(atoms.cell[:]) if self._periodic else 1.0
        if not np.isfinite(determinant) or abs(determinant) < 1e-9:
            raise ValueError(f"{_WHO}: atoms.pbc is {atoms.pbc.tolist()} but the cell has no finite volume; set "
                             "atoms.cell (a non-periodic axis needs a length too, e.g. atoms.center(vacuum=10.0, axis=2))")
        if not np.isfinite(atoms.positions).all():
            raise ValueError(f"{_WHO}: atoms.positions has non-finite values")
        self._counted = capacity.holder(model, _WHO)  # what has the neighbor capacity, if anything
        for checked in (model, self._counted):  # a fused model inside a wrapper has the table
            check_atomic_numbers(checked, atoms.numbers, _WHO)
        self._counting = self._counted is not None
        counted = self._counted
        if self._counting and (counted.num_pairs.dtype != torch.int64 or counted.num_pairs.device != self.device):
            raise ValueError(f"{_WHO}: the model's num_pairs must be an int64 tensor on {self.device} (the "
                             f"neighbor-capacity protocol, mirage.ff.capacity), got {counted.num_pairs.dtype} on "
                             f"{counted.num_pairs.device}")
        self._state = self._initial_state(atoms)
        # Two replays in flight at most (_advance_to): each has a copy of the state it started
        # from and, for a model with a capacity, its pair-count range read back to the host.
        self._starts = [{name: torch.empty_like(self._state[name]) for name in _DYNAMIC} for _ in range(2)]
        self._counts = [_CountReadback(self.device) for _ in range(2)] if self._counting else None
        self._launches = 0
        # Three graph sizes at most in practice: K, and the shorter chunks before a write or the end.
        self._graphs = graphs.GraphCache(self._advance, 4, copy_outputs=False) if self.cuda_graph else None
        self._prepared: Dict[int, Any] = {}  # steps -> the cache's (key, graph) for them (_replay_graph)
        self._model_seen: Any = None  # what the graphs read of the model (_drop_graphs_if_the_model_changed)
        self._watch = CapacityWatch(self._counted, self._graphs) if self.cuda_graph else None
        self._compute_initial_forces()
        positions, _, forces, potential = self._host_state()
        check_finite_results(potential, forces, positions, _WHO, "at the initial positions")

    # --------------------------------------------------------------------------------- state
    def _tensor(self, array, dtype=STATE_DTYPE) -> Tensor:
        # A copy (torch.tensor, not as_tensor): the state is updated in place and must not alias the Atoms.
        return torch.tensor(np.asarray(array), dtype=dtype, device=self.device)

    def _initial_state(self, atoms) -> Dict[str, Tensor]:
        masses = self._tensor(self._masses)[:, None]
        state = {
            "numbers": self._tensor(atoms.numbers, torch.int64),
            "positions": self._tensor(atoms.positions),
            "velocities": self._tensor(atoms.get_velocities()),
            "forces": torch.zeros(len(atoms), 3, dtype=STATE_DTYPE, device=self.device),
            "energy": torch.zeros((), dtype=STATE_DTYPE, device=self.device),
            "inverse_masses": 1.0 / masses,
        }
        self._thermostat_state(state)
        if self._periodic:
            state["cell"] = self._tensor(atoms.cell[:], self.dtype)
            state["pbc"] = self._tensor(np.asarray(atoms.pbc, dtype=bool), torch.bool)
        if self._counting:
            state["pair_counts"] = torch.zeros(2, dtype=torch.int64, device=self.device)  # [max, min] of a replay
        return state

    def _thermostat_state(self, state: Dict[str, Tensor]) -> None:
        """The thermostat's entries of ``state``, set for the thermostat and timestep (removed
        without a thermostat). BAOAB's O step: v <- c1 v + sqrt((1 - c1^2) kT / m) R, over a full
        timestep."""
        state.pop("noise_scales", None)
        state.pop("mass_fractions", None)
        if self._thermostat is None:
            return
        masses = self._tensor(self._masses)[:, None]
        c1 = math.exp(-self._thermostat.friction * self._timestep)
        kT = units.kB * self._thermostat.temperature_K
        state["noise_scales"] = torch.sqrt((1.0 - c1 * c1) * kT / masses)
        if self._fix_com:
            state["mass_fractions"] = masses / masses.sum()

    # The thermostat, the timestep and the precision are in the captured graphs (noise scales and
    # friction, the steps' lengths, autocast and TF32): setting one drops the graphs, which the
    # next run() captures again, so that a temperature ramp or a new timestep takes effect.
    @property
    def thermostat(self) -> Optional["Langevin"]:
        """None (NVE) or the :class:`Langevin` thermostat; may be set between runs (an annealing
        schedule, say): the next :meth:`run` captures its graphs again."""
        return self._thermostat

    @thermostat.setter
    def thermostat(self, thermostat: Optional["Langevin"]) -> None:
        _check_thermostat(thermostat, len(self._masses))
        self._thermostat = thermostat
        self._fix_com = thermostat is not None and thermostat.fix_com
        self._thermostat_state(self._state)
        self._drop_graphs()

    @property
    def timestep(self) -> float:
        """In ASE time units; may be set between runs, as :attr:`thermostat`."""
        return self._timestep

    @timestep.setter
    def timestep(self, timestep: float) -> None:
        timestep = _positive(timestep, "timestep", _WHO)
        self._clock = (self.step, self._time())
        self._timestep = timestep
        self._thermostat_state(self._state)
        self._drop_graphs()

    @property
    def precision(self) -> str:
        """``"fp32"``, ``"tf32"`` or ``"bf16-mixed"``; may be set between runs, as :attr:`thermostat`."""
        return self._precision

    @precision.setter
    def precision(self, precision: str) -> None:
        self._precision = check_precision(precision, _WHO, self.dtype)
        self._drop_graphs()

    def _time(self) -> float:
        """The simulated time at the current step, in ASE units (the timestep may have changed)."""
        step, time = self._clock
        return time + (self.step - step) * self._timestep

    def _drop_graphs(self) -> None:
        if self._graphs is not None:
            self._graphs.clear()
        self._prepared.clear()

    def _drop_graphs_if_the_model_changed(self) -> None:
        """Drops the graphs if what they read of the model moved since the last run: its tensors
        (a .to() or load_state_dict(assign=True)), its mode (train() and back: another path), or
        SchNet's prepared tables, made again into new memory after .to() or train(). Replays
        would read freed memory or take the old path."""
        if not isinstance(self.model, torch.nn.Module):  # a function: nothing of it to see
            return
        prepared = getattr(self.model, "_prepared_weights", None)
        now = (self.model.training, prepared.data_ptr() if prepared is not None else None,
               tuple((t.data_ptr(), t.dtype, t.device) for t in (*self.model.parameters(), *self.model.buffers())))
        if now != self._model_seen:
            self._drop_graphs()
            self._model_seen = now

    def _evaluate(self, state: Dict[str, Tensor], model_positions: Tensor) -> Tuple[Tensor, Tensor]:
        """The model's (energy, gradient) at ``model_positions``, for a verlet op to take in."""
        energy, (grad,) = energy_and_gradients(self.model, state["numbers"], model_positions, state.get("cell"),
                                               state.get("pbc"), precision=self.precision, who=_WHO,
                                               capacity_checked=self._counting)
        return energy, grad

    def _pair_counting(self, state: Dict[str, Tensor]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """The verlet ops' pair_count and pair_count_range: the model's count folded into the range."""
        return (self._counted.num_pairs, state["pair_counts"]) if self._counting else (None, None)

    def _take_in(self, state: Dict[str, Tensor], evaluated: Tuple[Tensor, Tensor], kick: float) -> None:
        """A force evaluation's (energy, gradient) into ``state`` (in place), then a kick of the
        velocities by ``kick`` (a time); folds the pair count into its range."""
        energy, grad = evaluated
        ops.verlet_forces_kick(state["velocities"], state["forces"], state["energy"], grad, energy,
                               state["inverse_masses"], kick, *self._pair_counting(state))

    def _advance(self, state: Dict[str, Tensor], steps: int) -> Dict[str, Tensor]:
        """``steps`` steps in place on ``state`` (what one graph records); returns ``state``.

        Each step is a half kick and a drift, the forces, then the forces taken in and a half kick;
        between two steps the one's end and the next's start are one kernel
        (``verlet_forces_kick_drift``), so a step is one kernel of ours besides the model's. With
        the thermostat, BAOAB: the drift is split in two around the O step (one more kernel of
        ours, and the O step's own)."""
        if self._counting:
            state["pair_counts"][0].fill_(0)
            state["pair_counts"][1].fill_(_NO_PAIRS)
        x, v, f, inverse_masses = state["positions"], state["velocities"], state["forces"], state["inverse_masses"]
        dt = self.timestep
        drift = dt if self.thermostat is None else 0.5 * dt  # up to the O step, with the thermostat
        evaluated = None  # the last step's (energy, gradient), taken in at the start of the next
        for _ in range(steps):
            if evaluated is None:
                model_positions = ops.verlet_kick_drift(x, v, f, inverse_masses, 0.5 * dt, drift, self.dtype)
            else:
                energy, grad = evaluated
                model_positions = ops.verlet_forces_kick_drift(x, v, f, state["energy"], grad, energy, inverse_masses,
                                                               0.5 * dt, drift, self.dtype,
                                                               *self._pair_counting(state))
            if self.thermostat is not None:
                c1 = math.exp(-self.thermostat.friction * dt)
                if self._fix_com:
                    # The O step's change of v (noise, friction) minus its mass-weighted mean:
                    # sum_i m_i dv_i = 0, so the total momentum is untouched (pure tensor ops: capturable).
                    kick = torch.randn_like(v).mul_(state["noise_scales"]).add_(v, alpha=c1 - 1.0)
                    v.add_(kick.sub_((state["mass_fractions"] * kick).sum(0)))
                else:
                    v.mul_(c1).addcmul_(torch.randn_like(v), state["noise_scales"])
                model_positions = ops.verlet_kick_drift(x, v, f, inverse_masses, 0.0, 0.5 * dt, self.dtype)
            evaluated = self._evaluate(state, model_positions)
        if evaluated is not None:
            self._take_in(state, evaluated, 0.5 * dt)
        return state

    def _grow_if_needed(self, counts: Tensor) -> bool:
        """Grows the model's capacity if a replay's pair counts (its [largest, smallest], on the
        host) overflowed it; returns whether it did."""
        peak, low = counts.tolist()
        needed = capacity.needed_pairs(self._counted, -1 if low < 0 else peak)
        if needed is None:
            return False
        graphs.progress(f"{_WHO}: {peak} neighbor pairs exceed the model's capacity of {self._counted.max_pairs} "
                        f"after step {self.step}; growing it to {needed} and computing again from step {self.step}"
                        + (" (CUDA graphs are captured again)" if self._graphs is not None else ""))
        self._counted.max_pairs = needed
        if self._graphs is not None:
            self._graphs.clear()
        return True

    def _compute_initial_forces(self) -> None:
        for _ in range(capacity.MAX_GROWS):
            if self._counting:
                self._state["pair_counts"][0].fill_(0)
                self._state["pair_counts"][1].fill_(_NO_PAIRS)
            with torch.no_grad(), matmul_precision(self.precision):
                self._take_in(self._state, self._evaluate(self._state, self._state["positions"].to(self.dtype)), 0.0)
            if not self._counting or not self._grow_if_needed(self._state["pair_counts"]):
                return
        raise RuntimeError(f"{_WHO}: the model's neighbor list still overflows after {capacity.MAX_GROWS} grows")

    def _advance_to(self, target: int) -> None:
        """Replays until step ``target``, ``steps_per_replay`` steps a replay.

        Each replay is queued before the pair count of the one ahead of it is read (which waits for
        that one to finish): the GPU then goes from one replay to the next without waiting for the
        host. SchNet on benzene: 12,900-13,400 -> 14,500 steps/s at K = 10, 14,200 -> 14,850 at
        K = 50 (H200, 2026-11-29; docs/perf/forcefield.md, "MD replays queued ahead").
        An overflow takes the state back to the start of the replay that overflowed (the one queued
        behind it is dropped), grows the capacity and goes on from there."""
        queued: List[Tuple[int, int]] = []  # (steps, slot) of the replays launched and not yet accepted
        planned, grows = self.step, 0
        try:
            while self.step < target:
                while planned < target and len(queued) < 2:
                    steps = min(self.steps_per_replay, target - planned)
                    slot = self._launches % 2
                    self._launches += 1
                    queued.append((steps, slot))
                    self._launch(steps, slot)
                    planned += steps
                steps, slot = queued[0]
                if not self._counting or not self._grow_if_needed(self._counts[slot].read()):
                    queued.pop(0)
                    self.step += steps
                    grows = 0
                    continue
                grows += 1
                if grows == capacity.MAX_GROWS:
                    raise RuntimeError(f"{_WHO}: the model's neighbor list still overflows after "
                                       f"{capacity.MAX_GROWS} grows")
                self._rewind(slot)
                queued.clear()
                planned = self.step
        except BaseException:
            # An error (or an interrupt) leaves the state where self.step says: the replays not
            # accepted are undone.
            if queued:
                self._rewind(queued[0][1])
            raise

    def _rewind(self, slot: int) -> None:
        """The state back to where the replay of ``slot`` started (stream-ordered after it)."""
        for name, saved in self._starts[slot].items():
            self._state[name].copy_(saved)

    def _launch(self, steps: int, slot: int) -> None:
        """Queues one replay of ``steps`` steps (eager steps without graphs), after a copy of the
        state it starts from, and then the read-back of its pair counts."""
        for name, saved in self._starts[slot].items():
            saved.copy_(self._state[name])
        with matmul_precision(self.precision):
            if self._graphs is None:
                with torch.no_grad():
                    self._advance(self._state, steps)
            else:
                with on_device(self.device):
                    self._state = self._captured(steps)
        if self._counting:
            self._counts[slot].start(self._state["pair_counts"])

    def _captured(self, steps: int) -> Dict[str, Tensor]:
        try:
            self._watch.before()
            state = self._replay_graph(steps)
            self._watch.after()
            return state
        except graphs.CaptureError as error:
            raise uncapturable(_WHO, error, "cuda_graph=False") from error

    def _replay_graph(self, steps: int) -> Dict[str, Tensor]:
        """One replay of the graph for ``steps`` steps (captured on first use), returning the state.

        Not through the cache's call, which works out the state's signature (shapes, strides,
        dtypes of a dozen tensors) twice a replay, host time during which the GPU, done with the
        last replay, waits for the next: SchNet on benzene ran 12,900-13,000 steps/s at K = 50 and
        8,800-9,800 at K = 10 that way, 14,400 and 13,500-13,800 this way (H200, 2026-11-29). Each
        graph's key is found once; the state lives in the graph's own buffers, copied into another
        graph's only when that one replays next (a shorter replay before a frame, say)."""
        prepared = self._prepared.get(steps)
        if prepared is None or not self._graphs.holds(*prepared):  # new, or dropped (grown capacity, evicted)
            prepared = self._prepared[steps] = self._graphs.prepare(self._state, steps)
        key, graph = prepared
        (buffers, _), _ = graph.static_arguments
        if buffers["positions"] is not self._state["positions"]:
            for name, tensor in buffers.items():
                tensor.copy_(self._state[name])
        return self._graphs.replay(key, graph)

    # ---------------------------------------------------------------------------------- output
    def _host_state(self):
        s = self._state
        return (s["positions"].detach().cpu().numpy(), s["velocities"].detach().cpu().numpy(),
                s["forces"].detach().cpu().numpy(), float(s["energy"]))

    @property
    def atoms(self) -> "ase.Atoms":
        """The current state as a new ``ase.Atoms`` (positions unwrapped, momenta, and a
        single-point calculator holding the potential energy and forces)."""
        positions, velocities, forces, energy = self._host_state()
        return self._make_atoms(positions, velocities, forces, energy)

    def _make_atoms(self, positions, velocities, forces, energy) -> "ase.Atoms":
        atoms = self._template.copy()
        # The frame's place in the run (ASE's trajectories keep info): frames need not be evenly spaced.
        atoms.info.update(step=self.step, time_fs=self._time() / units.fs)
        atoms.positions = positions
        atoms.set_momenta(velocities * self._masses[:, None])
        atoms.calc = SinglePointCalculator(atoms, energy=energy, free_energy=energy, forces=forces)
        return atoms

    def _record(self, trajectory, log: Optional[TextIO], keep: bool = True) -> Dict[str, float]:
        """The current state's record, written to the trajectory and log where given and appended
        to :attr:`records` when ``keep`` (not when it is there already)."""
        positions, velocities, forces, potential = self._host_state()
        if not (np.isfinite(positions).all() and np.isfinite(velocities).all() and math.isfinite(potential)):
            raise RuntimeError(f"{_WHO}: the state is not finite at step {self.step} (the simulation blew up); "
                               "use a smaller timestep or check the model")
        kinetic = 0.5 * float((self._masses[:, None] * velocities**2).sum())
        thermal, degrees = kinetic, 3 * len(self._masses)
        if self._fix_com:
            # The centre of mass keeps its momentum, never thermalized: not part of the temperature.
            momentum = (self._masses[:, None] * velocities).sum(0)
            thermal -= 0.5 * float(momentum @ momentum) / self._masses.sum()
            degrees -= 3
        record = dict(step=self.step, time_fs=self._time() / units.fs, potential=potential,
                      kinetic=kinetic, total=potential + kinetic,
                      temperature=float(2.0 * thermal / (degrees * units.kB)))
        if keep:
            self.records.append(record)
        if trajectory is not None:
            trajectory.write(self._make_atoms(positions, velocities, forces, potential))
        if log is not None:
            log.write(f"{record['step']:>10d} {record['time_fs'] / 1000:12.4f} {record['total']:14.6f} "
                      f"{record['potential']:14.6f} {record['kinetic']:12.6f} {record['temperature']:10.2f}\n")
            log.flush()
        return record

    @torch.inference_mode(False)
    def run(self, steps: int, trajectory=None, write_every: int = 100, log=None) -> List[Dict[str, float]]:
        """Advances ``steps`` steps, writing and logging every ``write_every`` steps.

        Steps go ``steps_per_replay`` at a time; a replay never crosses a step that is a multiple
        of ``write_every`` (a shorter replay, with its own graph, ends there), so frames land
        exactly on those steps whatever ``K``. The current step is written first unless it
        already was; a trajectory or log given as a path (a new file) starts with it either way,
        without a second record of it. Progress lines come every ``progress_every`` seconds,
        between replays, whatever ``write_every``.

        Args:
            steps: steps to run (>= 0).
            trajectory: None, a path (an ``ase.io.Trajectory`` written there, replacing the file),
                or an object with ``write(atoms)`` such as an open ``ase.io.Trajectory``.
            write_every: steps between frames and records.
            log: None, a path (written, replacing the file) or a text stream: one line per record
                (step, time in ps, total, potential and kinetic energy in eV, temperature in K).

        Returns:
            The records written by this call (also appended to :attr:`records`).
        """
        who = f"{_WHO}.run"
        steps, write_every = count(steps, f"{who}: steps", 0), count(write_every, f"{who}: write_every")
        own_trajectory = isinstance(trajectory, (str, os.PathLike))
        own_log = isinstance(log, (str, os.PathLike))
        if trajectory is not None and not own_trajectory and not hasattr(trajectory, "write"):
            raise ValueError(f"{_WHO}.run: trajectory must be None, a path or have a write(atoms) method, "
                             f"got a {type(trajectory).__name__}")
        if log is not None and not own_log and not hasattr(log, "write"):
            raise ValueError(f"{_WHO}.run: log must be None, a path or a text stream, got a {type(log).__name__}")
        first = len(self.records)
        trajectory = ase.io.Trajectory(os.fspath(trajectory), "w") if own_trajectory else trajectory
        log = open(log, "w") if own_log else log
        try:
            if log is not None:
                log.write(f"{'step':>10} {'time[ps]':>12} {'Etot[eV]':>14} {'Epot[eV]':>14} {'Ekin[eV]':>12} "
                          f"{'T[K]':>10}\n")
            recorded = bool(self.records) and self.records[-1]["step"] == self.step
            if not recorded or own_trajectory or own_log:
                self._record(trajectory if not recorded or own_trajectory else None,
                             log if not recorded or own_log else None, keep=not recorded)
            # SchNet's whole-model op reads its filter tables and transposed weights made once a run.
            with self._weights_prepared():
                self._drop_graphs_if_the_model_changed()
                start = last_progress = time.perf_counter()
                end = self.step + steps
                # Steps between looks at the clock, whole replays: about half a progress interval once
                # the rate is known, so that a long stretch between writes still reports.
                chunk = self.steps_per_replay
                while self.step < end:
                    next_write = (self.step // write_every + 1) * write_every
                    target = min(next_write, end)
                    self._advance_to(target if self.progress_every is None else min(target, self.step + chunk))
                    if self.step % write_every == 0:
                        self._record(trajectory, log)
                    now = time.perf_counter()
                    if self.progress_every is None:
                        continue
                    done = steps - (end - self.step)
                    rate = done / (now - start) if now > start else 0.0
                    chunk = max(1, int(rate * self.progress_every / 2) // self.steps_per_replay) * self.steps_per_replay
                    if now - last_progress >= self.progress_every:
                        last_progress = now
                        last = self.records[-1]
                        graphs.progress(f"mirage.ff.md: step {self.step} ({done}/{steps} of this run), "
                                        f"{rate:.0f} steps/s; at step {last['step']}: "
                                        f"T {last['temperature']:.1f} K, Etot {last['total']:.6f} eV")
                synchronize(self.device)
                seconds = time.perf_counter() - start
                self.steps_per_second = steps / seconds if steps and seconds > 0 else None
        finally:
            if own_trajectory:
                trajectory.close()
            if own_log:
                log.close()
        return self.records[first:]

    def _weights_prepared(self) -> ContextManager[None]:
        if isinstance(self.model, SchNet):
            return self.model.prepared_weights()
        return contextlib.nullcontext()

    def graph_stats(self) -> Optional[graphs.GraphCacheStats]:
        """The graph cache's counters, or None when graphs are off."""
        return self._graphs.stats() if self._graphs is not None else None
