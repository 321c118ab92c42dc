"""mirage.ff.Calculator (ASE) and mirage.ff.capacity: forces and stress against ASE's finite
differences, ASE's property caching, the neighbor-capacity protocol (overflow and recovery),
precision, bad input; on a GPU, graph replay against eager evaluation."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

ase = pytest.importorskip("ase")
import ase.calculators.calculator  # noqa: E402
from ase.calculators.calculator import PropertyNotImplementedError, all_changes  # noqa: E402
from ase.calculators.fd import calculate_numerical_forces, calculate_numerical_stress  # noqa: E402

import mirage  # noqa: E402
import mirage.ff  # noqa: E402
from mirage import graphs  # noqa: E402
from mirage.ff import capacity, md  # noqa: E402
from mirage.ff.calculator import CapacityWatch  # noqa: E402

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
sys.path.insert(0, EXAMPLES)

from common import (ZERO_FILLS, GraphStandIn, OpCounter, WrappedForceField,  # noqa: E402
                    assert_the_model_runs_with_tf32_as, numpy_rng)
from forcefield.benzene import benzene  # noqa: E402
from forcefield.models import PaiNN, SchNet  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


class CapacityModel(nn.Module):
    """A small pair potential on mirage.ops.neighbor_list with the neighbor-capacity protocol.

    ``E = 1/2 sum_pairs sum_k a_ik a_jk g_k(d_ij)``, ``a = softplus(embedding(Z))`` and ``g_k`` a
    Gaussian basis times the cosine cutoff (mirage.ops.radial_basis): smooth, mostly repulsive.
    """

    def __init__(self, cutoff=3.0, max_pairs=None, num_rbf=6):
        super().__init__()
        self.cutoff, self.num_rbf = cutoff, num_rbf
        self.max_pairs = max_pairs
        self.species = nn.Embedding(20, num_rbf)
        self.register_buffer("num_pairs", torch.zeros(1, dtype=torch.int64))
        self.calls = 0

    def forward(self, atomic_numbers, positions, cell=None, pbc=None):
        self.calls += 1
        if self.max_pairs is None:
            self.max_pairs = 2 * positions.shape[0]  # deliberately tight: dense systems overflow at once
        found = mirage.ops.neighbor_list(positions, self.cutoff, cell, pbc, max_pairs=self.max_pairs)
        self.num_pairs.copy_(found.num_pairs)
        basis = mirage.ops.radial_basis(found.distances, "gaussian", self.num_rbf, self.cutoff, "cosine")
        a = F.softplus(self.species(atomic_numbers))
        i, j = found.pairs
        return 0.5 * (basis * a[i] * a[j]).sum()


class Counting(nn.Module):
    """Counts the calls of a wrapped model."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.calls = 0

    def forward(self, atomic_numbers, positions, cell=None, pbc=None):
        self.calls += 1
        return self.model(atomic_numbers, positions, cell, pbc)


class StandIn(GraphStandIn):
    """GraphStandIn for the calculator's and the MD driver's graph paths, with the model's
    capacity frozen at capture: a replay after it changed fails, as a real graph would silently
    compute with the old one."""

    def __init__(self, fn, args, kwargs, **settings):
        assert not settings["copy_outputs"]
        self.model = fn.__self__._counted  # what the driver found holding the capacity, or None
        super().__init__(fn, args, kwargs, **settings)
        self.max_pairs = getattr(self.model, "max_pairs", None)

    def replay(self):
        assert getattr(self.model, "max_pairs", None) == self.max_pairs, "capacity changed under a captured graph"
        return super().replay()


def graphed_on_cpu(driver, fn, max_entries):
    """Switches a Calculator or VelocityVerlet on the CPU to its graph path, with StandIn graphs."""
    driver.cuda_graph = True
    driver._graphs = graphs.GraphCache(fn, max_entries, copy_outputs=False, capture=StandIn, new_pool=object,
                                       verbose=False)
    driver._watch = CapacityWatch(driver._counted, driver._graphs)  # as the drivers make it
    return driver


def graphed_capacity_calculator():
    """A Calculator around a seeded float64 CapacityModel, on its graph path with StandIn graphs."""
    torch.manual_seed(0)
    calc = mirage.ff.Calculator(CapacityModel(max_pairs=10_000).double())
    return graphed_on_cpu(calc, calc._packed, 2)


