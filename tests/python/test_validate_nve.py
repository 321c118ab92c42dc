"""The NVE validation of benzene MD (issue 4): the analytic teacher force field, the student's
training pieces, the drift statistics and scripts/validate_nve.py end to end (CPU, short runs)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

from common import numpy_rng  # noqa: E402
from forcefield import train_student  # noqa: E402
from forcefield.benzene import benzene  # noqa: E402
from forcefield.models import PaiNN, SchNet  # noqa: E402
from forcefield.teacher import BenzeneTeacher, energy_and_forces, harmonic_wavenumbers, hessian  # noqa: E402

pytest.importorskip("ase")


def load_script():
    spec = importlib.util.spec_from_file_location("validate_nve", REPO / "scripts" / "validate_nve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


validate_nve = load_script()
STUDENTS = train_student.STUDENT_PATHS
STUDENT = STUDENTS["schnet"]
MODEL_NAMES = sorted(STUDENTS)


def needs_student(name):
    return pytest.mark.skipif(not STUDENTS[name].exists(), reason=f"{STUDENTS[name].name} not trained")


# Each of the two students, skipped where its file is missing.
EACH_STUDENT = pytest.mark.parametrize("name", [pytest.param(n, marks=needs_student(n)) for n in MODEL_NAMES])
KT_300 = train_student.BOLTZMANN_EV_PER_K * 300.0


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def teacher():
    return BenzeneTeacher()


def distorted(teacher, scale=0.05):
    return teacher.equilibrium + scale * torch.randn(12, 3, dtype=torch.float64)


def random_rotation():
    q, r = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    if torch.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


# ------------------------------------------------------------------------------------- teacher
def test_teacher_forces_match_finite_differences(teacher):
    pos = distorted(teacher)
    _, forces = energy_and_forces(teacher, pos)
    h = 1e-6
    reference = torch.zeros_like(pos)
    for a in range(12):
        for k in range(3):
            plus, minus = pos.clone(), pos.clone()
            plus[a, k] += h
            minus[a, k] -= h
            e_plus, e_minus = teacher(teacher.atomic_numbers, plus), teacher(teacher.atomic_numbers, minus)
            reference[a, k] = -(e_plus - e_minus) / (2 * h)
    assert forces.abs().max() > 0.1  # a distortion of 0.05 Å gives forces of order eV/Å
    torch.testing.assert_close(forces, reference, rtol=1e-6, atol=1e-7)


def test_teacher_equilibrium_is_a_minimum(teacher):
    energy, forces = energy_and_forces(teacher, teacher.equilibrium)
    assert abs(float(energy)) < 1e-12 and float(forces.abs().max()) < 1e-10
    eigenvalues = torch.linalg.eigvalsh(hessian(teacher))
    # six rigid-body zero modes, thirty vibrations of positive curvature
    assert eigenvalues[:6].abs().max() < 1e-8
    assert eigenvalues[6] > 0.1
    h = hessian(teacher)
    for _ in range(10):
        direction = torch.randn(12, 3, dtype=torch.float64)
        direction /= direction.norm()
        step = 1e-3
        rise = float(teacher(teacher.atomic_numbers, teacher.equilibrium + step * direction))
        quadratic = 0.5 * step**2 * float(direction.reshape(-1) @ h @ direction.reshape(-1))
        assert rise > 0
        assert rise == pytest.approx(quadratic, rel=1e-2)


def test_teacher_spectrum_is_benzene_like(teacher):
    masses = train_student.masses_of(teacher.atomic_numbers)
    wavenumbers = harmonic_wavenumbers(teacher, masses)
    assert wavenumbers.shape == (30,)
    assert 200 < float(wavenumbers.min()) < 500  # ring torsion (real benzene: 398 cm^-1)
    assert 2900 < float(wavenumbers.max()) < 3300  # C-H stretches (real: ~3060 cm^-1)


def test_teacher_is_invariant_and_terms_are_nonnegative(teacher):
    pos = distorted(teacher, 0.1)
    energy, forces = energy_and_forces(teacher, pos)
    rot = random_rotation()
    moved = pos @ rot.T + torch.tensor([0.7, -1.2, 3.1], dtype=torch.float64)
    e2, f2 = energy_and_forces(teacher, moved)
    torch.testing.assert_close(e2, energy, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f2, forces @ rot.T, rtol=1e-8, atol=1e-10)
    assert float(forces.sum(0).abs().max()) < 1e-10  # no net force on an isolated molecule
    terms = teacher.terms(pos)
    assert all(float(v) >= 0 for v in terms.values())
    assert all(float(v) > 0 for k, v in terms.items() if k != "wall")


def test_teacher_wall_repels_close_atoms(teacher):
    assert float(teacher.terms(teacher.equilibrium)["wall"]) == 0.0
    pos = teacher.equilibrium.clone()
    pos[6] += 0.35 * (pos[7] - pos[6])  # push hydrogen 6 towards hydrogen 7 (1-4 pair, 2.48 Å apart)
    assert float(teacher.terms(pos)["wall"]) > 0


def test_teacher_batches(teacher):
    pos = torch.stack([distorted(teacher) for _ in range(4)])
    batched, forces = energy_and_forces(teacher, pos)
    assert batched.shape == (4,) and forces.shape == (4, 12, 3)
    for b in range(4):
        torch.testing.assert_close(batched[b], teacher(teacher.atomic_numbers, pos[b]), rtol=1e-12, atol=1e-12)


def test_teacher_refuses_other_inputs(teacher):
    z, pos = benzene()
    with pytest.raises(ValueError, match="BenzeneTeacher: expects benzene"):
        teacher(z[:6], pos[:6])
    with pytest.raises(ValueError, match="BenzeneTeacher: expects benzene"):
        teacher(torch.flip(z, [0]), pos)
    with pytest.raises(ValueError, match="BenzeneTeacher: an isolated molecule"):
        teacher(z, pos, torch.eye(3) * 10, torch.tensor([True] * 3))


# ------------------------------------------------------------------------------------- student
def test_samples_follow_equipartition(teacher):
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    pos, temps = train_student.sample_configurations(teacher, 2000, gen, t_min=300.0, t_max=300.0)
    assert pos.shape == (2000, 12, 3) and torch.all(temps == 300.0)
    energy, _ = energy_and_forces(teacher, pos)
    # harmonic: <E_pot> = (30/2) kT; the anharmonic terms raise it by about 3% at 300 K
    assert 1.0 < float(energy.mean()) / (15 * KT_300) < 1.07


@pytest.mark.parametrize("cls", [SchNet, PaiNN])
def test_batched_energy_matches_the_model_forward(teacher, cls):
    model = cls(hidden=16, num_interactions=2).double()
    pos = torch.stack([distorted(teacher, 0.08) for _ in range(3)])
    # stretch one conformation so that the para H-H pair (4.96 Å) crosses the 5 Å cutoff
    pos[1, 6] = 1.03 * teacher.equilibrium[6]
    pos[1, 9] = 1.03 * teacher.equilibrium[9]
    assert float((pos[1, 6] - pos[1, 9]).norm()) > 5.0
    batched = train_student.batched_energy(model, teacher.atomic_numbers, pos)
    single = torch.stack([model(teacher.atomic_numbers, p) for p in pos])
    torch.testing.assert_close(batched, single, rtol=1e-10, atol=1e-10)
    train_student.check_batched_energy(model, teacher.atomic_numbers, pos)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_train_writes_a_loadable_student(tmp_path, name):
    out = tmp_path / "student.pt"
    settings = {"norm_eps": 0.01} if name == "painn" else {}  # PaiNN's own setting travels in the file
    model, metadata = train_student.train(out, model=name, hidden=16, num_interactions=1, steps=3, batch=4,
                                          n_train=32, n_test=8, log=lambda _: None, **settings)
    loaded, saved = train_student.load_student(out)
    assert type(loaded) is train_student.MODELS[name]
    assert saved["config"] == {"hidden": 16, "num_interactions": 1, "num_rbf": 20, "cutoff": 5.0, **settings}
    if name == "painn":
        assert loaded.updates[0].norm_eps == 0.01
        # a file from before norm_eps was stored (format v1) loads with the model's default
        saved_file = torch.load(out, weights_only=True)
        assert saved_file["format"] == "mirage-benzene-student-v2"
        del saved_file["config"]["norm_eps"]
        saved_file["format"] = "mirage-benzene-student-v1"
        torch.save(saved_file, out)
        assert train_student.load_student(out)[0].updates[0].norm_eps == 1e-8
        with pytest.raises(SystemExit):
            train_student.main(["--model", "painn", "--norm-eps", "0", "--out", str(tmp_path / "x.pt")])
    else:
        with pytest.raises(ValueError, match="norm_eps is a PaiNN setting"):
            train_student.train(None, model=name, norm_eps=0.01)
        with pytest.raises(SystemExit):
            train_student.main(["--model", name, "--norm-eps", "0.01", "--out", str(tmp_path / "x.pt")])
    assert not (tmp_path / "x.pt").exists()
    assert saved["held_out"] == metadata["held_out"]
    assert set(saved["held_out"]) == {"energy_mae_eV", "force_rmse_eV_per_A", "force_mae_eV_per_A",
                                      "force_rmse_relative"}
    z, pos = benzene(torch.float32)
    pos = pos + 0.03 * torch.randn_like(pos)
    torch.testing.assert_close(loaded(z, pos), model(z, pos), rtol=0, atol=0)
    torch.save({"not": "a student"}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="load_student: .* is not a student file"):
        train_student.load_student(tmp_path / "other.pt")
    newer = torch.load(out, weights_only=True)
    newer["format"] = "mirage-benzene-student-v3"
    torch.save(newer, tmp_path / "newer.pt")
    with pytest.raises(ValueError, match="the file's: 'mirage-benzene-student-v3'"):
        train_student.load_student(tmp_path / "newer.pt")


@EACH_STUDENT
def test_stored_student_is_small_and_accurate(teacher, name):
    # SchNet's student is 0.9 MB, PaiNN's (about 2.6 times the parameters) 2.4 MB
    assert STUDENTS[name].stat().st_size < {"schnet": 2_000_000, "painn": 2_500_000}[name]
    model, metadata = train_student.load_student(STUDENTS[name])
    assert type(model) is train_student.MODELS[name]
    # PaiNN's student stores norm_eps, which v1 readers cannot take: its file must say v2
    if "norm_eps" in metadata["config"]:
        assert torch.load(STUDENTS[name], weights_only=True)["format"] == train_student.FORMAT
    stored = metadata["held_out"]
    # fresh configurations at 300 K, where the validation runs (the stored error is over 50-800 K)
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    pos, _ = train_student.sample_configurations(teacher, 100, gen, t_min=300.0, t_max=300.0)
    energies, forces = energy_and_forces(teacher, pos)
    errors = train_student.force_errors(model, teacher.atomic_numbers, pos.float(), energies, forces)
    assert errors["force_rmse_relative"] < 1.5 * stored["force_rmse_relative"] + 0.02
    assert errors["force_rmse_relative"] < 0.15


# ---------------------------------------------------------------------------------- statistics
def test_drift_statistics_recovers_a_known_slope():
    t = np.linspace(0.0, 100.0, 20001)  # ps
    slope, kinetic = 2e-6, 0.2  # eV/ps, eV
    period = 0.25  # 400 whole periods of a cosine: the oscillation adds nothing to the fitted slope
    amplitude = 3e-4
    total = 0.4 + slope * t + amplitude * np.cos(2 * np.pi * t / period)
    stats = validate_nve.drift_statistics(t, total, np.full_like(t, kinetic))
    assert stats["duration_ps"] == pytest.approx(100.0)
    assert stats["drift_rate_eV_per_ps"] == pytest.approx(slope, rel=1e-3)
    assert stats["drift_eV"] == pytest.approx(slope * 100.0, rel=1e-3)
    assert stats["drift_relative_kinetic"] == pytest.approx(slope * 100.0 / kinetic, rel=1e-3)
    assert stats["drift_relative_total"] == pytest.approx(slope * 100.0 / (0.4 + slope * 50.0), rel=1e-3)
    assert stats["fluctuation_rms_eV"] == pytest.approx(amplitude / math.sqrt(2), rel=1e-3)
    assert slope * 100.0 <= stats["max_deviation_eV"] <= slope * 100.0 + 2 * amplitude
    # a negative drift counts the same, relative to a negative total energy too
    stats = validate_nve.drift_statistics(t, -5.0 - slope * t, np.full_like(t, kinetic))
    assert stats["drift_eV"] == pytest.approx(-slope * 100.0, rel=1e-6)
    assert stats["drift_relative_kinetic"] == pytest.approx(slope * 100.0 / kinetic, rel=1e-6)
    assert stats["drift_relative_total"] == pytest.approx(slope * 100.0 / (5.0 + slope * 50.0), rel=1e-6)
    assert stats["fluctuation_rms_eV"] < 1e-9


def test_drift_statistics_leave_out_the_start_and_give_the_slopes_error():
    # Velocity Verlet from the equilibrium geometry: the first sample sits below all the others
    # (the bottom of the energy's oscillation); on a short run it tilted the fitted slope upward.
    rng = np.random.default_rng(0)
    t = np.linspace(0.0, 0.5, 51)
    noise = 1e-5 * rng.standard_normal(t.shape)
    total = 1.0 + noise
    total[0] -= 5e-4
    stats = validate_nve.drift_statistics(t, total, np.full_like(t, 0.2))
    fitted = np.polyfit(t[1:], noise[1:], 1)[0]
    assert stats["drift_rate_eV_per_ps"] == pytest.approx(fitted, rel=1e-9)
    assert abs(stats["drift_rate_eV_per_ps"]) < 1e-4  # with the start in the fit: about 3e-3
    # the slope's standard error: sigma / sqrt(sum (t - <t>)^2), relative to <E_kin> over the run
    spread = np.sum((t[1:] - t[1:].mean()) ** 2)
    assert stats["drift_standard_error_relative_kinetic"] == pytest.approx(1e-5 / math.sqrt(spread) * 0.5 / 0.2,
                                                                           rel=0.3)


def test_drift_statistics_error_covers_correlated_wander():
    # The total energy wandering on a picosecond scale (correlated residuals): the residuals'
    # least-squares error of the slope is several times too small; the block means' covers it.
    rng = numpy_rng()
    t = np.linspace(0.0, 100.0, 20001)
    step = t[1] - t[0]
    correlation_ps, sigma = 0.5, 1e-4
    keep = math.exp(-step / correlation_ps)
    kicks = sigma * math.sqrt(1 - keep**2) * rng.standard_normal(t.shape)
    wander = np.empty_like(t)
    wander[0] = sigma * rng.standard_normal()
    for i in range(1, len(t)):
        wander[i] = keep * wander[i - 1] + kicks[i]
    kinetic = 0.2
    # Evenly sampled, and with no samples from 40 to 60 ps (the blocks hold equal sample counts).
    for kept in (np.ones_like(t, dtype=bool), (t < 40.0) | (t > 60.0)):
        stats = validate_nve.drift_statistics(t[kept], 0.4 + wander[kept], np.full(kept.sum(), kinetic))
        residual_only = validate_nve._line(t[kept][1:], wander[kept][1:])[3] * 100.0 / kinetic
        assert stats["drift_standard_error_from_blocks"]
        assert stats["drift_standard_error_relative_kinetic"] > 3 * residual_only  # about 14x (200 seeds: 4.7x at least)
        assert stats["drift_relative_kinetic"] < 5 * stats["drift_standard_error_relative_kinetic"]  # no trend


def test_drift_statistics_of_short_series_use_fewer_blocks_or_none():
    t = np.linspace(0.0, 1.0, 11)
    total = 0.4 + 1e-4 * np.cos(7.0 * t)
    assert validate_nve.drift_statistics(t, total, np.full_like(t, 0.2))["drift_standard_error_from_blocks"]  # 5 blocks
    stats = validate_nve.drift_statistics(t[:6], total[:6], np.full(6, 0.2))  # 5 fitted samples: 2 blocks
    assert not stats["drift_standard_error_from_blocks"]
    assert stats["drift_standard_error_relative_kinetic"] > 0


def test_drift_statistics_of_noise_is_small():
    rng = numpy_rng()
    t = np.linspace(0.0, 10.0, 5000)
    total = 1.0 + 1e-4 * rng.standard_normal(t.shape)
    stats = validate_nve.drift_statistics(t, total, np.full_like(t, 0.2))
    # the slope's standard error is sigma / sqrt(sum (t - <t>)^2) = 1e-4 / (10 * sqrt(5000 / 12))
    assert abs(stats["drift_eV"]) < 5 * 1e-4 / math.sqrt(5000 / 12)
    assert stats["fluctuation_rms_eV"] == pytest.approx(1e-4, rel=0.1)


@pytest.mark.parametrize("args, match", [
    (([0.0, 1.0, 2.0], [1.0] * 3, [1.0] * 3), "at least 4 samples"),
    (([0.0, 1.0, 1.0, 1.0], [1.0] * 4, [1.0] * 4), "positive time span"),
    (([0.0, 1.0, 2.0, 3.0], [1.0] * 3, [1.0] * 4), "one length"),
    (([0.0, 1.0, 2.0, 3.0], [1.0, float("nan"), 1.0, 1.0], [1.0] * 4), "non-finite"),
    (([0.0, 1.0, 2.0, 3.0], [1.0] * 4, [0.0] * 4), "kinetic energy must be positive"),
])
def test_drift_statistics_bad_input(args, match):
    with pytest.raises(ValueError, match=f"drift_statistics: .*{match}"):
        validate_nve.drift_statistics(*args)


def test_initial_atoms():
    atoms, dof = validate_nve.initial_atoms(300.0, seed=3)
    assert dof == 30 and len(atoms) == 12
    assert np.abs(atoms.get_momenta().sum(0)).max() < 1e-12
    assert np.abs(atoms.get_angular_momentum()).max() < 1e-10
    temperature = validate_nve.temperature_K(atoms.get_kinetic_energy(), dof)
    assert float(temperature) == pytest.approx(300.0, rel=1e-12)
    again, _ = validate_nve.initial_atoms(300.0, seed=3)
    other, _ = validate_nve.initial_atoms(300.0, seed=4)
    np.testing.assert_array_equal(again.get_momenta(), atoms.get_momenta())
    assert not np.allclose(other.get_momenta(), atoms.get_momenta())
    np.testing.assert_allclose(atoms.positions, benzene()[1].numpy())


# ---------------------------------------------------------------------------------- the script
def read_outputs(out):
    summary = json.loads((out / "nve_summary.json").read_text())
    series = np.loadtxt(out / "nve_series.csv", delimiter=",", skiprows=1)
    return summary, series


def check_plot(out, summary):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert summary["files"]["plot"] is None
        return
    assert summary["files"]["plot"] == "nve_energy.png"
    assert (out / "nve_energy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@EACH_STUDENT
def test_script_short_run(tmp_path, name):
    out = tmp_path / "nve"
    code = validate_nve.main(["--model", name, "--time-ps", "0.2", "--device", "cpu", "--no-optimize",
                              "--record-every", "5", "--out", str(out)])
    summary, series = read_outputs(out)
    assert summary["model"]["name"] == train_student.MODELS[name].__name__
    assert summary["model"]["weights"] == str(STUDENTS[name])
    r = summary["results"]
    assert summary["criterion"]["aborted"] is None
    assert code == (0 if summary["criterion"]["passed"] else 1)
    assert summary["criterion"]["passed"] == (r["drift_relative_kinetic"] < 1e-3)
    assert summary["md"]["steps"] == 400 and series.shape == (81, 6)
    assert series[0, 0] == 0 and series[-1, 0] == 400 and series[-1, 1] == pytest.approx(0.2)
    # the statistics are those of the series written
    stats = validate_nve.drift_statistics(series[:, 1], series[:, 4], series[:, 3])
    assert r["drift_eV"] == pytest.approx(stats["drift_eV"], rel=1e-6, abs=1e-9)
    np.testing.assert_allclose(series[:, 4], series[:, 2] + series[:, 3], rtol=1e-9)
    # a bound molecule whose total energy holds: over 0.2 ps the estimate is dominated by the
    # integrator's bounded oscillation, so the bound is the original project's 1%, not 0.1%
    assert r["drift_relative_kinetic"] < 1e-2 and r["fluctuation_relative_kinetic"] < 1e-2
    assert series[0, 5] == pytest.approx(300.0, rel=1e-6)  # the start: all energy kinetic, at 300 K
    assert 80.0 < r["mean_temperature_K"] < 250.0  # about half goes into the potential energy
    assert np.ptp(series[:, 2]) > 0.05  # the molecule vibrates
    assert r["max_bond_strain"] < 0.1 and r["steps_per_s"] > 0
    assert summary["model"]["metadata"]["held_out"]["force_rmse_eV_per_A"] > 0
    check_plot(out, summary)


def test_script_trains_a_missing_student_and_fails_a_strict_criterion(tmp_path, capfd, monkeypatch):
    _as_if_exactly_measured(monkeypatch)
    out, weights = tmp_path / "nve", tmp_path / "student.pt"
    code = validate_nve.main(["--time-ps", "0.02", "--device", "cpu", "--no-optimize", "--record-every", "2",
                              "--weights", str(weights), "--train", "--train-steps", "2", "--max-drift", "1e-15",
                              "--out", str(out)])
    assert weights.exists()
    summary, series = read_outputs(out)
    assert code == 1 and not summary["criterion"]["passed"] and summary["criterion"]["aborted"] is None
    assert summary["results"]["drift_relative_kinetic"] >= 1e-15
    assert f"nve_drift_sources.py reference --model schnet --weights {weights}" in capfd.readouterr().err
    assert series.shape == (21, 6)
    check_plot(out, summary)


def _measured_as(monkeypatch, **results):
    """The run's drift statistics with ``results`` in place of the measured ones."""
    measured = validate_nve.drift_statistics
    monkeypatch.setattr(validate_nve, "drift_statistics", lambda *args: {**measured(*args), **results})


