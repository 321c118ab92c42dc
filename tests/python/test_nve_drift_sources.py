"""scripts/nve_drift_sources.py: the float64 reference integrates as ASE's VelocityVerlet does,
and a mirage run's path judged by the float64 model (CPU, short runs); on a GPU, the
reference's CUDA graph against the CPU."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ase = pytest.importorskip("ase")
from ase import units  # noqa: E402
from ase.md.verlet import VelocityVerlet  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import nve_drift_sources  # noqa: E402
from forcefield import train_student  # noqa: E402

import mirage.ff  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("model_name", sorted(train_student.MODELS))
def test_reference_matches_ase_velocity_verlet_per_seed(model_name):
    steps, every, timestep_fs = 12, 4, 0.5
    t, kinetic, potential = nve_drift_sources.reference_series(model_name, 2, timestep_fs, steps, every,
                                                               torch.device("cpu"))
    assert t.shape == (4,) and kinetic.shape == potential.shape == (4, 2)
    model = nve_drift_sources.float64_copy(nve_drift_sources.load_student(model_name), torch.device("cpu"))
    for seed in range(2):
        atoms, _ = nve_drift_sources.validate_nve.initial_atoms(nve_drift_sources.TEMPERATURE_K, seed)
        atoms.calc = mirage.ff.Calculator(model, device="cpu")
        dyn = VelocityVerlet(atoms, timestep=timestep_fs * units.fs)
        ase_records = []
        dyn.attach(lambda: ase_records.append((atoms.get_kinetic_energy(), atoms.get_potential_energy())),
                   interval=every)
        dyn.run(steps)
        np.testing.assert_allclose(np.array(ase_records), np.stack([kinetic[:, seed], potential[:, seed]], 1),
                                   rtol=1e-9, atol=1e-12)
    assert abs(kinetic[-1] - kinetic[0]).max() > 1e-3  # the molecules moved


def test_path_of_a_mirage_run_judged_by_the_float64_model():
    result = nve_drift_sources.main(["path", "--model", "schnet", "--time-ps", "0.02", "--every", "4",
                                     "--device", "cpu"])
    assert result["records"] == 11
    # A float32 model on float64 states: its energies and forces are the float64 model's to
    # float32 rounding, so the two energies' drifts agree; the work of the force errors is tiny.
    assert result["force_error_rel_rms"] < 1e-4
    assert result["energy_error_rms_eV"] < 1e-5
    assert abs(result["drift_run_pct"] - result["drift_float64_energy_pct"]) < 0.01
    assert abs(result["force_error_work_pct"]) < 0.01


class Scaled(torch.nn.Module):
    """A model whose energy (and so forces) is ``factor`` times another's."""

    def __init__(self, model, factor):
        super().__init__()
        self.model, self.factor = model, factor

    def forward(self, atomic_numbers, positions, cell=None, pbc=None):
        return self.factor * self.model(atomic_numbers, positions, cell, pbc)


def test_force_error_work_accounts_for_a_wrong_model():
    # Run with forces 5% too large and judge the path by the true model: the run conserves
    # E_kin + E_run, so the change of E_kin + E64 is the work of the force errors, F_run - F64,
    # which the trapezoid rule over every step must give (up to velocity Verlet's O(dt^2)).
    cpu = torch.device("cpu")
    exact = nve_drift_sources.float64_copy(nve_drift_sources.load_student("schnet"), cpu)
    atoms, _ = nve_drift_sources.validate_nve.initial_atoms(nve_drift_sources.TEMPERATURE_K, 0)
    x, v, f, e = nve_drift_sources.record_path(Scaled(exact, 1.05), atoms, 0.25, 200, 1, cpu)
    e64, f64 = nve_drift_sources.float64_along(exact, atoms.numbers, x, cpu)
    np.testing.assert_allclose(f, 1.05 * f64, rtol=1e-9, atol=1e-12)
    kinetic = 0.5 * (atoms.get_masses()[None, :, None] * v**2).sum((1, 2))
    work = nve_drift_sources.force_error_work(f, f64, v, 0.25 * units.fs)
    exact_change = (kinetic + e64)[-1] - (kinetic + e64)[0]
    run_change = (kinetic + e)[-1] - (kinetic + e)[0]
    assert abs(work) > 20 * abs(run_change)  # the error's work dominates the run's own drift
    assert work == pytest.approx(exact_change - run_change, rel=0.02)


def test_reference_of_another_student_file(tmp_path):
    out = tmp_path / "student.pt"
    model, _ = train_student.train(out, model="painn", hidden=16, num_interactions=1, steps=3, batch=4, n_train=32,
                                   n_test=8, log=lambda _: None)
    cpu = torch.device("cpu")
    _, _, potential = nve_drift_sources.reference_series("painn", 1, 0.5, 4, 2, cpu, weights=out)
    atoms, _ = nve_drift_sources.validate_nve.initial_atoms(nve_drift_sources.TEMPERATURE_K, 0)
    start = nve_drift_sources.float64_copy(model, cpu)(torch.tensor(atoms.numbers), torch.tensor(atoms.positions))
    assert potential[0, 0] == pytest.approx(float(start), rel=1e-9, abs=1e-12)
    with pytest.raises(SystemExit, match="holds a PaiNN, not the --model schnet"):
        nve_drift_sources.load_student("schnet", out)


@pytest.mark.parametrize("argv", [["path", "--every", "0"], ["reference", "--seeds", "0"],
                                  ["path", "--time-ps", "0.001", "--every", "20"]])
def test_bad_arguments(argv):
    with pytest.raises(SystemExit):
        nve_drift_sources.parse_args(argv)


@pytest.mark.cuda
def test_reference_in_a_cuda_graph_matches_the_cpu():
    runs = [nve_drift_sources.reference_series("painn", 2, 0.5, 12, 4, torch.device(device))
            for device in ("cpu", "cuda")]
    (t_cpu, kinetic_cpu, potential_cpu), (t_gpu, kinetic_gpu, potential_gpu) = runs
    np.testing.assert_array_equal(t_cpu, t_gpu)
    np.testing.assert_allclose(kinetic_gpu, kinetic_cpu, rtol=1e-9)
    np.testing.assert_allclose(potential_gpu, potential_cpu, rtol=1e-9, atol=1e-12)