def small(cls, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return cls(hidden=16, num_interactions=2, num_rbf=8, cutoff=4.0).to(dtype).eval()


def benzene_atoms(jitter=0.05):
    z, pos = benzene()
    atoms = ase.Atoms(numbers=z.numpy(), positions=pos.numpy())
    atoms.positions += np.random.default_rng(torch.initial_seed() % 2**32).normal(scale=jitter, size=(12, 3))
    return atoms


def periodic_atoms(n=8, cell=((6.0, 0.0, 0.0), (1.0, 6.2, 0.0), (0.5, 0.8, 6.4)), pbc=True):
    """n atoms, jittered but kept apart, in a triclinic cell (a cutoff of 4 < its widths)."""
    rng = np.random.default_rng(torch.initial_seed() % 2**32)
    side = int(np.ceil(n ** (1 / 3)))
    grid = np.array([(a, b, c) for a in range(side) for b in range(side) for c in range(side)][:n], dtype=float)
    frac = (grid + 0.5) / side + rng.uniform(-0.05, 0.05, size=(n, 3))
    numbers = rng.choice([1, 6, 7, 8], size=n)
    return ase.Atoms(numbers=numbers, scaled_positions=frac, cell=np.array(cell), pbc=pbc)


def away_from_cutoff(atoms, cutoff, band=2e-3):
    """atoms, re-jittered until no pair (images included) lies within ``band`` Å of ``cutoff``.

    The cosine cutoff's curvature jumps at the cutoff, so a finite difference whose step carries
    a pair across it is off by ~ step x jump (1e-6 here): a fault of the reference numbers, not of
    the forces under test.
    """
    rng = np.random.default_rng(torch.initial_seed() % 2**32 + 1)
    periodic = bool(atoms.pbc.any())
    for _ in range(100):
        found = mirage.ops.neighbor_list(
            torch.tensor(atoms.positions), cutoff + band,
            torch.tensor(atoms.cell[:]) if periodic else None, torch.as_tensor(atoms.pbc) if periodic else None)
        if not (found.distances[: int(found.num_pairs)] > cutoff - band).any():
            return atoms
        atoms.positions += rng.normal(scale=0.01, size=atoms.positions.shape)
    raise AssertionError("could not place the atoms away from the cutoff")


def structure(atoms, device="cuda", dtype=torch.float32):
    """(numbers, positions, cell, pbc) tensors of an ase.Atoms, as a model and evaluate take them
    (cell and pbc None for open boundaries)."""
    numbers = torch.as_tensor(atoms.numbers, dtype=torch.int64, device=device)
    positions = torch.tensor(atoms.positions, dtype=dtype, device=device)
    if not atoms.pbc.any():
        return numbers, positions, None, None
    return (numbers, positions, torch.tensor(atoms.cell[:], dtype=dtype, device=device),
            torch.tensor(atoms.pbc, device=device))


def direct(model, atoms, dtype=torch.float64):
    """Energy and forces by calling the model directly (the reference)."""
    z, pos, cell, pbc = structure(atoms, "cpu", dtype)
    pos.requires_grad_(True)
    energy = model(z, pos, cell, pbc)
    (grad,) = torch.autograd.grad(energy, pos)
    return energy.item(), -grad.numpy()


# --------------------------------------------------------------------- against ASE's numerics
@pytest.mark.parametrize("cls", [SchNet, PaiNN, CapacityModel])
def test_forces_match_finite_differences_open(cls):
    model = small(cls) if cls is not CapacityModel else CapacityModel().double()
    atoms = away_from_cutoff(benzene_atoms(), model.cutoff)
    atoms.calc = mirage.ff.Calculator(model)
    forces = atoms.get_forces()
    numerical = calculate_numerical_forces(atoms, eps=1e-5)
    assert np.abs(forces).max() > 1e-3  # a model with no forces would compare equal to anything
    np.testing.assert_allclose(forces, numerical, atol=1e-7, rtol=1e-5)
    energy, reference_forces = direct(model, atoms)
    assert atoms.get_potential_energy() == pytest.approx(energy, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(forces, reference_forces, atol=1e-12, rtol=1e-10)
    assert atoms.get_potential_energy(force_consistent=True) == atoms.get_potential_energy()
    with pytest.raises(PropertyNotImplementedError, match="mirage.ff.Calculator: no stress without a periodic axis"):
        atoms.get_stress()


@pytest.mark.parametrize("cls", [SchNet, PaiNN, CapacityModel])
@pytest.mark.parametrize("shape", ["triclinic", "orthorhombic"])
def test_forces_and_stress_match_finite_differences_periodic(cls, shape):
    model = small(cls) if cls is not CapacityModel else CapacityModel(max_pairs=4000).double()
    cell = ((6.0, 0.0, 0.0), (1.0, 6.2, 0.0), (0.5, 0.8, 6.4)) if shape == "triclinic" else np.diag([6.0, 6.5, 7.0])
    atoms = away_from_cutoff(periodic_atoms(cell=cell), model.cutoff)
    atoms.calc = mirage.ff.Calculator(model)
    stress = atoms.get_stress()
    numerical_stress = calculate_numerical_stress(atoms, eps=1e-5)
    assert stress.shape == (6,) and np.abs(stress).max() > 1e-6
    np.testing.assert_allclose(stress, numerical_stress, atol=1e-9, rtol=1e-5)
    full = atoms.get_stress(voigt=False)
    np.testing.assert_allclose(full, full.T)
    forces = atoms.get_forces()
    np.testing.assert_allclose(forces, calculate_numerical_forces(atoms, eps=1e-5), atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("cls", [SchNet, PaiNN])
def test_stress_on_a_slab(cls):
    # Periodic along x and y only: the stress still follows the strain derivative.
    model = small(cls)
    atoms = away_from_cutoff(periodic_atoms(cell=np.diag([6.0, 6.5, 20.0]), pbc=(True, True, False)), model.cutoff)
    atoms.calc = mirage.ff.Calculator(model)
    np.testing.assert_allclose(atoms.get_stress(), calculate_numerical_stress(atoms, eps=1e-5), atol=1e-9, rtol=1e-5)


def test_no_stress_without_a_periodic_axis_and_no_calculation_for_asking():
    calls = []

    class Counting(SchNet):
        def forward(self, *args):
            calls.append(1)
            return super().forward(*args)

    atoms = benzene_atoms()
    atoms.calc = mirage.ff.Calculator(small(Counting))
    atoms.get_forces()
    for _ in range(3):  # ASE alone would compute energy and forces again each time before refusing
        with pytest.raises(PropertyNotImplementedError, match="mirage.ff.Calculator: no stress without a periodic axis"):
            atoms.get_stress()
    assert len(calls) == 1


@pytest.mark.parametrize("number", [-1, 100, 105])
def test_atomic_numbers_past_the_embedding_are_refused_by_name(number):
    atoms = benzene_atoms()
    atoms.numbers[0] = number
    atoms.calc = mirage.ff.Calculator(small(SchNet))  # max_z = 100: rows 0 to 99
    with pytest.raises(ValueError, match=rf"mirage.ff.Calculator: atoms.numbers must be in \[0, 100\) \(the rows of "
                                         rf"the model's embedding\), got {min(number, 1)} to {max(number, 6)}"):
        atoms.get_forces()


def test_evaluate_refuses_shapes_that_make_no_structure():
    model = small(SchNet)
    z, pos, _, _ = structure(benzene_atoms(), "cpu", torch.float64)
    cases = [((z[:10], pos), {}, r"atomic_numbers must be \[N\] for positions \[N, 3\] \(N = 12\), got \[10\]"),
             ((z, pos[:, :2]), {}, r"positions must be \[N, 3\], got \[12, 2\]"),
             ((z, pos, torch.eye(2, dtype=pos.dtype), None), {}, r"cell must be \[3, 3\]"),
             ((z, pos, torch.eye(3, dtype=pos.dtype), torch.ones(2, dtype=torch.bool)), {}, r"pbc must be \[3\]"),
             ((z, pos), {"stress": True}, r"the stress needs the cell"),
             # pbc=None is an open system whatever the cell: a "stress" over an unrelated volume.
             ((z, pos, torch.eye(3, dtype=pos.dtype) * 9, None), {"stress": True},
              r"the stress needs the cell \(strain derivative over its volume\) and pbc .*got cell given, pbc None")]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match="mirage.ff.Calculator: " + message):
            mirage.ff.calculator.evaluate(model, *args, **kwargs)


def test_evaluate_called_directly_lets_a_fused_model_grow_its_capacity(capfd):
    """evaluate is public: its caller checks no neighbor capacity unless it says it does, so a fused
    model grows its own (by default it had left that to the caller, and returned energy, forces and
    stress from a truncated pair list)."""
    reference = small(SchNet)
    numbers, positions, cell, pbc = structure(periodic_atoms(n=12), "cpu", torch.float64)
    want = mirage.ff.calculator.evaluate(reference, numbers, positions, cell, pbc, stress=True)
    fused = mirage.ff.optimize(reference)
    fused.max_pairs = 6  # as chosen by a smaller system before
    got = mirage.ff.calculator.evaluate(fused, numbers, positions, cell, pbc, stress=True)
    assert "exceed the capacity of 6 (max_pairs); growing it" in capfd.readouterr().err
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6 * max(float(w.abs().max()), 1.0), rtol=1e-6)


def test_setting_precision_checks_it_and_drops_the_graphs():
    calc = mirage.ff.Calculator(small(SchNet, torch.float32))
    graphed_on_cpu(calc, calc._packed, 2)
    atoms = benzene_atoms()
    calc.calculate(atoms, ["forces"])
    assert len(calc._graphs) == 1
    with pytest.raises(ValueError, match="mirage.ff.Calculator: precision must be one of"):
        calc.precision = "bf16"  # a typo ran silently as fp32 before
    assert calc.precision == "fp32" and len(calc._graphs) == 1
    calc.precision = "fp32"  # unchanged: the graphs stay
    assert len(calc._graphs) == 1
    calc.precision = "tf32"  # each graph recorded its precision
    assert calc.precision == "tf32" and len(calc._graphs) == 0
    calc.calculate(atoms, ["forces"])
    assert calc.graph_stats().misses == 2


def test_float32_model_gives_float32_accuracy():
    model64 = small(SchNet)
    model32 = small(SchNet, torch.float32)
    atoms = benzene_atoms()
    calc = mirage.ff.Calculator(model32)
    assert calc.dtype == torch.float32
    calc.calculate(atoms, ["forces"])
    _, reference = direct(model64, atoms)
    np.testing.assert_allclose(calc.results["forces"], reference, atol=2e-5, rtol=1e-3)


def test_fused_model_matches_reference():
    # mirage.ff.optimize's fused SchNet (neighbor capacity, fused ops) through the calculator.
    model = small(SchNet)
    fast = mirage.ff.optimize(model)
    assert fast is not model and capacity.has_capacity(fast)
    for atoms in (benzene_atoms(), periodic_atoms(n=12)):
        reference, fused = mirage.ff.Calculator(model), mirage.ff.Calculator(fast)
        properties = ["energy", "forces"] + (["stress"] if atoms.pbc.any() else [])
        reference.calculate(atoms, properties)
        fused.calculate(atoms, properties)
        assert set(fused.results) == set(reference.results)
        # The reference's float32-built basis buffer moves its float64 results by ~1e-7 (docs/ff.md).
        for name, value in reference.results.items():
            scale = max(np.abs(value).max(), 1.0)  # an energy can come out near 0
            np.testing.assert_allclose(fused.results[name], value, atol=1e-6 * scale, rtol=0, err_msg=name)


# -------------------------------------------------------------------------------- ASE caching
def test_property_caching_and_recompute():
    model = Counting(small(SchNet))
    atoms = periodic_atoms()
    atoms.calc = mirage.ff.Calculator(model)
    energy = atoms.get_potential_energy()
    forces = atoms.get_forces()
    stress = atoms.get_stress()
    assert atoms.calc.get_property("free_energy", atoms) == energy
    assert model.calls == 1  # energy, forces and stress come from one evaluation
    kept = forces.copy()
    forces[0, 0] += 1.0  # ASE hands out copies: the cache must not change
    np.testing.assert_array_equal(atoms.get_forces(), kept)
    same = atoms.copy()
    same.calc = atoms.calc
    assert same.get_potential_energy() == energy and model.calls == 1
    atoms.positions[0] += 0.01
    away_from_cutoff(atoms, model.model.cutoff)  # for the finite differences below
    moved = atoms.get_potential_energy()
    assert model.calls == 2 and moved != energy
    np.testing.assert_allclose(atoms.get_stress(), calculate_numerical_stress(atoms, eps=1e-5), atol=1e-9, rtol=1e-5)
    atoms.set_cell(atoms.cell[:] * 1.01, scale_atoms=True)
    assert atoms.get_potential_energy() != moved and model.calls >= 3
    assert not np.array_equal(atoms.get_stress(), stress)


def test_a_calculation_of_its_own_atoms_is_what_the_next_check_compares_with():
    # ASE's calculate() with no atoms calculates calc.atoms, which a caller may have edited: the
    # results were the edited atoms', but check_state still compared with the atoms calculated
    # before, and the unedited atoms got the edited ones' energy.
    model = Counting(small(SchNet))
    atoms = benzene_atoms()
    calc = atoms.calc = mirage.ff.Calculator(model, cuda_graph=False)
    energy = atoms.get_potential_energy()
    calc.atoms.positions[0] += 0.3
    calc.calculate()
    assert calc.results["energy"] != energy and model.calls == 2
    assert calc.check_state(atoms) == ["positions"]
    assert atoms.get_potential_energy() == energy and model.calls == 3
    with pytest.raises(ValueError, match="mirage.ff.Calculator: no atoms to calculate: pass them"):
        mirage.ff.Calculator(model, cuda_graph=False).calculate()  # never given any (AttributeError before)


class WithReferenceEnergies(nn.Module):
    """A float32 network plus float64 energies per element, as force fields are often set up."""

    def __init__(self, learned: bool = False):
        super().__init__()
        self.net = small(SchNet, torch.float32)
        # A step that is no binary fraction: the sum is never a float32 number by chance.
        e0 = torch.linspace(-1000.0, -10.1, 100, dtype=torch.float64)
        if learned:  # a parameter of the wrapper, listed before the network's: not the positions' dtype
            self.e0 = nn.Parameter(e0)
        else:
            self.register_buffer("e0", e0)

    def forward(self, numbers, positions, cell=None, pbc=None):
        return self.net(numbers, positions, cell, pbc).double() + self.e0[numbers].sum()


@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("graphed", [False, True])
def test_a_model_energy_wider_than_its_positions_is_kept(graphed, learned):
    # It was rounded to the positions' float32: 1.2e-4 eV off at -6,000 eV, where mirage.ff.md
    # kept it (float32's spacing there is 4.9e-4 eV). A learned table once made the positions
    # float64, which the float32 network refused.
    model = WithReferenceEnergies(learned)
    atoms = benzene_atoms()
    exact = model(torch.from_numpy(atoms.numbers), torch.tensor(atoms.positions, dtype=torch.float32)).item()
    calc = mirage.ff.Calculator(model, cuda_graph=False)
    atoms.calc = graphed_on_cpu(calc, calc._packed, 2) if graphed else calc
    assert atoms.get_potential_energy() == exact
    assert float(np.float32(exact)) != exact  # the case tests something
    integrator = md.VelocityVerlet(model, benzene_atoms(), 0.5 * ase.units.fs, progress_every=None)
    assert integrator.dtype == torch.float32
    assert integrator.run(0)[0]["potential"] == exact


def test_atom_count_change():
    model = Counting(small(SchNet))
    calc = mirage.ff.Calculator(model)
    atoms = benzene_atoms()
    atoms.calc = calc
    first = atoms.get_forces()
    del atoms[[3, 9]]
    assert len(atoms) == 10
    forces = atoms.get_forces()
    assert forces.shape == (10, 3) and model.calls == 2
    energy, reference = direct(model.model, atoms)
    assert atoms.get_potential_energy() == pytest.approx(energy, rel=1e-12)
    np.testing.assert_allclose(forces, reference, atol=1e-12, rtol=1e-10)
    atoms2 = benzene_atoms()
    atoms2.calc = calc
    assert atoms2.get_forces().shape == first.shape and model.calls == 3


def test_changed_numbers_recompute():
    model = Counting(small(SchNet))
    atoms = benzene_atoms()
    atoms.calc = mirage.ff.Calculator(model)
    energy = atoms.get_potential_energy()
    atoms.numbers[6] = 9
    assert atoms.get_potential_energy() != energy and model.calls == 2


def changed(atoms, change):
    """A copy of atoms with one kind of change, for the check_state tests ("none", "nan_cell" and
    unknown names: an unchanged copy)."""
    other = atoms.copy()
    if change == "below_tol":
        other.positions[2, 0] += 1e-16
    elif change == "position":
        other.positions[2, 0] += 1e-9
    elif change == "inf":
        other.positions[1, 2] = np.inf  # equal infinities: no change, as np.allclose says
        other.positions[0, 0] += 1.0
    elif change == "number":
        other.numbers[0] = 8
    elif change == "cell":
        other.cell[0, 1] += 1e-6
    elif change == "pbc":
        other.pbc = (True, False, True)
    elif change == "charges":
        other.set_initial_charges(np.full(len(other), 0.5))  # an array on one side only
    elif change == "momenta":
        other.set_momenta(np.ones((len(other), 3)))  # not a system change
    return other


@pytest.mark.parametrize("change", ["none", "below_tol", "position", "number", "cell", "pbc", "nan_cell"])
def test_check_state_after_a_calculation_agrees_with_ase(change):
    # Against the calculator's own snapshot check_state compares bytes first (where the snapshot
    # holds no NaN): the answers must still be ASE's. nan_cell: a molecule's unused cell with a
    # NaN, which ASE finds changed even against itself.
    from ase.calculators.calculator import compare_atoms
    model = Counting(small(SchNet))
    atoms = benzene_atoms()
    if change == "nan_cell":
        atoms.cell[2, 2] = np.nan
    atoms.calc = calc = mirage.ff.Calculator(model)
    atoms.get_forces()
    other = changed(atoms, change)
    expected = compare_atoms(calc.atoms, other, tol=1e-15)
    assert sorted(calc.check_state(other)) == sorted(expected)
    assert (change in ("none", "below_tol")) == (not expected)


def test_shallow_copy_keeps_its_own_snapshot():
    # ASE's combine_mm copies calculators with copy.copy. Each overwrites its snapshot in place:
    # a shared one would make the original's check_state match the copy's atoms, and hand out the
    # original's results for them.
    import copy as copy_module
    model = small(SchNet)
    atoms = benzene_atoms()
    calc = mirage.ff.Calculator(model)
    energy = calc.get_potential_energy(atoms)
    moved = atoms.copy()
    moved.positions[0, 0] += 0.3
    clone = copy_module.copy(calc)
    assert clone.atoms is not calc.atoms and clone.get_potential_energy(atoms) == energy  # its cache
    moved_energy = clone.get_potential_energy(moved)
    assert moved_energy != energy
    assert calc.check_state(moved) == ["positions"]
    assert calc.get_potential_energy(moved) == pytest.approx(moved_energy, rel=1e-12)


def test_check_state_after_the_snapshot_is_edited():
    # check_state's byte comparison is against what the calculation saw, not against calc.atoms,
    # which a caller may edit: a NaN put there must not pass for the NaN-free state computed.
    from ase.calculators.calculator import compare_atoms
    atoms = benzene_atoms()
    calc = mirage.ff.Calculator(small(SchNet))
    calc.get_potential_energy(atoms)
    calc.atoms.positions[1, 0] = np.nan
    edited = calc.atoms.copy()
    assert calc.check_state(edited) == compare_atoms(calc.atoms, edited, tol=1e-15) == ["positions"]


def test_calculation_makes_the_directory(tmp_path):
    # As ASE's Calculator.calculate does (mirage itself writes nothing there).
    calc = mirage.ff.Calculator(small(SchNet))
    calc.directory = str(tmp_path / "run")
    calc.get_potential_energy(benzene_atoms())
    assert (tmp_path / "run").is_dir()


def test_snapshot_is_the_calculated_atoms_and_independent_of_them():
    # calc.atoms is the calculator's own copy of what it computed, kept in one object from step to
    # step (Calculator._remember): it must hold every array, the cell, pbc, info and constraints
    # of the last calculation, and never alias the caller's atoms.
    from ase.calculators.calculator import compare_atoms
    from ase.constraints import FixAtoms
    model = Counting(small(SchNet))
    atoms = periodic_atoms()
    atoms.calc = calc = mirage.ff.Calculator(model)
    atoms.get_forces()
    first = calc.atoms
    steps = [lambda a: a.positions.__setitem__((0, 0), a.positions[0, 0] + 0.01),
             lambda a: a.set_momenta(np.full((len(a), 3), 0.1)),  # a new array: a fresh copy
             lambda a: a.positions.__iadd__(0.002),
             lambda a: a.set_cell(a.cell[:] * 1.001, scale_atoms=True),
             lambda a: a.info.__setitem__("step", 4),
             lambda a: a.set_constraint(FixAtoms(indices=[1])),
             lambda a: a.positions.__isub__(0.001)]
    for step in steps:
        step(atoms)
        atoms.positions[2, 1] += 1e-3  # a system change each step: a calculation each
        atoms.get_forces()
        snapshot = calc.atoms
        assert snapshot is not atoms and not compare_atoms(snapshot, atoms, tol=0)
        assert snapshot.arrays.keys() == atoms.arrays.keys() and snapshot.info == atoms.info
        for name, array in atoms.arrays.items():
            assert not np.shares_memory(snapshot.arrays[name], array)
            np.testing.assert_array_equal(snapshot.arrays[name], array)
        assert [c.todict() for c in snapshot.constraints] == [c.todict() for c in atoms.constraints]
        assert calc.check_state(atoms) == []
    assert calc.atoms is not first  # momenta joined the arrays: a new snapshot from then on
    assert model.calls == 1 + len(steps)
    atoms.positions[0, 0] += 0.01  # the snapshot does not follow the caller's atoms
    assert calc.check_state(atoms) == ["positions"]


# ------------------------------------------------------------------------------ capacity
def test_overflow_grows_and_recomputes(capfd):
    atoms = periodic_atoms(n=12)
    reference = CapacityModel(max_pairs=10_000).double()
    model = CapacityModel(max_pairs=3).double()
    model.load_state_dict(reference.state_dict())
    atoms.calc = mirage.ff.Calculator(reference)
    expected = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
    true_count = int(reference.num_pairs)
    assert true_count > 3 * 1.5  # the small capacity really overflows
    atoms.calc = mirage.ff.Calculator(model)
    got = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
    assert model.max_pairs >= true_count and model.calls >= 2
    assert got[0] == pytest.approx(expected[0], rel=1e-12)
    np.testing.assert_allclose(got[1], expected[1], atol=1e-12, rtol=1e-10)
    np.testing.assert_allclose(got[2], expected[2], atol=1e-12, rtol=1e-10)
    err = capfd.readouterr().err
    assert "neighbor pairs exceed the model's capacity of 3" in err and "growing it to" in err


@pytest.mark.parametrize("graphed", [False, True])
def test_a_fused_model_leaves_its_capacity_to_the_calculator(graphed, capfd):
    # A fused model grows its own capacity in a direct call, but not inside a driver
    # (capacity.checked_by_caller): graphs captured earlier hold the old capacity, and only the
    # driver drops them all when it grows it.
    reference = small(SchNet)
    fused = mirage.ff.optimize(reference)
    atoms = periodic_atoms(n=12)
    expected = mirage.ff.Calculator(reference)
    atoms.calc = expected
    want = atoms.get_potential_energy(), atoms.get_forces()
    with capacity.checked_by_caller():
        fused.max_pairs = 6
        z, pos = torch.tensor(atoms.numbers), torch.tensor(atoms.positions)
        fused(z, pos, torch.tensor(atoms.cell[:]), torch.tensor(atoms.pbc))
        assert fused.max_pairs == 6 and int(fused.num_pairs) > 6  # reported, not grown
    capfd.readouterr()
    calc = mirage.ff.Calculator(fused)
    if graphed:
        graphed_on_cpu(calc, calc._packed, 4)
    atoms.calc = calc
    got = atoms.get_potential_energy(), atoms.get_forces()
    err = capfd.readouterr().err
    assert "mirage.ff.Calculator:" in err and "exceed the model's capacity of 6" in err
    assert "mirage.ff.fused.SchNet:" not in err
    # The reference's basis buffer is float32-rounded: ~1e-8 apart, where a cut pair list is far off.
    assert got[0] == pytest.approx(want[0], rel=1e-6, abs=1e-6)  # an energy can come out near 0
    np.testing.assert_allclose(got[1], want[1], atol=1e-6 * np.abs(want[1]).max(), rtol=0)


@pytest.mark.parametrize("graphed", [False, True])
def test_a_wrapped_fused_model_has_its_capacity_checked(graphed, capfd):
    reference = small(SchNet)
    atoms = periodic_atoms(n=12)
    atoms.calc = mirage.ff.Calculator(reference)
    want = atoms.get_potential_energy(), atoms.get_forces()
    fused = mirage.ff.optimize(reference)
    fused.max_pairs = 6  # as chosen by a smaller system before
    calc = mirage.ff.Calculator(WrappedForceField(fused))
    if graphed:
        graphed_on_cpu(calc, calc._packed, 4)
    atoms.calc = calc
    got = atoms.get_potential_energy(), atoms.get_forces()
    assert "exceed the model's capacity of 6" in capfd.readouterr().err
    assert got[0] == pytest.approx(want[0], rel=1e-6, abs=1e-6)  # an energy can come out near 0
    np.testing.assert_allclose(got[1], want[1], atol=1e-6 * np.abs(want[1]).max(), rtol=0)
    with pytest.raises(ValueError, match="the model holds 2 modules with a neighbor capacity"):
        mirage.ff.Calculator(nn.ModuleList([fused, mirage.ff.optimize(small(SchNet))]))


@pytest.mark.parametrize("holder", ["function", "list"])
def test_a_fused_model_the_calculator_cannot_see_grows_its_own_capacity(holder, capfd):
    # Called through a plain function (or held in a list), the fused model is not found by the
    # calculator, which once still told it to leave its overflow to the caller: the energy was
    # computed from the pairs that fit in the old capacity.
    reference = small(SchNet, torch.float32)  # a plain callable's positions come in float32
    atoms = periodic_atoms(n=12)
    want = mirage.ff.Calculator(reference).get_potential_energy(atoms)
    fused = mirage.ff.optimize(reference)
    fused.max_pairs = 6
    if holder == "function":
        def model(*args):
            return fused(*args)
    else:
        class Ensemble:
            members = [fused]

            def __call__(self, *args):
                return self.members[0](*args)

        model = Ensemble()
    got = mirage.ff.Calculator(model).get_potential_energy(atoms)
    assert "exceed the capacity of 6 (max_pairs); growing it" in capfd.readouterr().err
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)  # 0.32 against 0.36 from the pairs that fit in 6