def _as_if_exactly_measured(monkeypatch):
    """The drift's standard error taken as 0: a strict threshold then fails rather than getting no
    verdict (a short run's drift lies within two errors of any small threshold), so that the
    failure's path can be tested."""
    _measured_as(monkeypatch, drift_standard_error_relative_kinetic=0.0)


@needs_student("schnet")
def test_a_failing_committed_student_points_to_the_drift_sources(tmp_path, capfd, monkeypatch):
    _as_if_exactly_measured(monkeypatch)
    code = validate_nve.main(["--time-ps", "0.01", "--device", "cpu", "--no-optimize", "--record-every", "2",
                              "--max-drift", "1e-15", "--seed", "3", "--out", str(tmp_path / "nve")])
    assert code == 1
    err = capfd.readouterr().err
    assert "nve_drift_sources.py reference --model schnet --weights " in err and "--timestep-fs 0.5" in err
    assert "path --seed 3" in err


@needs_student("schnet")
def test_script_aborts_when_the_molecule_breaks(tmp_path):
    # 10 fs steps: beyond velocity Verlet's stability limit for the C-H stretch (period ~11 fs)
    out = tmp_path / "nve"
    code = validate_nve.main(["--time-ps", "1", "--timestep-fs", "10", "--device", "cpu", "--no-optimize",
                              "--record-every", "1", "--out", str(out)])
    summary, series = read_outputs(out)
    assert code == 1 and not summary["criterion"]["passed"]
    assert "the molecule broke" in summary["criterion"]["aborted"]
    assert series.shape[0] < 100


