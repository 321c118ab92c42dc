"""NVE validation of benzene molecular dynamics with mirage's force-field stack (issue 4).

The model is a reference SchNet or PaiNN of examples/forcefield/models.py (--model) trained to an
analytic benzene force field (examples/forcefield/teacher.py, train_student.py), so the dynamics is that of a real,
bound molecule. It is wrapped with mirage.ff.optimize and mirage.ff.Calculator (CUDA when there is
a GPU) and integrated in the microcanonical ensemble (velocity Verlet, no thermostat) from a
Maxwell-Boltzmann start at 300 K. A conservative force field integrated correctly keeps the total
energy constant up to a bounded oscillation; a systematic drift means wrong forces (forces that
are not the gradient of the energy, discontinuities, precision loss) or a too long time step.

Definitions (all energies in eV, times in ps; t_0 and t_end the first and last recorded times):
- drift = slope of the least-squares line through E_total(t), times (t_end - t_0): the change in
  total energy over the run that the trend accounts for, insensitive to the oscillation. The
  start (t_0) is left out of the fit: the atoms start at the equilibrium geometry, the bottom of
  velocity Verlet's energy oscillation (0.2-0.9 meV below every later sample at 0.5 fs, scaling
  as dt^2), and that one low point tilted short runs' slopes upward (0.27% against 0.15% of
  <E_kin> over 0.5 ps);
- the slope's standard error, times (t_end - t_0) and over <E_kin>: the larger of two estimates,
  least squares from the residuals (right for independent scatter) and least squares through the
  means of DRIFT_BLOCKS consecutive blocks of samples (right when the total energy wanders on
  time scales shorter than a block: the residuals are then correlated, and the first estimate far
  too small; 2026-12-01, H200: a 100 ps run whose fitted drift was 0.176% of <E_kin> with a
  residual-based error of 0.005% had quarters drifting -0.56% to +0.08%). Short series get fewer
  blocks, and none below 7 samples (6 fitted): then the first estimate alone, which
  drift_standard_error_from_blocks says. A run whose drift lies
  within two standard errors of --max-drift gets no verdict ("inconclusive", exit 1: run
  longer), since its pass or fail would be noise. The criterion itself is the issue's,
  drift < --max-drift;
- several starts (--seeds 0-7): one run from each seed's velocities, then the mean of their signed
  drifts (each over its run's <E_kin>) with its standard error (the larger of their sample
  standard deviation over sqrt(runs) and their own errors combined), judged by the same rule; at
  least three seeds. A single run's drift is the method's systematic drift plus a random part of
  its own start (2026-12-01, H200: 16 SchNet runs of 100 ps spread with a
  standard deviation of 0.066% of <E_kin> about a mean of -0.024%); the mean averages the random
  part out, which a longer single run does only slowly;
- drift relative to the mean kinetic energy, |drift| / <E_kin>: the pass criterion
  (drift < --max-drift, default 0.1%). The kinetic energy is the energy scale of the motion and
  does not depend on where the potential has its zero;
- drift relative to the total energy, |drift| / |<E_total>|: reported, not used as the criterion:
  adding a constant to the potential (a per-atom reference energy) changes it at will without
  changing the dynamics. Here the potential is 0 at the equilibrium (the teacher's zero), so
  <E_total> is about twice <E_kin> and this number is about half the kinetic one;
- fluctuation = RMS of E_total(t) about that line, and its ratio to <E_kin>;
- temperature = 2 E_kin / ((3N - 6) k_B): the 3N - 6 = 30 vibrational degrees of freedom of a
  molecule with zero total momentum and angular momentum (ASE's get_temperature divides by 3N).
The run also fails if the molecule breaks (a bond stretched by more than 50%) or an energy is not
finite.

Backends: "ase" (ASE's VelocityVerlet driving mirage.ff.Calculator: the issue's case) and
"mirage-md" (mirage.ff.md.VelocityVerlet: the GPU-resident integrator, K steps per graph replay).

    python scripts/validate_nve.py [--model schnet|painn] [--time-ps 100] [--out nve_validation]
                                   [--backend ase|mirage-md] [--no-optimize] [--device cuda|cpu]
                                   [--precision fp32|tf32|bf16-mixed] [--seed N | --seeds 0-7]

Writes nve_summary.json, nve_series.csv and nve_energy.png (needs matplotlib) to --out (with
--seeds, to --out/seed<N> for each seed, and the pooled verdict to --out/nve_pooled.json); exits 1
when the drift criterion fails, gives no verdict or a run breaks down, 0 when it passes. A drift can be the
model's own at the time step: scripts/nve_drift_sources.py measures a student's in float64
without mirage, and a run's share of it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

from forcefield import train_student  # noqa: E402
from forcefield.benzene import benzene  # noqa: E402
from forcefield.options import require_ranges  # noqa: E402
from forcefield.teacher import BenzeneTeacher  # noqa: E402

BOLTZMANN_EV_PER_K = train_student.BOLTZMANN_EV_PER_K
MAX_BOND_STRAIN = 0.5  # a bond stretched by more than this fraction: the molecule broke


def message(text):
    print(f"validate_nve: {text}", file=sys.stderr, flush=True)


class RunAborted(RuntimeError):
    pass


# ------------------------------------------------------------------------------------- analysis
DRIFT_BLOCKS = 10  # blocks whose mean energies give the slope's error under correlated residuals
MIN_SEEDS = 3  # --seeds: the spread of fewer runs says too little about their mean's error


def _line(t, e):
    """Least squares e ~ slope t + intercept (at least 3 points): (slope, intercept, residual,
    the slope's standard error)."""
    slope, intercept = np.polyfit(t, e, 1)
    residual = e - (slope * t + intercept)
    error = math.sqrt(float(np.sum(residual**2)) / (len(t) - 2) / float(np.sum((t - t.mean()) ** 2)))
    return float(slope), float(intercept), residual, error


def _block_slope_error(t, e):
    """The slope's standard error from the mean (t, e) of consecutive blocks of samples, as many
    as DRIFT_BLOCKS with 2 samples each at least, or None below 3 blocks."""
    blocks = min(DRIFT_BLOCKS, len(t) // 2)
    if blocks < 3:
        return None
    parts = np.array_split(np.arange(len(t)), blocks)
    return _line(np.array([t[p].mean() for p in parts]), np.array([e[p].mean() for p in parts]))[3]


def drift_statistics(times_ps, total, kinetic):
    """Drift and fluctuation of the total energy (see the module docstring for the definitions).

    Args:
        times_ps: [S] sample times (ps), increasing.
        total: [S] total energy (eV).
        kinetic: [S] kinetic energy (eV), positive on average.
    Returns a dict of floats (and drift_standard_error_from_blocks, a bool).
    """
    t = np.asarray(times_ps, dtype=np.float64)
    e = np.asarray(total, dtype=np.float64)
    k = np.asarray(kinetic, dtype=np.float64)
    if t.ndim != 1 or t.shape != e.shape or t.shape != k.shape:
        raise ValueError(f"drift_statistics: times, total and kinetic must be 1-D of one length "
                         f"(got {t.shape}, {e.shape}, {k.shape})")
    if t.shape[0] < 4 or not t[-1] > t[1]:
        raise ValueError(f"drift_statistics: need at least 4 samples (the start and 3 to fit) over a positive "
                         f"time span (got {t.shape[0]})")
    if not (np.isfinite(t).all() and np.isfinite(e).all() and np.isfinite(k).all()):
        raise ValueError("drift_statistics: non-finite values in the series")
    mean_kinetic = float(k.mean())
    if not mean_kinetic > 0:
        raise ValueError(f"drift_statistics: mean kinetic energy must be positive (got {mean_kinetic})")
    fitted_t, fitted_e = t[1:] - t[0], e[1:]  # the start left out (the module docstring)
    slope, _, residual, slope_error = _line(fitted_t, fitted_e)
    block_error = _block_slope_error(fitted_t, fitted_e)
    slope_error = max(slope_error, block_error or 0.0)
    duration = float(t[-1] - t[0])
    drift = slope * duration
    fluctuation = float(np.sqrt(np.mean(residual**2)))
    mean_total = float(e.mean())
    return {
        "duration_ps": duration,
        "drift_rate_eV_per_ps": float(slope),
        "drift_eV": drift,
        "drift_relative_kinetic": abs(drift) / mean_kinetic,
        "drift_standard_error_relative_kinetic": slope_error * duration / mean_kinetic,
        "drift_standard_error_from_blocks": block_error is not None,
        "drift_relative_total": abs(drift) / abs(mean_total) if mean_total != 0 else math.inf,
        "fluctuation_rms_eV": fluctuation,
        "fluctuation_relative_kinetic": fluctuation / mean_kinetic,
        "max_deviation_eV": float(np.max(np.abs(e - e[0]))),
        "mean_total_eV": mean_total,
        "mean_kinetic_eV": mean_kinetic,
    }


def temperature_K(kinetic_eV, dof):
    return 2.0 * np.asarray(kinetic_eV, dtype=np.float64) / (dof * BOLTZMANN_EV_PER_K)


# ---------------------------------------------------------------------------------------- setup
def load_model(model_name, weights, train_steps, train):
    """The trained student and its metadata; trains it first if ``weights`` is missing and
    ``train`` (a mistyped path must not silently become minutes of training and a new student)."""
    weights = Path(weights)
    if not weights.exists() and not train:
        raise SystemExit(f"validate_nve: --weights {weights} does not exist; pass --train to train a student "
                         "there first")
    if not weights.exists():
        message(f"{weights} not found: training the student {model_name} on the analytic benzene teacher first "
                f"({train_steps} steps; minutes on a CPU)")
        train_student.train(weights, model=model_name, steps=train_steps, log=message)
    model, metadata = train_student.load_student(weights)
    if type(model) is not train_student.MODELS[model_name]:
        raise SystemExit(f"validate_nve: --weights {weights} holds a {type(model).__name__}, not the --model "
                         f"{model_name}")
    held_out = metadata.get("held_out", {})
    if "force_rmse_eV_per_A" in held_out:
        message(f"student {weights.name}: held-out force RMSE {held_out['force_rmse_eV_per_A']:.4f} eV/Å "
                f"({100 * held_out['force_rmse_relative']:.1f}% of the RMS force)")
    return model, metadata


def initial_atoms(temperature, seed):
    """Benzene at its equilibrium geometry with Maxwell-Boltzmann momenta at ``temperature``:
    net momentum and angular momentum removed, then scaled so that the kinetic energy is exactly
    (3N - 6)/2 k_B T (a reproducible start: the instantaneous temperature is the target)."""
    import ase
    from ase.md import velocitydistribution as vd

    z, pos = benzene(torch.float64)
    atoms = ase.Atoms(numbers=z.numpy(), positions=pos.numpy())
    rng = np.random.default_rng(seed)
    if hasattr(vd, "thermalize_momenta"):  # ASE >= 3.29 deprecates MaxwellBoltzmannDistribution
        vd.thermalize_momenta(atoms, temperature_K=temperature, rng=rng)
    else:
        vd.MaxwellBoltzmannDistribution(atoms, temperature_K=temperature, rng=rng)
    vd.Stationary(atoms, preserve_temperature=False)
    vd.ZeroRotation(atoms, preserve_temperature=False)
    dof = 3 * len(atoms) - 6
    target = 0.5 * dof * BOLTZMANN_EV_PER_K * temperature
    atoms.set_momenta(atoms.get_momenta() * math.sqrt(target / atoms.get_kinetic_energy()))
    return atoms, dof


def wrap_model(model, device, optimize):
    """(model for the calculator, whether mirage.ff.optimize swapped it, the report text)."""
    import mirage.ff

    model = model.to(device)
    if not optimize:
        return model, False, "not optimized (--no-optimize)"
    fused = mirage.ff.optimize(model)
    report = str(mirage.ff.report(fused))
    message(f"mirage.ff.optimize:\n{report}")
    swapped = fused is not model
    if not swapped:
        message("mirage.ff.optimize left the model alone (see the report): running the plain model")
    return fused, swapped, report


# ------------------------------------------------------------------------------------ recording
class Recorder:
    """Samples energies, temperature and bond lengths; progress lines every few seconds; aborts
    the run when an energy is not finite or the molecule breaks."""

    def __init__(self, total_steps, timestep_fs, dof, bonds, r0, progress_seconds):
        self.total_steps, self.timestep_fs, self.dof = total_steps, timestep_fs, dof
        self.bonds, self.r0 = bonds, r0
        self.progress_seconds = progress_seconds
        self.rows = []  # (step, time_ps, potential, kinetic, total)
        self.max_bond_strain = 0.0
        self.started = time.monotonic()
        self.last_progress = self.started

    def record(self, step, positions, potential, kinetic):
        potential, kinetic = float(potential), float(kinetic)
        self.rows.append((step, step * self.timestep_fs * 1e-3, potential, kinetic, potential + kinetic))
        lengths = np.linalg.norm(positions[self.bonds[:, 1]] - positions[self.bonds[:, 0]], axis=1)
        strain = float(np.max(np.abs(lengths / self.r0 - 1.0)))
        self.max_bond_strain = max(self.max_bond_strain, strain)
        if not (math.isfinite(potential) and math.isfinite(kinetic)):
            raise RunAborted(f"non-finite energy at step {step} (potential {potential}, kinetic {kinetic})")
        if strain > MAX_BOND_STRAIN:
            raise RunAborted(f"the molecule broke at step {step}: a bond stretched by {100 * strain:.0f}%")
        now = time.monotonic()
        if now - self.last_progress >= self.progress_seconds:
            self.last_progress = now
            rate = step / (now - self.started) if now > self.started else 0.0
            e0 = self.rows[0][4]
            temp = float(temperature_K(kinetic, self.dof))
            message(f"{step * self.timestep_fs * 1e-3:.2f}/{self.total_steps * self.timestep_fs * 1e-3:g} ps "
                    f"({step}/{self.total_steps} steps, {rate:.0f} steps/s): E_total - E_0 "
                    f"{1e3 * (potential + kinetic - e0):+.3f} meV, T {temp:.0f} K")

    def series(self):
        return np.asarray(self.rows, dtype=np.float64).reshape(-1, 5)


def run_ase(model, atoms, args, device, cuda_graph, recorder):
    """ASE's VelocityVerlet driving mirage.ff.Calculator. Returns (seconds of the first evaluation,
    seconds of the dynamics)."""
    import ase.units
    from ase.md.verlet import VelocityVerlet

    import mirage.ff

    atoms.calc = mirage.ff.Calculator(model, device=device, precision=args.precision, cuda_graph=cuda_graph)
    start = time.monotonic()
    atoms.get_forces()  # first evaluation: graph capture, capacity choice
    atoms.get_potential_energy()
    first = time.monotonic() - start
    dyn = VelocityVerlet(atoms, timestep=args.timestep_fs * ase.units.fs)

    def observe():
        recorder.record(dyn.nsteps, atoms.positions, atoms.get_potential_energy(), atoms.get_kinetic_energy())

    dyn.attach(observe, interval=args.record_every)
    start = recorder.started = recorder.last_progress = time.monotonic()
    dyn.run(recorder.total_steps)
    return first, time.monotonic() - start


def run_mirage_md(model, atoms, args, device, cuda_graph, recorder):
    """mirage.ff.md.VelocityVerlet (no thermostat: NVE), K steps per graph replay, read back every
    --record-every steps. Returns (seconds of setup and the first evaluation, seconds of the
    dynamics; the latter includes the captures of the first replays)."""
    import ase.units

    try:
        from mirage.ff import md
    except ImportError as exc:
        raise SystemExit(f"validate_nve: --backend mirage-md needs mirage.ff.md, which is not available ({exc})")
    k = args.steps_per_replay
    if args.record_every % k:
        raise SystemExit(f"validate_nve: --record-every ({args.record_every}) must be a multiple of "
                         f"--steps-per-replay ({k})")
    start = time.monotonic()
    dyn = md.VelocityVerlet(model, atoms, args.timestep_fs * ase.units.fs, steps_per_replay=k,
                            precision=args.precision, device=device, cuda_graph=cuda_graph, progress_every=None)
    (first_record,) = dyn.run(0, write_every=args.record_every)
    recorder.record(0, dyn.atoms.positions, first_record["potential"], first_record["kinetic"])
    first = time.monotonic() - start
    start = recorder.started = recorder.last_progress = time.monotonic()
    while dyn.step < recorder.total_steps:
        record = dyn.run(min(args.record_every, recorder.total_steps - dyn.step), write_every=args.record_every)[-1]
        recorder.record(record["step"], dyn.atoms.positions, record["potential"], record["kinetic"])
    return first, time.monotonic() - start


# ----------------------------------------------------------------------------------------- output
def write_csv(path, series, dof):
    temps = temperature_K(series[:, 3], dof)
    with open(path, "w") as f:
        f.write("step,time_ps,potential_eV,kinetic_eV,total_eV,temperature_K\n")
        for row, temp in zip(series, temps):
            f.write(f"{int(row[0])},{row[1]:.6f},{row[2]:.10f},{row[3]:.10f},{row[4]:.10f},{temp:.4f}\n")


def plot(path, series, stats, dof, title):
    """Energies, total-energy deviation with its linear fit, and temperature against time.
    Returns False (with a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        message("matplotlib is not installed: no plot (pip install matplotlib; the JSON and CSV are written)")
        return False
    t, pot, kin, tot = series[:, 1], series[:, 2], series[:, 3], series[:, 4]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True, constrained_layout=True)
    axes[0].plot(t, pot, lw=0.6, label="potential")
    axes[0].plot(t, kin, lw=0.6, label="kinetic")
    axes[0].plot(t, tot, lw=1.0, label="total")
    axes[0].set_ylabel("energy (eV)")
    axes[0].legend(loc="upper right")
    dev = 1e3 * (tot - tot[0])
    fit = 1e3 * stats["drift_rate_eV_per_ps"] * (t - t[0])
    fit += dev.mean() - fit.mean()
    axes[1].plot(t, dev, lw=0.6, label="E_total - E_total(0)")
    axes[1].plot(t, fit, lw=1.2, color="k",
                 label=f"linear fit: drift {100 * stats['drift_relative_kinetic']:.4f}% of <E_kin>")
    axes[1].set_ylabel("total energy (meV)")
    axes[1].legend(loc="upper right")
    axes[2].plot(t, temperature_K(kin, dof), lw=0.6)
    axes[2].set_ylabel(f"temperature (K, {dof} dof)")
    axes[2].set_xlabel("time (ps)")
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------- main
def seed_list(text):
    """--seeds: comma-separated seeds and ranges (0-7), at least MIN_SEEDS distinct, non-negative."""
    seeds = []
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            first, last = int(first), int(last or first)
            if first < 0 or last < first:
                raise ValueError
            seeds.extend(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of seeds such as 0-7 or 0,2,5") from None
    if len(set(seeds)) != len(seeds) or len(seeds) < MIN_SEEDS:
        raise argparse.ArgumentTypeError(f"{text!r}: need at least {MIN_SEEDS} seeds, each once")
    return seeds


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time-ps", type=float, default=100.0, help="simulated time (default 100 ps)")
    parser.add_argument("--timestep-fs", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=300.0, help="initial temperature (K)")
    starts = parser.add_mutually_exclusive_group()
    # default None, then 0: argparse lets "--seed 0 --seeds ..." through when 0 is the default
    starts.add_argument("--seed", type=int, default=None, help="seed of the initial velocities (default 0)")
    starts.add_argument("--seeds", type=seed_list, default=None,
                        help="several seeds, as 0-7 or 0,2,5: a run from each (in --out/seed<N>), judged by "
                             "the mean of their signed drifts (nve_pooled.json)")
    parser.add_argument("--record-every", type=int, default=None,
                        help="record energies every N steps (default 10 with ase, 100 with mirage-md)")
    parser.add_argument("--backend", choices=("ase", "mirage-md"), default="ase")
    parser.add_argument("--steps-per-replay", type=int, default=50, help="mirage-md: steps per graph replay")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16-mixed"))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads when --device is cpu (default 1: a 12-atom molecule gains "
                             "nothing from more, and loses much on a busy machine)")
    parser.add_argument("--no-optimize", action="store_true", help="use the plain model (no mirage.ff.optimize)")
    parser.add_argument("--no-cuda-graph", action="store_true", help="evaluate eagerly on CUDA")
    parser.add_argument("--model", choices=sorted(train_student.MODELS), default="schnet",
                        help="the student to run (default schnet)")
    parser.add_argument("--weights", type=Path, default=None,
                        help="the student's file (default: the model's committed student, "
                             "examples/forcefield/benzene_<model>.pt)")
    parser.add_argument("--train", action="store_true",
                        help="train a student into --weights first when that file does not exist (the default "
                             "--weights, a committed student, is trained again when missing)")
    parser.add_argument("--train-steps", type=int, default=train_student.DEFAULT_STEPS,
                        help="training steps with --train")
    parser.add_argument("--max-drift", type=float, default=1e-3,
                        help="pass when |drift| / <E_kin> is below this (default 0.001 = 0.1%%)")
    parser.add_argument("--progress-seconds", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=Path("nve_validation"))
    args = parser.parse_args(argv)
    if args.record_every is None:
        args.record_every = 10 if args.backend == "ase" else 100
    require_ranges(parser, args, positive=("time_ps", "timestep_fs", "temperature", "max_drift", "progress_seconds"),
                   at_least_one=("record_every", "steps_per_replay", "train_steps", "threads"))
    if args.seed is None:
        args.seed = 0
    if args.weights is None:
        args.weights, args.train = train_student.STUDENT_PATHS[args.model], True
    return args


def verdict(drift, error, max_drift):
    """"pass", "fail" or "inconclusive" for a drift (|drift| / <E_kin>, or the absolute value of the
    mean of several runs' signed drifts) with its standard error: no verdict when --max-drift lies within two
    standard errors of it, since its pass or fail would be noise (module docstring)."""
    if abs(drift - max_drift) < 2 * error:
        return "inconclusive"
    return "pass" if drift < max_drift else "fail"


def pooled_statistics(signed_drifts, standard_errors):
    """The mean of several runs' signed drifts (each relative to its <E_kin>) and its standard
    error: the drift the method makes on average over starts, whose single runs also wander by a
    random part that the mean averages out (module docstring, --seeds). The error is the larger
    of the runs' sample standard deviation over sqrt(runs) and the runs' own standard errors
    combined (sqrt(sum of squares) / runs): a few runs that happen to agree do not make the mean
    surer than the runs themselves are."""
    d = np.asarray(signed_drifts, dtype=np.float64)
    e = np.asarray(standard_errors, dtype=np.float64)
    if d.ndim != 1 or d.shape[0] < MIN_SEEDS or e.shape != d.shape:
        raise ValueError(f"pooled_statistics: need the drifts and standard errors of at least {MIN_SEEDS} runs as "
                         f"1-D sequences of one length (got shapes {d.shape} and {e.shape})")
    if not (np.isfinite(d).all() and np.isfinite(e).all()):
        raise ValueError("pooled_statistics: non-finite drifts or errors")
    runs = d.shape[0]
    spread = float(d.std(ddof=1))
    return {"runs": int(runs), "mean_drift_relative_kinetic": float(d.mean()),
            "standard_error_relative_kinetic": max(spread / math.sqrt(runs), float(np.sqrt(np.sum(e**2))) / runs),
            "spread_relative_kinetic": spread}


def run_seed(args, argv, seed, out, setup):
    """One run from the velocities of ``seed``: writes nve_summary.json, nve_series.csv and the
    plot to ``out``, prints the verdict and returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    model, optimized = setup.model, setup.optimized
    atoms, dof = initial_atoms(args.temperature, seed)
    teacher = BenzeneTeacher()
    recorder = Recorder(setup.steps, args.timestep_fs, dof, teacher.bonds.numpy(), teacher.r0.numpy(),
                        args.progress_seconds)
    message(f"{args.time_ps:g} ps NVE of benzene ({type(model).__name__} student) at {args.timestep_fs:g} fs "
            f"({setup.steps} steps) from {args.temperature:g} K, seed {seed}, backend {args.backend}, "
            f"{setup.device_name}, precision {args.precision}, "
            f"{'mirage.ff.optimize' if optimized else 'plain model'}, cuda_graph={setup.cuda_graph}")

    run = run_ase if args.backend == "ase" else run_mirage_md
    aborted = None
    first_s = dynamics_s = None
    try:
        first_s, dynamics_s = run(setup.fused, atoms, args, setup.device, setup.cuda_graph, recorder)
    except RunAborted as exc:
        aborted = str(exc)
        message(f"run aborted: {aborted}")
    series = recorder.series()
    steps_done = int(series[-1, 0]) if len(series) else 0

    stats = None
    if aborted is None:
        stats = drift_statistics(series[:, 1], series[:, 4], series[:, 3])
    temps = temperature_K(series[:, 3], dof) if len(series) else np.zeros(0)
    outcome = "fail" if aborted else verdict(stats["drift_relative_kinetic"],
                                             stats["drift_standard_error_relative_kinetic"], args.max_drift)
    passed, inconclusive = outcome == "pass", outcome == "inconclusive"
    summary = {
        "what": "NVE validation of benzene MD (scripts/validate_nve.py)",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/validate_nve.py " + " ".join(argv),
        "device": setup.device_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "backend": args.backend,
        "precision": args.precision,
        "optimized": optimized,
        "optimize_report": setup.report,
        "cuda_graph": setup.cuda_graph,
        "model": {"name": type(model).__name__, "weights": str(args.weights), "metadata": setup.metadata},
        "md": {"timestep_fs": args.timestep_fs, "steps": setup.steps, "steps_done": steps_done,
               "time_ps": args.time_ps, "initial_temperature_K": args.temperature, "seed": seed,
               "record_every": args.record_every, "degrees_of_freedom": dof,
               "steps_per_replay": args.steps_per_replay if args.backend == "mirage-md" else None},
        "results": {
            **(stats or {}),
            "mean_temperature_K": float(temps.mean()) if len(temps) else None,
            "std_temperature_K": float(temps.std()) if len(temps) else None,
            "max_bond_strain": recorder.max_bond_strain,
            "first_evaluation_s": first_s,
            "dynamics_s": dynamics_s,
            "steps_per_s": setup.steps / dynamics_s if aborted is None else None,
        },
        "criterion": {"quantity": "drift_relative_kinetic = |drift| / <E_kin>", "threshold": args.max_drift,
                      "passed": passed, "inconclusive": inconclusive, "aborted": aborted},
        "files": {"series": "nve_series.csv", "plot": None},
    }
    write_csv(out / "nve_series.csv", series, dof)
    if len(series) >= 3 and stats is not None:
        title = (f"benzene NVE ({type(model).__name__}), {args.time_ps:g} ps at {args.timestep_fs:g} fs, "
                 f"{args.backend}, {setup.device_name}, {'mirage.ff.optimize' if optimized else 'plain model'}")
        if plot(out / "nve_energy.png", series, stats, dof, title):
            summary["files"]["plot"] = "nve_energy.png"
    with open(out / "nve_summary.json", "w") as f:
        json.dump(summary, f, indent=2, default=float)

    if stats is not None:
        r = summary["results"]
        message(f"drift {1e3 * stats['drift_eV']:+.4f} meV over {stats['duration_ps']:g} ps = "
                f"{100 * stats['drift_relative_kinetic']:.4f}% of <E_kin> ({stats['mean_kinetic_eV']:.4f} eV), "
                f"{100 * stats['drift_relative_total']:.4f}% of |<E_total>| ({abs(stats['mean_total_eV']):.4f} eV); "
                f"fluctuation RMS {1e3 * stats['fluctuation_rms_eV']:.4f} meV; "
                f"<T> {r['mean_temperature_K']:.1f} K; {r['steps_per_s']:.0f} steps/s")
    if aborted:
        line = f"FAIL: {aborted}"
    elif inconclusive:
        line = (f"INCONCLUSIVE: |drift| / <E_kin> = {100 * stats['drift_relative_kinetic']:.4f}% with a standard "
                f"error of {100 * stats['drift_standard_error_relative_kinetic']:.4f}%: the threshold of "
                f"{100 * args.max_drift:g}% lies within two of them"
                + ("" if args.seeds else "; run longer (--time-ps), or average the signed drifts of several seeds "
                   "(--seeds)"))
    else:
        line = (f"{'PASS' if passed else 'FAIL'}: |drift| / <E_kin> = {100 * stats['drift_relative_kinetic']:.4f}% "
                f"(standard error {100 * stats['drift_standard_error_relative_kinetic']:.4f}%; "
                f"{'<' if passed else '>='} {100 * args.max_drift:g}%)")
    message(f"{'seed %d: ' % seed if args.seeds else ''}{line}; results in {out}")
    if outcome == "fail" and aborted is None:
        # A drift can be the model's own at this time step (a PaiNN student trained with
        # norm_eps 1e-8 drifted so, docs/perf/forcefield.md): say how to tell.
        message(f"the model's own drift, without mirage or float32: python scripts/nve_drift_sources.py reference "
                f"--model {args.model} --weights {shlex.quote(str(args.weights))} --timestep-fs {args.timestep_fs:g}; "
                f"this run's share: ... path --seed {seed} (docs/perf/forcefield.md, \"Where the drift comes "
                f"from\")")
    return summary


def pool_seeds(args, argv, summaries):
    """The verdict on the mean signed drift of the runs of --seeds done so far, written to
    nve_pooled.json beside their folders after each run from the MIN_SEEDS-th on, so that a job cut
    short keeps what it measured ("complete": false). A run that broke down fails the whole."""
    aborted = {s["md"]["seed"]: s["criterion"]["aborted"] for s in summaries if s["criterion"]["aborted"]}
    signed = {s["md"]["seed"]: None if s["criterion"]["aborted"] else
              s["results"]["drift_eV"] / s["results"]["mean_kinetic_eV"] for s in summaries}
    pooled = None if aborted else pooled_statistics(
        list(signed.values()), [s["results"]["drift_standard_error_relative_kinetic"] for s in summaries])
    outcome = "fail" if aborted else verdict(abs(pooled["mean_drift_relative_kinetic"]),
                                             pooled["standard_error_relative_kinetic"], args.max_drift)
    complete = len(summaries) == len(args.seeds)
    result = {
        "what": "NVE validation of benzene MD over several starts (scripts/validate_nve.py --seeds)",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/validate_nve.py " + " ".join(argv),
        "seeds_planned": args.seeds,
        "complete": complete,
        "runs": [{"seed": s["md"]["seed"], "folder": f"seed{s['md']['seed']}",
                  "signed_drift_relative_kinetic": signed[s["md"]["seed"]],
                  **{k: s["criterion"][k] for k in ("passed", "inconclusive", "aborted")}} for s in summaries],
        "pooled": pooled,
        "criterion": {"quantity": "|mean of the runs' signed drift / <E_kin>|", "threshold": args.max_drift,
                      "passed": outcome == "pass", "inconclusive": outcome == "inconclusive",
                      "aborted": aborted or None},
    }
    with open(args.out / "nve_pooled.json", "w") as f:
        json.dump(result, f, indent=2, default=float)
    if aborted:
        line = "FAIL: " + "; ".join(f"seed {seed}: {why}" for seed, why in aborted.items())
    else:
        over = sum(abs(d) >= args.max_drift for d in signed.values())
        line = (f"{outcome.upper()}: the mean signed drift of {pooled['runs']} runs is "
                f"{100 * pooled['mean_drift_relative_kinetic']:+.4f}% of <E_kin> with a standard error of "
                f"{100 * pooled['standard_error_relative_kinetic']:.4f}% (threshold {100 * args.max_drift:g}%"
                f"{', within two standard errors: run more seeds' if outcome == 'inconclusive' else ''}); "
                f"single runs spread by {100 * pooled['spread_relative_kinetic']:.4f}%, {over} of them at or "
                "over the threshold")
    done = "" if complete else f"after {len(summaries)} of {len(args.seeds)} seeds: "
    message(f"{done}{line}; results in {args.out}")
    return outcome == "pass"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("validate_nve: --device cuda but no CUDA device is available")
    steps = int(round(args.time_ps * 1e3 / args.timestep_fs))
    if steps % args.record_every:  # the series ends on the last step
        steps += args.record_every - steps % args.record_every
        message(f"running {steps} steps: a multiple of --record-every {args.record_every}")
    if steps < 3 * args.record_every:
        raise SystemExit(f"validate_nve: {args.time_ps} ps at {args.timestep_fs} fs is {steps} steps: "
                         f"too few to record a series every {args.record_every} steps")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)

    model, metadata = load_model(args.model, args.weights, args.train_steps, args.train)
    fused, optimized, report = wrap_model(model, device, not args.no_optimize)
    # A CUDA graph needs the fused model: the reference model's radius graph (nonzero) syncs.
    cuda_graph = device.type == "cuda" and optimized and not args.no_cuda_graph
    setup = types.SimpleNamespace(steps=steps, device=device, model=model, metadata=metadata, fused=fused,
                                  optimized=optimized, report=report, cuda_graph=cuda_graph,
                                  device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    if not args.seeds:
        return 0 if run_seed(args, argv, args.seed, args.out, setup)["criterion"]["passed"] else 1
    (args.out / "nve_pooled.json").unlink(missing_ok=True)  # an earlier job's must not pass for this one's
    summaries = []
    for i, seed in enumerate(args.seeds):
        message(f"seed {seed} ({i + 1} of {len(args.seeds)})")
        summaries.append(run_seed(args, argv, seed, args.out / f"seed{seed}", setup))
        if i + 1 >= MIN_SEEDS:
            passed = pool_seeds(args, argv, summaries)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