@pytest.mark.cuda
def test_a_fused_model_the_calculator_cannot_see_is_not_captured():
    fused = mirage.ff.optimize(small(SchNet, torch.float32)).cuda()
    calc = mirage.ff.Calculator(lambda *args: fused(*args), device="cuda")
    with pytest.raises(ValueError, match=r"mirage.ff.Calculator: the model calls mirage.ff.fused.SchNet, which has a "
                                         r"neighbor capacity, but holds it where the capacity cannot be checked"):
        calc.get_potential_energy(periodic_atoms(n=12))
    eager = mirage.ff.Calculator(lambda *args: fused(*args), device="cuda", cuda_graph=False)
    assert np.isfinite(eager.get_potential_energy(periodic_atoms(n=12)))


def test_unchecked_by_refuses_a_capture_only_inside_it():
    capacity.refuse_unchecked_capture("a model")  # nobody said they would not check
    with capacity.unchecked_by("a driver"):
        with capacity.checked_by_caller():
            assert capacity.caller_checks()
        with pytest.raises(ValueError, match="a driver: the model calls a model, which has a neighbor capacity"):
            capacity.refuse_unchecked_capture("a model")
    capacity.refuse_unchecked_capture("a model")


@pytest.mark.parametrize("graphed", [False, True])
def test_atomic_numbers_are_checked_against_a_wrapped_fused_models_embedding(graphed):
    """A replayed graph runs none of the fused model's own checks: the table it reads is the
    wrapped model's, and the Calculator checks against it (it looked at the wrapper alone)."""
    atoms = benzene_atoms()
    atoms.numbers[0] = 100
    calc = mirage.ff.Calculator(WrappedForceField(mirage.ff.optimize(small(SchNet))))
    if graphed:
        graphed_on_cpu(calc, calc._packed, 2)
    atoms.calc = calc
    with pytest.raises(ValueError, match=r"mirage.ff.Calculator: atoms.numbers must be in \[0, 100\) \(the rows of "):
        atoms.get_forces()