@pytest.mark.parametrize("argv, match", [
    (["--time-ps", "0"], "--time-ps must be positive"),
    (["--record-every", "0"], "--record-every must be at least 1"),
    (["--precision", "fp8"], "invalid choice"),
])
def test_script_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit):
        validate_nve.main(argv)
    assert match in capsys.readouterr().err


@needs_student("schnet")
def test_script_refuses_a_student_of_another_model(tmp_path):
    with pytest.raises(SystemExit, match="holds a SchNet, not the --model painn"):
        validate_nve.main(["--model", "painn", "--weights", str(STUDENT), "--time-ps", "0.01", "--device", "cpu",
                           "--record-every", "2", "--out", str(tmp_path)])


@pytest.mark.parametrize("argv, match", [(["--steps", "0"], "--steps must be at least 1 (got 0)"),
                                         (["--steps", "-5"], "--steps must be at least 1"),
                                         (["--batch", "0"], "--batch must be at least 1"),
                                         (["--lr", "0"], "--lr must be positive")])
def test_training_refuses_bad_options(argv, match, tmp_path, capsys):
    # --steps 0 had died in the schedule's division; -5 wrote an untrained student.
    with pytest.raises(SystemExit):
        train_student.main(argv + ["--out", str(tmp_path / "x.pt")])
    assert match in capsys.readouterr().err and not (tmp_path / "x.pt").exists()