def test_reset_forgets_the_atomic_numbers_it_checked():
    # docs/ff.md: after replacing parameters, call reset(); a smaller embedding is then checked
    # again (it once kept the former check and failed in PyTorch with a bare IndexError).
    model = small(SchNet)
    atoms = benzene_atoms()
    atoms.numbers[0] = 60
    atoms.calc = calc = mirage.ff.Calculator(model)
    atoms.get_potential_energy()
    model.embedding = nn.Embedding(50, model.embedding.embedding_dim).double()
    calc.reset()
    with pytest.raises(ValueError, match=r"atoms.numbers must be in \[0, 50\)"):
        atoms.get_potential_energy()


def test_a_reset_that_raises_leaves_no_graph_of_the_former_model():
    fused = mirage.ff.optimize(small(SchNet, torch.float32))
    atoms = benzene_atoms()
    calc = mirage.ff.Calculator(fused, precision="tf32")
    atoms.calc = graphed_on_cpu(calc, calc._packed, 2)
    atoms.get_potential_energy()
    fused.double()
    with pytest.raises(ValueError, match="precision='tf32' changes float32 arithmetic only"):
        calc.reset()
    calc.precision = "fp32"
    fresh = mirage.ff.Calculator(fused)
    assert atoms.get_potential_energy() == fresh.get_potential_energy(atoms)