@needs_student("schnet")
@pytest.mark.parametrize("drift, error, verdict", [(0.05, 0.0006, "fail"),  # far past it: a failure
                                                   (0.0009, 0.00045, "inconclusive"),  # below, within 2 errors
                                                   (0.0002, 0.0001, "pass"), (0.0011, 0.00004, "fail")])
def test_the_verdict_weighs_the_drift_against_its_error(drift, error, verdict, monkeypatch, tmp_path):
    _measured_as(monkeypatch, drift_relative_kinetic=drift, drift_standard_error_relative_kinetic=error)
    code = validate_nve.main(["--time-ps", "0.01", "--device", "cpu", "--no-optimize", "--record-every", "2",
                              "--out", str(tmp_path)])
    criterion = read_outputs(tmp_path)[0]["criterion"]
    assert (code == 0) == (verdict == "pass") and criterion["passed"] == (verdict == "pass")
    assert criterion["inconclusive"] == (verdict == "inconclusive")


def test_script_refuses_a_missing_student_without_train(tmp_path):
    with pytest.raises(SystemExit, match=r"--weights .*typo\.pt does not exist; pass --train"):
        validate_nve.main(["--weights", str(tmp_path / "typo.pt"), "--time-ps", "0.01", "--device", "cpu",
                           "--record-every", "2", "--out", str(tmp_path)])
    assert not (tmp_path / "typo.pt").exists()


@needs_student("schnet")
def test_script_gives_no_verdict_on_a_run_too_short_to_judge(tmp_path, capfd):
    # 0.02 ps (seed 5): a drift of about 0.03% of <E_kin> with a standard error of about 0.17%
    code = validate_nve.main(["--time-ps", "0.02", "--device", "cpu", "--no-optimize", "--record-every", "2",
                              "--seed", "5", "--out", str(tmp_path / "nve")])
    summary, _ = read_outputs(tmp_path / "nve")
    results = summary["results"]
    assert abs(results["drift_relative_kinetic"] - 1e-3) < 2 * results["drift_standard_error_relative_kinetic"]
    assert code == 1 and summary["criterion"]["inconclusive"] and not summary["criterion"]["passed"]
    assert "INCONCLUSIVE" in capfd.readouterr().err


def test_script_refuses_too_short_a_run(tmp_path):
    with pytest.raises(SystemExit, match="too few to record"):
        validate_nve.main(["--time-ps", "0.001", "--device", "cpu", "--out", str(tmp_path)])


@needs_student("schnet")
def test_script_backends_agree(tmp_path):
    """ASE's VelocityVerlet with the calculator and mirage.ff.md integrate the same trajectory."""
    pytest.importorskip("mirage.ff.md")
    common = ["--time-ps", "0.05", "--device", "cpu", "--no-optimize", "--record-every", "10"]
    assert validate_nve.main(common + ["--out", str(tmp_path / "ase")]) in (0, 1)
    assert validate_nve.main(common + ["--backend", "mirage-md", "--steps-per-replay", "5",
                                       "--out", str(tmp_path / "md")]) in (0, 1)
    (s_ase, ase_series), (s_md, md_series) = read_outputs(tmp_path / "ase"), read_outputs(tmp_path / "md")
    assert s_md["backend"] == "mirage-md" and s_md["md"]["steps_per_replay"] == 5
    assert ase_series.shape == md_series.shape == (11, 6)
    np.testing.assert_array_equal(ase_series[:, 0], md_series[:, 0])
    # float32 forces either way; ASE keeps float64 positions, mirage.ff.md the model's dtype
    np.testing.assert_allclose(md_series[:, 2:5], ase_series[:, 2:5], atol=2e-4)
    assert np.ptp(ase_series[:, 2]) > 1e-2  # the potential energy moved: the comparison means something