def test_reset_reads_the_models_dtype_again():
    # docs/ff.md: after changing the model, call reset(). model.double() changes its dtype, which
    # the positions must follow (the fused model refuses positions of another dtype).
    fused = mirage.ff.optimize(small(SchNet, torch.float32))
    atoms = benzene_atoms()
    atoms.calc = calc = mirage.ff.Calculator(fused)
    atoms.get_potential_energy()
    fused.double()
    calc.reset()
    assert calc.dtype == torch.float64
    fresh = mirage.ff.Calculator(fused)
    assert atoms.get_potential_energy() == fresh.get_potential_energy(atoms)


def test_capacity_picked_by_first_forward_then_grown():
    model = CapacityModel().double()  # max_pairs None: the first forward picks 2 N
    atoms = periodic_atoms(n=27)
    atoms.calc = mirage.ff.Calculator(model)
    energy = atoms.get_potential_energy()
    assert model.max_pairs >= int(model.num_pairs) > 2 * 27
    big = CapacityModel(max_pairs=10_000).double()
    big.load_state_dict(model.state_dict())
    assert energy == pytest.approx(direct(big, atoms)[0], rel=1e-12)


class Protocol:
    def __init__(self, max_pairs, num_pairs):
        self.max_pairs = max_pairs
        self.num_pairs = torch.tensor([num_pairs])


def test_needed_pairs():
    assert capacity.needed_pairs(small(SchNet)) is None  # no protocol
    assert capacity.needed_pairs(Protocol(None, 5)) is None  # not run yet
    assert capacity.needed_pairs(Protocol(100, 100)) is None
    assert capacity.needed_pairs(Protocol(100, 0)) is None
    assert capacity.needed_pairs(Protocol(100, 101)) == 150  # x1.5 of the capacity
    assert capacity.needed_pairs(Protocol(100, 1000)) == 1200  # the count with a 20% margin
    assert capacity.needed_pairs(Protocol(100, 5), num_pairs=130) == 156  # a count read elsewhere
    assert capacity.needed_pairs(Protocol(100, 500), num_pairs=torch.tensor([7])) is None
    assert capacity.has_capacity(CapacityModel()) and not capacity.has_capacity(small(SchNet))
    with pytest.raises(ValueError, match="mirage.ff.capacity: .*num_pairs = -1: invalid input"):
        capacity.needed_pairs(Protocol(100, -1))


def test_invalid_structure_is_refused():
    atoms = benzene_atoms()
    atoms.positions[2, 1] = np.nan
    atoms.calc = mirage.ff.Calculator(CapacityModel().double())
    with pytest.raises(ValueError, match="mirage.ff.Calculator: atoms.positions has non-finite values"):
        atoms.get_forces()


def test_graph_path_on_cpu():
    # The graph path's control flow (staging buffers, cache per atom count, overflow: grow, drop
    # the graphs, recapture, recompute) with StandIn graphs; the GPU tests below run the real ones.
    torch.manual_seed(0)
    model = CapacityModel(max_pairs=3).double()
    big = CapacityModel(max_pairs=10_000).double()
    big.load_state_dict(model.state_dict())
    calc = mirage.ff.Calculator(model)
    graphed_on_cpu(calc, calc._packed, 2)
    for n in (12, 12, 7, 12):
        atoms = periodic_atoms(n=n)
        atoms.positions += numpy_rng().normal(scale=0.05, size=atoms.positions.shape)
        calc.calculate(atoms, ["energy", "forces", "stress"])
        reference = mirage.ff.Calculator(big)
        reference.calculate(atoms, ["energy", "forces", "stress"])
        for name in ("energy", "forces", "stress"):
            np.testing.assert_allclose(calc.results[name], reference.results[name], rtol=1e-12, atol=1e-14)
    stats = calc.graph_stats()
    assert model.max_pairs >= int(model.num_pairs) > 3
    assert stats.misses >= 3 and stats.entries <= 2 and len(calc._buffers) <= 2
    open_atoms = benzene_atoms()
    calc.calculate(open_atoms, ["forces"])
    assert "stress" not in calc.results
    np.testing.assert_allclose(calc.results["forces"], direct(big, open_atoms)[1], rtol=1e-10, atol=1e-14)


def test_an_ase_that_resets_on_every_step_keeps_the_graphs(monkeypatch):
    # ASE's get_property up to 3.23 or so called reset() whenever the atoms changed (every MD step),
    # which dropped the calculator's graphs: a capture at every step. An explicit reset() still does.
    def old_get_property(self, name, atoms=None, allow_calculation=True):
        if atoms is not None and self.check_state(atoms):
            self.reset()
        if name not in self.results:
            self.calculate(atoms, [name], all_changes)
        return self.results[name]

    monkeypatch.setattr(ase.calculators.calculator.Calculator, "get_property", old_get_property)
    calc = graphed_capacity_calculator()
    atoms = periodic_atoms(n=12)
    atoms.calc = calc
    for _ in range(5):
        atoms.positions += numpy_rng().normal(scale=0.01, size=atoms.positions.shape)
        np.testing.assert_allclose(atoms.get_forces(), direct(calc.model, atoms)[1], rtol=1e-10, atol=1e-14)
    assert calc.graph_stats().misses == 1 and calc.graph_stats().hits == 4
    calc.reset()
    assert calc.graph_stats().entries == 0