@EACH_STUDENT
def test_script_with_mirage_optimize(tmp_path, name):
    """The full stack on the CPU: mirage.ff.optimize's fused model under mirage.ff.Calculator."""
    pytest.importorskip("mirage.ff.optimize")
    out = tmp_path / "nve"
    code = validate_nve.main(["--model", name, "--time-ps", "0.01", "--device", "cpu", "--record-every", "2",
                              "--out", str(out)])
    summary, series = read_outputs(out)
    assert summary["optimized"] is True, summary["optimize_report"]
    assert "message_passing" in summary["optimize_report"]
    assert code in (0, 1) and summary["criterion"]["aborted"] is None
    assert series.shape == (11, 6) and np.isfinite(series).all()
    # the fused model gives the plain model's energies along the same trajectory
    model, _ = train_student.load_student(STUDENTS[name])
    z = benzene()[0]
    _, positions = benzene(torch.float32)
    with torch.no_grad():
        assert float(model(z, positions)) == pytest.approx(series[0, 2], abs=1e-4)


@pytest.mark.cuda
@EACH_STUDENT
@pytest.mark.parametrize("backend", ["ase", "mirage-md"])
def test_script_on_cuda_matches_the_cpu(tmp_path, backend, name):
    """The GPU run (fused model, CUDA graphs; for both students on benzene the whole-model op)
    follows the CPU run of the plain model."""
    common = ["--model", name, "--time-ps", "0.05", "--record-every", "10"]
    assert validate_nve.main(common + ["--device", "cpu", "--no-optimize", "--out", str(tmp_path / "cpu")]) in (0, 1)
    extra = ["--steps-per-replay", "5"] if backend == "mirage-md" else []
    code = validate_nve.main(common + ["--device", "cuda", "--backend", backend, *extra,
                                       "--out", str(tmp_path / "gpu")])
    (_, cpu_series), (summary, gpu_series) = read_outputs(tmp_path / "cpu"), read_outputs(tmp_path / "gpu")
    assert code in (0, 1) and summary["criterion"]["aborted"] is None
    assert summary["optimized"] is True and summary["cuda_graph"] is True, summary["optimize_report"]
    assert summary["device"] != "cpu" and summary["results"]["steps_per_s"] > 0
    assert gpu_series.shape == cpu_series.shape == (11, 6)
    np.testing.assert_allclose(gpu_series[:, 2:5], cpu_series[:, 2:5], atol=5e-4)
    check_plot(tmp_path / "gpu", summary)