def test_graph_path_follows_numbers_cell_and_pbc_at_one_atom_count():
    # The graph path re-sends numbers, cell and pbc only when they change: each change must reach
    # the graph, each evaluation must equal a fresh eager one.
    calc = graphed_capacity_calculator()
    atoms = periodic_atoms(n=10)
    changes = [lambda a: None, lambda a: a.numbers.__setitem__(3, 9), lambda a: None,
               lambda a: a.set_cell(a.cell[:] * 1.05, scale_atoms=False), lambda a: a.set_pbc((True, True, False)),
               lambda a: a.numbers.__setitem__(3, 6)]
    for change in changes:
        change(atoms)
        atoms.positions += numpy_rng().normal(scale=0.02, size=atoms.positions.shape)
        calc.calculate(atoms, ["energy", "forces", "stress"])
        reference = mirage.ff.Calculator(calc.model, cuda_graph=False)
        reference.calculate(atoms, ["energy", "forces", "stress"])
        for name in ("energy", "forces", "stress"):
            np.testing.assert_allclose(calc.results[name], reference.results[name], rtol=1e-12, atol=1e-14)
    assert calc.graph_stats().misses == 1 and calc.graph_stats().hits == len(changes) - 1


@pytest.mark.parametrize("change", ["none", "below_tol", "position", "inf", "number", "cell", "pbc", "charges",
                                    "momenta"])
def test_check_state_agrees_with_ase(change):
    from ase.calculators.calculator import compare_atoms
    calc = mirage.ff.Calculator(small(SchNet))
    atoms = periodic_atoms()
    calc.atoms = atoms.copy()
    if change == "inf":
        calc.atoms.positions[1, 2] = np.inf
    other = changed(calc.atoms, change)
    expected = compare_atoms(calc.atoms, other, tol=1e-15)
    assert sorted(calc.check_state(other)) == sorted(expected)
    assert (change in ("none", "below_tol", "momenta")) == (not expected)


def test_graphs_follow_a_capacity_grown_elsewhere():
    # Two calculators share one model: when one grows the capacity, the other's graphs (holding
    # the old one) must be captured again, or a count between the two would pass unnoticed.
    torch.manual_seed(0)
    model = CapacityModel(max_pairs=10_000).double()
    first, second = (graphed_on_cpu(c, c._packed, 2) for c in
                     (mirage.ff.Calculator(model), mirage.ff.Calculator(model)))
    atoms = periodic_atoms(n=12)
    first.calculate(atoms, ["forces"])
    second.calculate(atoms, ["forces"])
    model.max_pairs = 3
    atoms.positions[0] += 0.01
    first.calculate(atoms, ["forces"])  # grows the capacity and recaptures
    atoms.positions[0] += 0.01
    second.calculate(atoms, ["forces"])  # StandIn fails if second replays its old graph
    assert second.graph_stats().misses == 2
    big = CapacityModel(max_pairs=10_000).double()
    big.load_state_dict(model.state_dict())
    np.testing.assert_allclose(second.results["forces"], direct(big, atoms)[1], rtol=1e-10, atol=1e-14)


# ------------------------------------------------------------------------------ precision
def _matmul_state():
    matmul = torch.backends.cuda.matmul
    return (matmul.fp32_precision if hasattr(matmul, "fp32_precision") else matmul.allow_tf32,
            torch.get_float32_matmul_precision())