def test_pooled_statistics_mean_and_standard_error():
    drifts = [0.0004, -0.0002, 0.0001, -0.0007]
    pooled = validate_nve.pooled_statistics(drifts, [1e-5] * 4)
    mean = sum(drifts) / 4
    spread = math.sqrt(sum((d - mean) ** 2 for d in drifts) / 3)
    assert pooled["runs"] == 4 and pooled["mean_drift_relative_kinetic"] == pytest.approx(mean)
    assert pooled["spread_relative_kinetic"] == pytest.approx(spread)
    assert pooled["standard_error_relative_kinetic"] == pytest.approx(spread / 2)


def test_pooled_error_is_no_smaller_than_the_runs_own():
    # three runs that happen to agree closely, each with a large error of its own
    pooled = validate_nve.pooled_statistics([9e-4, 9.1e-4, 9.05e-4], [5e-4, 4e-4, 3e-4])
    assert pooled["standard_error_relative_kinetic"] == pytest.approx(math.sqrt(25e-8 + 16e-8 + 9e-8) / 3)
    assert validate_nve.verdict(abs(pooled["mean_drift_relative_kinetic"]),
                                pooled["standard_error_relative_kinetic"], 1e-3) == "inconclusive"


@pytest.mark.parametrize("drifts, errors, match", [([0.001, 0.002], [0.0, 0.0], "at least 3 runs"),
                                                   ([[0.1, 0.2, 0.3]], [[0, 0, 0]], "at least 3 runs"),
                                                   ([0.1, 0.2, 0.3], [0.0, 0.0], "of one length"),
                                                   ([0.001, math.nan, 0.0], [0.0] * 3, "non-finite"),
                                                   ([0.001, 0.0, 0.0], [0.0, math.inf, 0.0], "non-finite")])
def test_pooled_statistics_bad_input(drifts, errors, match):
    with pytest.raises(ValueError, match=match):
        validate_nve.pooled_statistics(drifts, errors)


@pytest.mark.parametrize("text, seeds", [("0-3", [0, 1, 2, 3]), ("0,2,5", [0, 2, 5]), ("7,1-2", [7, 1, 2])])
def test_seed_lists(text, seeds):
    assert validate_nve.parse_args(["--seeds", text]).seeds == seeds


def test_one_seed_by_default():
    assert validate_nve.parse_args([]).seed == 0 and validate_nve.parse_args([]).seeds is None


@pytest.mark.parametrize("argv, match", [(["--seeds", "3"], "at least 3 seeds"),
                                         (["--seeds", "0,1"], "at least 3 seeds"),
                                         (["--seed", "0", "--seeds", "0-3"], "not allowed with argument"),
                                         (["--seeds", "0,1,1"], "each once"),
                                         (["--seeds", "5-2"], "not a list of seeds"),
                                         (["--seeds", "a-b"], "not a list of seeds"),
                                         (["--seeds=-1,2"], "not a list of seeds"),
                                         (["--seed", "1", "--seeds", "0-3"], "not allowed with argument")])
def test_seed_lists_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        validate_nve.parse_args(argv)
    assert match in capsys.readouterr().err


@needs_student("schnet")
def test_script_pools_several_seeds(tmp_path, capfd):
    out = tmp_path / "nve"
    code = validate_nve.main(["--time-ps", "0.02", "--device", "cpu", "--no-optimize", "--record-every", "2",
                              "--seeds", "0-2", "--out", str(out)])
    pooled = json.loads((out / "nve_pooled.json").read_text())
    runs = [read_outputs(out / f"seed{seed}") for seed in range(3)]
    # each run is the single run of its seed
    single = validate_nve.main(["--time-ps", "0.02", "--device", "cpu", "--no-optimize", "--record-every", "2",
                                "--seed", "1", "--out", str(tmp_path / "one")])
    np.testing.assert_array_equal(runs[1][1], read_outputs(tmp_path / "one")[1])
    assert [s["md"]["seed"] for s, _ in runs] == [0, 1, 2] and single in (0, 1)
    assert len({float(series[1, 4]) for _, series in runs}) == 3  # three starts, three trajectories
    signed = [s["results"]["drift_eV"] / s["results"]["mean_kinetic_eV"] for s, _ in runs]
    assert [r["signed_drift_relative_kinetic"] for r in pooled["runs"]] == pytest.approx(signed)
    errors = [s["results"]["drift_standard_error_relative_kinetic"] for s, _ in runs]
    assert pooled["pooled"] == pytest.approx(validate_nve.pooled_statistics(signed, errors))
    assert pooled["complete"] is True and pooled["seeds_planned"] == [0, 1, 2]
    outcome = validate_nve.verdict(abs(np.mean(signed)), pooled["pooled"]["standard_error_relative_kinetic"], 1e-3)
    assert pooled["criterion"]["passed"] == (outcome == "pass") and (code == 0) == (outcome == "pass")
    assert pooled["criterion"]["inconclusive"] == (outcome == "inconclusive")
    assert "the mean signed drift of 3 runs" in capfd.readouterr().err


@needs_student("schnet")
@pytest.mark.parametrize("drifts, verdict", [([2e-4, -1e-4, 1e-4, 0.0], "pass"),
                                             ([9e-4, -4e-4, 1.5e-3, 1e-3], "inconclusive"),
                                             ([3e-3, 2.9e-3, 3.1e-3, 3e-3], "fail"),
                                             ([3e-4, -3e-4, 2e-4, -2e-4], "pass")])  # signed: they cancel
def test_the_pooled_verdict(drifts, verdict, monkeypatch, tmp_path):
    measured, given = validate_nve.drift_statistics, iter(drifts)

    def drift_statistics(*args):
        stats = measured(*args)
        return {**stats, "drift_eV": next(given) * stats["mean_kinetic_eV"],
                "drift_standard_error_relative_kinetic": 1e-5}  # each run as if measured exactly

    monkeypatch.setattr(validate_nve, "drift_statistics", drift_statistics)
    code = validate_nve.main(["--time-ps", "0.01", "--device", "cpu", "--no-optimize", "--record-every", "2",
                              "--seeds", "0-3", "--out", str(tmp_path)])
    pooled = json.loads((tmp_path / "nve_pooled.json").read_text())
    criterion = pooled["criterion"]
    assert pooled["pooled"]["mean_drift_relative_kinetic"] == pytest.approx(np.mean(drifts), abs=1e-12)
    assert (code == 0) == (verdict == "pass") and criterion["passed"] == (verdict == "pass")
    assert criterion["inconclusive"] == (verdict == "inconclusive")


@needs_student("schnet")
def test_a_broken_run_fails_the_pooled_verdict(tmp_path, capfd):
    code = validate_nve.main(["--time-ps", "1", "--timestep-fs", "10", "--device", "cpu", "--no-optimize",
                              "--record-every", "1", "--seeds", "0-2", "--out", str(tmp_path)])
    pooled = json.loads((tmp_path / "nve_pooled.json").read_text())
    assert code == 1 and not pooled["criterion"]["passed"] and pooled["pooled"] is None
    assert "the molecule broke" in pooled["criterion"]["aborted"]["0"]
    assert "FAIL: seed 0: the molecule broke" in capfd.readouterr().err


@needs_student("schnet")
def test_a_job_cut_short_keeps_its_pooled_runs(monkeypatch, tmp_path, capfd):
    run_seed, runs = validate_nve.run_seed, []

    def cut_at_the_fourth(*args):
        if len(runs) == 3:
            raise KeyboardInterrupt  # as a job's time limit or Ctrl-C
        runs.append(run_seed(*args))
        return runs[-1]

    monkeypatch.setattr(validate_nve, "run_seed", cut_at_the_fourth)
    (tmp_path / "nve_pooled.json").write_text("{}")  # an earlier job's, which must not pass for this one's
    with pytest.raises(KeyboardInterrupt):
        validate_nve.main(["--time-ps", "0.01", "--device", "cpu", "--no-optimize", "--record-every", "2",
                           "--seeds", "0-4", "--out", str(tmp_path)])
    pooled = json.loads((tmp_path / "nve_pooled.json").read_text())
    assert pooled["complete"] is False and pooled["seeds_planned"] == [0, 1, 2, 3, 4]
    assert [r["seed"] for r in pooled["runs"]] == [0, 1, 2] and pooled["pooled"]["runs"] == 3
    assert "after 3 of 5 seeds: " in capfd.readouterr().err


@needs_student("schnet")
def test_an_earlier_jobs_pooled_verdict_is_removed(monkeypatch, tmp_path):
    def cut_at_once(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate_nve, "run_seed", cut_at_once)
    (tmp_path / "nve_pooled.json").write_text("{}")
    with pytest.raises(KeyboardInterrupt):
        validate_nve.main(["--time-ps", "0.01", "--device", "cpu", "--no-optimize", "--record-every", "2",
                           "--seeds", "0-3", "--out", str(tmp_path)])
    assert not (tmp_path / "nve_pooled.json").exists()