@pytest.mark.parametrize("optimized", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16-mixed"])
def test_precision_runs_and_restores_flags(precision, optimized):
    model = small(PaiNN, torch.float32)
    if optimized:
        model = mirage.ff.optimize(model)
    atoms = benzene_atoms()
    before = _matmul_state()
    calc = mirage.ff.Calculator(model, precision=precision)
    calc.calculate(atoms, ["forces"])
    assert _matmul_state() == before
    assert torch.is_autocast_enabled("cpu") is False
    _, reference = direct(small(PaiNN), atoms)
    forces = calc.results["forces"]
    assert forces.dtype == np.float64 and np.isfinite(forces).all()
    error = np.abs(forces - reference).max() / np.abs(reference).max()
    # bf16 keeps 8 mantissa bits: its forces are percent-accurate; fp32 and tf32 (the CPU has no TF32) exact.
    assert error < (0.1 if precision == "bf16-mixed" else 1e-4), error


@pytest.mark.parametrize("callers", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_the_model_runs_with_tf32_as_the_precision_says(precision, callers):
    assert_the_model_runs_with_tf32_as(precision, callers, lambda model: mirage.ff.Calculator(
        model, precision=precision).calculate(benzene_atoms(), ["forces"]))


@pytest.mark.parametrize("level", ["highest", "high", "medium"])
def test_the_callers_matmul_precision_comes_back(level):
    # "medium" has no backend setting of its own: restored through the backend flags alone, the
    # global getter raised on the mix of APIs afterwards.
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(level)
    try:
        before = _matmul_state()
        atoms = benzene_atoms()
        atoms.calc = mirage.ff.Calculator(small(SchNet, torch.float32))
        atoms.get_forces()
        assert _matmul_state() == before and before[1] == level
    finally:
        torch.set_float32_matmul_precision(previous)


def test_model_failing_under_autocast():
    # The reference SchNet index_adds float32 messages into a bfloat16 tensor under autocast.
    atoms = benzene_atoms()
    atoms.calc = mirage.ff.Calculator(small(SchNet, torch.float32), precision="bf16-mixed")
    with pytest.raises(RuntimeError, match=r"mirage.ff.Calculator: the model failed under torch.autocast\(bfloat16\) "
                                           r"\(precision='bf16-mixed'\)(.|\n)*use precision='fp32' or 'tf32'"):
        atoms.get_forces()


@pytest.mark.parametrize("precision", ["fp16", "FP32", None, "bf16"])
def test_unknown_precision(precision):
    with pytest.raises(ValueError, match="mirage.ff.Calculator: precision must be one of 'fp32', 'tf32', 'bf16-mixed'"):
        mirage.ff.Calculator(small(SchNet), precision=precision)


@pytest.mark.parametrize("precision", ["tf32", "bf16-mixed"])
def test_float32_precisions_refused_for_a_float64_model(precision):
    # Autocast and TF32 leave float64 arithmetic alone: the option would do nothing.
    message = rf"precision='{precision}' changes float32 arithmetic only, and the model is float64"
    with pytest.raises(ValueError, match="mirage.ff.Calculator: " + message):
        mirage.ff.Calculator(small(SchNet, torch.float64), precision=precision)
    with pytest.raises(ValueError, match="mirage.ff.md.VelocityVerlet: " + message):
        md.VelocityVerlet(small(SchNet, torch.float64), benzene_atoms(), 0.5, precision=precision)
    model = small(SchNet, torch.float32)
    calc = mirage.ff.Calculator(model, precision=precision)
    model.double()  # then calc.reset(), as after any change of the model
    with pytest.raises(ValueError, match="mirage.ff.Calculator: " + message):
        calc.reset()


# ------------------------------------------------------------------------------ bad input
def test_pbc_without_cell():
    atoms = benzene_atoms()
    atoms.pbc = True
    atoms.calc = mirage.ff.Calculator(small(SchNet))
    with pytest.raises(ValueError, match=r"mirage.ff.Calculator: atoms.pbc is \[True, True, True\] but the cell .* "
                                         "has no volume"):
        atoms.get_potential_energy()


def test_model_of_wrong_signature():
    with pytest.raises(ValueError, match=r"mirage.ff.Calculator: model must be callable as "
                                         r"model\(atomic_numbers, positions, cell, pbc\)"):
        mirage.ff.Calculator(nn.Linear(3, 1))
    with pytest.raises(ValueError, match="model must be callable"):
        mirage.ff.Calculator(lambda positions: positions.sum())
    with pytest.raises(ValueError, match="model must be callable"):
        mirage.ff.Calculator("schnet")


def test_model_returning_no_scalar():
    atoms = benzene_atoms()
    atoms.calc = mirage.ff.Calculator(lambda z, pos, cell, pbc: (pos**2).sum(dim=1))
    with pytest.raises(ValueError, match=r"mirage.ff.Calculator: the model must return the total energy as a scalar "
                                         r"floating-point tensor, got a torch.float32 tensor of shape \[12\]"):
        atoms.get_potential_energy()
    atoms.calc = mirage.ff.Calculator(lambda z, pos, cell, pbc: 1.0)
    with pytest.raises(ValueError, match="scalar floating-point tensor, got a float"):
        atoms.get_potential_energy()


def test_model_not_depending_on_positions():
    atoms = benzene_atoms()
    atoms.calc = mirage.ff.Calculator(lambda z, pos, cell, pbc: torch.tensor(1.0, dtype=pos.dtype))
    with pytest.raises(ValueError, match="mirage.ff.Calculator: the model's energy does not depend on positions"):
        atoms.get_forces()


@pytest.mark.parametrize("fused", [False, True])
def test_coincident_atoms_raise_instead_of_returning_nan(fused):
    # PaiNN divides the pair vector by its length: two atoms at one position give NaN, which was
    # handed to ASE (an optimizer then moved every atom to NaN and failed later on the positions).
    model = small(PaiNN)
    model = mirage.ff.optimize(model) if fused else model
    atoms = benzene_atoms()
    atoms.positions[7] = atoms.positions[2]
    atoms.calc = mirage.ff.Calculator(model)
    with pytest.raises(RuntimeError, match=r"mirage.ff.Calculator: the model's energy \(nan\) or forces for "
                                           r"these atoms are not finite; the closest atoms, 2 and 7, are 0 Å apart"):
        atoms.get_forces()
    with pytest.raises(RuntimeError, match="the closest atoms, 2 and 7"):
        atoms.get_potential_energy()  # no result was kept
    atoms.positions[7] += 0.5
    assert np.isfinite(atoms.get_forces()).all()


def test_empty_atoms():
    atoms = ase.Atoms()
    atoms.calc = mirage.ff.Calculator(small(SchNet))
    with pytest.raises(ValueError, match="mirage.ff.Calculator: the Atoms object has no atoms"):
        atoms.get_potential_energy()


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_graphs=0), "max_graphs must be an int >= 1, got 0"),
    (dict(max_graphs=2.5), "max_graphs must be an int >= 1"),
    (dict(cuda_graph="yes"), "cuda_graph must be a bool, got 'yes'"),
    (dict(device="gpu7"), "device 'gpu7' is not a torch device"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match="mirage.ff.Calculator: " + message):
        mirage.ff.Calculator(small(SchNet), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cuda_device_without_cuda():
    with pytest.raises(ValueError, match="mirage.ff.Calculator: device cuda requested but CUDA is not available"):
        mirage.ff.Calculator(small(SchNet), device="cuda")


def test_cpu_ignores_cuda_graph():
    calc = mirage.ff.Calculator(small(SchNet), cuda_graph=True)
    assert not calc.cuda_graph and calc.graph_stats() is None


# ------------------------------------------------------------------------------ on a GPU
def cuda_model(max_pairs=None, seed=0):
    torch.manual_seed(seed)
    return CapacityModel(max_pairs=max_pairs).cuda()


def _double_of(model):
    """A float64 CPU copy of a CUDA CapacityModel (the reference for its GPU results)."""
    copy = CapacityModel(max_pairs=model.max_pairs).double()
    copy.load_state_dict({k: v.detach().cpu().double() if v.is_floating_point() else v.cpu()
                          for k, v in model.state_dict().items()})
    return copy


@pytest.mark.cuda
@pytest.mark.parametrize("periodic", [False, True])
def test_graph_replay_matches_eager(periodic):
    model = cuda_model(max_pairs=4000)
    graphed = mirage.ff.Calculator(model, cuda_graph=True)
    eager = mirage.ff.Calculator(model, cuda_graph=False)
    atoms = periodic_atoms(n=12) if periodic else benzene_atoms()
    staged = []
    for _ in range(4):  # new positions each call: replays must read them
        atoms.positions += numpy_rng().normal(scale=0.02, size=atoms.positions.shape)
        graphed.calculate(atoms, ["forces"])
        eager.calculate(atoms, ["forces"])
        (stage,) = graphed._buffers.values()  # the host side: pinned, and the same buffers every call
        assert stage["packed"].is_pinned() and all(t.is_pinned() for t in stage["inputs"].values())
        staged.append((stage["packed"].data_ptr(), stage["inputs"]["positions"].data_ptr()))
        assert graphed.results["energy"] == pytest.approx(eager.results["energy"], rel=1e-5, abs=1e-5)
        np.testing.assert_allclose(graphed.results["forces"], eager.results["forces"], atol=1e-5, rtol=1e-4)
        if periodic:
            np.testing.assert_allclose(graphed.results["stress"], eager.results["stress"], atol=1e-6, rtol=1e-4)
    _, forces64 = direct(_double_of(model), atoms)
    np.testing.assert_allclose(graphed.results["forces"], forces64, atol=1e-4, rtol=1e-3)
    stats = graphed.graph_stats()
    assert stats.misses == 1 and stats.hits == 3
    assert len(set(staged)) == 1


@pytest.mark.cuda
def test_graph_follows_numbers_cell_and_pbc_at_one_atom_count():
    # Numbers, cell and pbc reach the graph only when they change (one H2D copy of the positions
    # otherwise): each change must show in the results, against eager evaluation on the GPU.
    model = cuda_model(max_pairs=4000)
    graphed = mirage.ff.Calculator(model)
    eager = mirage.ff.Calculator(model, cuda_graph=False)
    atoms = periodic_atoms(n=10)
    changes = [lambda a: None, lambda a: a.numbers.__setitem__(3, 9), lambda a: None,
               lambda a: a.set_cell(a.cell[:] * 1.05, scale_atoms=False), lambda a: a.set_pbc((True, True, False))]
    for change in changes:
        change(atoms)
        atoms.positions += numpy_rng().normal(scale=0.02, size=atoms.positions.shape)
        graphed.calculate(atoms, ["energy", "forces", "stress"])
        eager.calculate(atoms, ["energy", "forces", "stress"])
        assert graphed.results["energy"] == pytest.approx(eager.results["energy"], rel=1e-5, abs=1e-5)
        np.testing.assert_allclose(graphed.results["forces"], eager.results["forces"], atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(graphed.results["stress"], eager.results["stress"], atol=1e-6, rtol=1e-4)
    assert graphed.graph_stats().misses == 1


@pytest.mark.cuda
def test_graph_per_atom_count_and_bounded_cache():
    model = cuda_model(max_pairs=4000)
    calc = mirage.ff.Calculator(model, max_graphs=2)
    for n in (6, 9, 12, 6):
        atoms = periodic_atoms(n=n)
        calc.calculate(atoms, ["forces"])
        _, reference = direct(_double_of(model), atoms)
        np.testing.assert_allclose(calc.results["forces"], reference, atol=1e-4, rtol=1e-3)
    stats = calc.graph_stats()
    assert stats.misses == 4 and stats.entries == 2 and stats.evictions == 2


@pytest.mark.cuda
def test_graph_recaptures_on_overflow(capfd):
    model = cuda_model(max_pairs=3)
    calc = mirage.ff.Calculator(model)
    atoms = periodic_atoms(n=12)
    calc.calculate(atoms, ["forces"])
    assert model.max_pairs >= int(model.num_pairs) > 3
    _, reference = direct(_double_of(model), atoms)
    np.testing.assert_allclose(calc.results["forces"], reference, atol=1e-4, rtol=1e-3)
    assert calc.graph_stats().misses >= 2
    assert "growing it to" in capfd.readouterr().err
    # Denser: the same cell shrunk; the capacity grows again, with the graph recaptured.
    before = model.max_pairs
    atoms.set_cell(atoms.cell[:] * 0.8, scale_atoms=True)
    calc.calculate(atoms, ["forces"])
    _, reference = direct(_double_of(model), atoms)
    np.testing.assert_allclose(calc.results["forces"], reference, atol=1e-4, rtol=1e-3)
    assert model.max_pairs > before


@pytest.mark.cuda
def test_graph_memory_flat_over_many_replays():
    model = cuda_model(max_pairs=4000)
    calc = mirage.ff.Calculator(model)
    atoms = periodic_atoms(n=12)
    calc.calculate(atoms, ["forces"])
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    for _ in range(200):
        atoms.positions += 0.001
        calc.calculate(atoms, ["forces"])
    torch.cuda.synchronize()
    # No growth over 200 replays (the H200 run saw 6.6 kB less: a buffer of the first call freed).
    assert torch.cuda.memory_allocated() <= allocated
    assert calc.graph_stats().misses == 1


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16-mixed"])
def test_graph_precision_force_error(precision):
    # Prints the force error of each precision against float64 (the numbers docs/ff.md quotes).
    # PaiNN: the reference SchNet cannot run under autocast (see test_model_failing_under_autocast).
    torch.manual_seed(0)
    model64 = PaiNN(hidden=128, num_interactions=3, cutoff=5.0).double().eval()
    atoms = benzene_atoms()
    _, reference = direct(model64, atoms)
    model = PaiNN(hidden=128, num_interactions=3, cutoff=5.0).eval()
    model.load_state_dict({k: v.float() for k, v in model64.state_dict().items()})
    calc = mirage.ff.Calculator(model.cuda(), precision=precision, cuda_graph=False)
    before = _matmul_state()
    calc.calculate(atoms, ["forces"])
    assert _matmul_state() == before
    error = np.abs(calc.results["forces"] - reference).max() / np.abs(reference).max()
    print(f"precision {precision}: max force error / max force = {error:.2e}")
    # About 5x what an H200 gave with this seed (docs/ff.md: 1.05e-6, 6.0e-4, 5.9e-3), and for
    # the reduced precisions at least a tenth of it: float32 throughout would pass the upper bound.
    assert error < {"fp32": 5e-6, "tf32": 3e-3, "bf16-mixed": 3e-2}[precision]
    assert error > {"fp32": 0.0, "tf32": 6e-5, "bf16-mixed": 6e-4}[precision]


@pytest.mark.cuda
def test_uncapturable_model_names_the_remedies():
    # In its own process: a failed capture leaves the CUDA generator unusable for the process.
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {EXAMPLES!r})
        import ase, torch, mirage.ff
        from forcefield.benzene import benzene
        from forcefield.models import SchNet
        z, pos = benzene()
        atoms = ase.Atoms(numbers=z.numpy(), positions=pos.numpy())
        atoms.calc = mirage.ff.Calculator(SchNet(hidden=16).cuda())
        try:
            atoms.get_forces()
        except RuntimeError as error:
            print(error)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert "mirage.ff.Calculator: the model cannot be captured in a CUDA graph" in out, out + result.stderr
    assert "mirage.ff.optimize" in out and "cuda_graph=False" in out


@pytest.mark.cuda
@pytest.mark.parametrize("periodic", [False, True])
def test_fused_model_graph_matches_reference(periodic):
    torch.manual_seed(0)
    model = SchNet(hidden=64, num_interactions=3, cutoff=4.0).cuda().eval()
    fast = mirage.ff.optimize(model)
    assert fast is not model
    graphed = mirage.ff.Calculator(fast)
    reference = mirage.ff.Calculator(model, cuda_graph=False)
    assert graphed.cuda_graph
    for n in (12, 12, 12, 9):  # new positions each call, then a new atom count (a second graph)
        atoms = periodic_atoms(n=n) if periodic else benzene_atoms()[:n]
        atoms.positions += numpy_rng().normal(scale=0.05, size=atoms.positions.shape)
        graphed.calculate(atoms, ["forces"])
        reference.calculate(atoms, ["forces"])
        scale = np.abs(reference.results["forces"]).max()
        assert graphed.results["energy"] == pytest.approx(reference.results["energy"], rel=1e-4, abs=1e-4)
        np.testing.assert_allclose(graphed.results["forces"], reference.results["forces"], atol=1e-3 * scale, rtol=0)
        if periodic:
            np.testing.assert_allclose(graphed.results["stress"], reference.results["stress"],
                                       atol=1e-3 * np.abs(reference.results["stress"]).max(), rtol=0)
    assert graphed.graph_stats().misses == 2


@pytest.mark.cuda
@pytest.mark.parametrize("cls, ops", [(SchNet, ("mirage.schnet_energy_all_pairs", "mirage.schnet_energy")),
                                      (PaiNN, ("mirage.painn_energy",) * 2)])
@pytest.mark.parametrize("periodic", [False, True])
def test_whole_model_energy_and_gradient_without_autograd(cls, ops, periodic):
    # A fused model that runs as one op gives its energy and gradient without autograd (its op forms
    # the gradient in the pair vectors with the energy, and scatters it onto the atoms): what
    # forward and torch.autograd.grad give, without autograd's fill of the energy's gradient and
    # product with it, nor a pair_vectors_backward. evaluate (the Calculator's and mirage.ff.md's
    # force call) takes that path.
    torch.manual_seed(0)
    op = ops[periodic]  # SchNet on a molecule: the op that searches every pair itself
    fast = mirage.ff.optimize(cls(cutoff=4.0).cuda().eval())
    numbers, positions, cell, pbc = structure(periodic_atoms(n=12) if periodic else benzene_atoms())
    with OpCounter() as counter:
        direct = fast.energy_and_gradient(numbers, positions, cell, pbc)  # chooses the capacity, as forward does
    assert direct is not None and fast.max_pairs is not None
    assert op in counter.calls and "mirage.pair_vectors_backward" not in counter.calls
    leaf = positions.clone().requires_grad_(True)
    energy = fast(numbers, leaf, cell, pbc)
    (grad,) = torch.autograd.grad(energy, leaf)
    assert "aten.mul" not in counter.calls and not ZERO_FILLS & set(counter.calls), counter.calls
    torch.testing.assert_close(direct[0], energy.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(direct[1], grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item())
    with OpCounter() as counter:
        got_energy, forces, _ = mirage.ff.calculator.evaluate(fast, numbers, positions, cell, pbc)
    assert "aten.mul" not in counter.calls and op in counter.calls
    torch.testing.assert_close(forces, -grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item())
    # Where calling the model runs more than its forward: a forward hook, a subclass's forward.
    handle = fast.register_forward_hook(lambda module, args, out: out + 1.0)
    assert fast.energy_and_gradient(numbers, positions, cell, pbc) is None
    # The hook's +1: to float32 rounding of the energy itself (its GPU sums vary in the last bits
    # from call to call; relative to energy + 1, after cancellation, that was once 1.5e-6).
    assert mirage.ff.calculator.evaluate(fast, numbers, positions, cell, pbc)[0].item() == pytest.approx(
        energy.item() + 1.0, rel=0, abs=1e-6 * abs(energy.item()))
    handle.remove()

    class Shifted(type(fast)):
        def forward(self, *args):
            return super().forward(*args) + 1.0

    fast.__class__ = Shifted
    assert fast.energy_and_gradient(numbers, positions, cell, pbc) is None
    fast.__class__ = Shifted.__mro__[1]
    plain_forward = fast.forward
    fast.forward = lambda *args: plain_forward(*args) + 1.0  # a forward set on the instance
    assert fast.energy_and_gradient(numbers, positions, cell, pbc) is None
    del fast.forward
    # Where the op does not run: training mode, a capacity over its limit.
    fast.train()
    assert fast.energy_and_gradient(numbers, positions, cell, pbc) is None
    fast.eval()
    fast.max_pairs = fast.whole_model_max_pairs + 1
    assert fast.energy_and_gradient(numbers, positions, cell, pbc) is None


def test_energy_and_gradient_is_none_on_the_cpu():
    fast = mirage.ff.optimize(small(SchNet, torch.float32))
    assert fast.energy_and_gradient(*structure(benzene_atoms(), "cpu")) is None


def test_works_under_inference_mode():
    # Forces need autograd: a caller's torch.inference_mode must not turn them off (it did: "the
    # model's energy does not depend on positions").
    model = small(SchNet)
    atoms = benzene_atoms()
    want = direct(model, atoms)
    calc = mirage.ff.Calculator(model)
    with torch.inference_mode():
        atoms.calc = calc
        forces = atoms.get_forces()
    np.testing.assert_allclose(forces, want[1], rtol=1e-10, atol=1e-12)


def test_reset_drops_the_graphs():
    # The graphs hold the model as captured: reset() (after changing the model) must drop them.
    calc = graphed_capacity_calculator()
    atoms = periodic_atoms(n=9)
    calc.calculate(atoms, ["forces"])
    assert calc.graph_stats().entries == 1 and len(calc._buffers) == 1
    calc.reset()
    assert calc.results == {} and calc.graph_stats().entries == 0 and len(calc._buffers) == 0
    calc.calculate(atoms, ["forces"])
    assert calc.graph_stats().misses == 2
