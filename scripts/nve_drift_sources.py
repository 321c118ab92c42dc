"""Where an NVE run's energy drift comes from: the forces, or the integration (issue 4).

validate_nve.py measures the drift of one run. This script splits it, for the benzene students
(examples/forcefield, --model schnet|painn), with the student in float64 as the yardstick:

  path       One mirage.ff.md.VelocityVerlet run of the student under mirage.ff.optimize (float32,
             CUDA graphs; --layers keeps the layer-by-layer path instead of the one-op kernels),
             its state read every --every steps. Along that same path the plain student in float64
             gives E64 and F64. In continuous time d(E_kin + E64)/dt = (F_run - F64) . v, so:
               - drift of E_kin + E_run: what validate_nve.py measures;
               - drift of E_kin + E64: the same path judged by the exact model's energy;
               - force-error work, the integral of (F_run - F64) . v dt over the records
                 (trapezoid rule): the part of the change that the run's force errors did;
             when the first two agree and the third is small, the drift is the integration's
             (time step, rounding of the state), not the forces'.
  reference  The student in float64 end to end: --seeds trajectories (validate_nve.py's starts,
             seeds 0..S-1) integrated together by velocity Verlet in float64, each step one batched
             energy+forces of every molecule (train_student.predict), captured in a CUDA graph on a
             GPU. Its drifts are what the model itself does at this time step, without mirage.

Drift is validate_nve.py's: the least-squares slope of E_total(t) times the duration, as a
fraction of <E_kin>.

    python scripts/nve_drift_sources.py path --model painn --seed 1 --timestep-fs 0.25
    python scripts/nve_drift_sources.py reference --model painn --seeds 8 --timestep-fs 0.25

Prints one JSON object (also written to --json).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import validate_nve  # noqa: E402  (puts examples/ on the path)
from forcefield import train_student  # noqa: E402

TEMPERATURE_K = 300.0


def student_file(model_name, weights=None):
    """``weights``, or the committed student file of ``model_name``."""
    return Path(weights) if weights is not None else train_student.STUDENT_PATHS[model_name]


def load_student(model_name, weights=None):
    """The student of ``model_name`` (float32, CPU) from :func:`student_file`."""
    path = student_file(model_name, weights)
    model = train_student.load_student(path)[0]
    if type(model) is not train_student.MODELS[model_name]:
        raise SystemExit(f"nve_drift_sources: {path} holds a {type(model).__name__}, not the --model {model_name}")
    return model


def float64_copy(model, device):
    """``model`` in float64 on ``device``, frozen (only positions need gradients)."""
    model = copy.deepcopy(model).double().to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def signed_drift_pct(t, kinetic, y):
    """The drift of y (eV) over the run as a signed fraction of <E_kin>, in %."""
    return 100 * float(np.polyfit(t, y, 1)[0]) * (t[-1] - t[0]) / float(np.mean(kinetic))


def record_path(model, atoms, timestep_fs, steps, every, device):
    """A mirage.ff.md run of ``model`` from ``atoms``: positions, velocities, forces [R, N, 3] and
    potential energies [R] at every ``every`` steps from step 0 (R = steps // every + 1)."""
    import ase.units

    from mirage.ff import md

    dyn = md.VelocityVerlet(model, atoms, timestep_fs * ase.units.fs, steps_per_replay=every, device=device,
                            progress_every=None)
    steps = steps // every * every
    frames, started, last = [], time.monotonic(), time.monotonic()
    dyn.run(0, write_every=every)
    while True:
        state = dyn.atoms
        frames.append((state.positions, state.get_velocities(), state.get_forces(), state.get_potential_energy()))
        if dyn.step >= steps:
            break
        dyn.run(every, write_every=every)
        if time.monotonic() - last > 10:
            last = time.monotonic()
            validate_nve.message(f"path: step {dyn.step}/{steps}, {dyn.step / (last - started):.0f} steps/s")
    return tuple(np.asarray(column) for column in zip(*frames))


def float64_along(exact, atomic_numbers, positions, device):
    """The float64 model's energies [R] and forces [R, N, 3] at positions [R, N, 3]."""
    energies, forces = train_student.predict_in_batches(
        exact, torch.tensor(atomic_numbers, device=device), torch.tensor(positions, device=device), 1000)
    return energies.cpu().numpy(), forces.cpu().numpy()


def force_error_work(forces, reference_forces, velocities, interval):
    """The work (eV) of forces - reference_forces along the recorded motion: the trapezoid rule over
    the records' power (forces - reference) . v, records ``interval`` apart (ASE time units)."""
    power = ((forces - reference_forces) * velocities).sum((1, 2))
    return float(0.5 * (power[1:] + power[:-1]).sum() * interval)


def path(args, device):
    import ase.units

    import mirage.ff

    student = load_student(args.model, args.weights)
    fast = mirage.ff.optimize(copy.deepcopy(student).to(device))
    exact = float64_copy(student, device)
    atoms, _ = validate_nve.initial_atoms(TEMPERATURE_K, args.seed)
    kept = type(fast).whole_model_max_atoms
    if args.layers:
        type(fast).whole_model_max_atoms = 0  # docs/ff.md: the way to keep the layers
    started = time.monotonic()
    try:
        x, v, f, e = record_path(fast, atoms, args.timestep_fs, args.steps, args.every, device)
    finally:
        type(fast).whole_model_max_atoms = kept
    md_seconds = time.monotonic() - started
    e64, f64 = float64_along(exact, atoms.numbers, x, device)
    kinetic = 0.5 * (atoms.get_masses()[None, :, None] * v**2).sum((1, 2))
    t = np.arange(len(x)) * args.every * args.timestep_fs * 1e-3
    work = force_error_work(f, f64, v, args.every * args.timestep_fs * ase.units.fs)
    return {
        "run": "mirage.ff.md, " + ("layers" if args.layers else "one op where it applies"),
        "seed": args.seed, "records": len(x), "md_seconds": round(md_seconds, 1),
        "mean_kinetic_eV": float(kinetic.mean()),
        "drift_run_pct": signed_drift_pct(t, kinetic, kinetic + e),
        "drift_float64_energy_pct": signed_drift_pct(t, kinetic, kinetic + e64),
        "force_error_work_pct": 100 * work / float(kinetic.mean()),
        "force_error_rel_rms": float(np.sqrt(((f - f64) ** 2).mean() / (f64**2).mean())),
        "energy_error_rms_eV": float(np.sqrt(((e - e64) ** 2).mean())),
    }


def reference_series(model_name, seeds, timestep_fs, steps, every, device, weights=None):
    """Times (ps) [R], kinetic and potential energies (eV) [R, seeds] of the float64 runs, recorded
    every ``every`` steps from step 0."""
    import ase.units

    model = float64_copy(load_student(model_name, weights), device)
    starts = [validate_nve.initial_atoms(TEMPERATURE_K, seed)[0] for seed in range(seeds)]
    z = torch.tensor(starts[0].numbers, device=device)
    masses = torch.tensor(starts[0].get_masses(), dtype=torch.float64, device=device)[None, :, None]
    x = torch.tensor(np.stack([a.positions for a in starts]), dtype=torch.float64, device=device)
    v = torch.tensor(np.stack([a.get_velocities() for a in starts]), dtype=torch.float64, device=device)
    energy, forces = train_student.predict(model, z, x)
    e, f = energy.detach().clone(), forces.clone()
    dt = timestep_fs * ase.units.fs

    def advance():
        for _ in range(every):
            v.addcmul_(f, 1.0 / masses, value=0.5 * dt)
            x.add_(v, alpha=dt)
            energy, forces = train_student.predict(model, z, x)
            e.copy_(energy.detach())
            f.copy_(forces)
            v.addcmul_(f, 1.0 / masses, value=0.5 * dt)

    replay = advance
    if device.type == "cuda":  # one graph of --every steps; the warm-up's steps are undone
        start = [t.clone() for t in (x, v, e, f)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            advance()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            advance()
        for t, s in zip((x, v, e, f), start):
            t.copy_(s)
        replay = graph.replay
    potential, kinetic = [e.clone()], [(0.5 * masses * v**2).sum((1, 2))]
    replays = steps // every
    started = last = time.monotonic()
    for k in range(replays):
        replay()
        potential.append(e.clone())
        kinetic.append((0.5 * masses * v**2).sum((1, 2)))
        if time.monotonic() - last > 10:
            last = time.monotonic()
            validate_nve.message(f"reference: step {(k + 1) * every}/{replays * every}, "
                                 f"{(k + 1) * every / (last - started):.0f} steps/s")
    t = np.arange(replays + 1) * every * timestep_fs * 1e-3
    return t, torch.stack(kinetic).cpu().numpy(), torch.stack(potential).cpu().numpy()


def reference(args, device):
    started = time.monotonic()
    t, kinetic, potential = reference_series(args.model, args.seeds, args.timestep_fs, args.steps, args.every, device,
                                             args.weights)
    return {"run": "plain student in float64, batched velocity Verlet in float64",
            "seconds": round(time.monotonic() - started, 1),
            "drift_pct_by_seed": [round(signed_drift_pct(t, kinetic[:, b], kinetic[:, b] + potential[:, b]), 4)
                                  for b in range(args.seeds)]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["path", "reference"])
    parser.add_argument("--model", choices=sorted(train_student.MODELS), default="painn")
    parser.add_argument("--weights", type=Path, default=None,
                        help="the student's file (default: the committed one, examples/forcefield/benzene_<model>.pt)")
    parser.add_argument("--timestep-fs", type=float, default=0.5)
    parser.add_argument("--time-ps", type=float, default=100.0)
    parser.add_argument("--every", type=int, default=20, help="steps between records (and per graph replay)")
    parser.add_argument("--seed", type=int, default=0, help="path: the start (validate_nve.py --seed)")
    parser.add_argument("--layers", action="store_true", help="path: the layer-by-layer model, not the one op")
    parser.add_argument("--seeds", type=int, default=8, help="reference: trajectories, seeds 0..S-1")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not (args.timestep_fs > 0 and args.time_ps > 0 and args.every >= 1 and args.seeds >= 1):
        parser.error("--timestep-fs and --time-ps must be positive, --every and --seeds at least 1")
    args.steps = int(round(args.time_ps * 1e3 / args.timestep_fs))
    if args.steps < 2 * args.every:
        parser.error(f"{args.steps} steps are too few to record every {args.every}")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = False
    weights = student_file(args.model, args.weights)
    result = {"mode": args.mode, "model": args.model, "weights": str(weights),
              "config": torch.load(weights, map_location="cpu", weights_only=True).get("config"),
              "timestep_fs": args.timestep_fs, "time_ps": args.time_ps,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              **(path if args.mode == "path" else reference)(args, device)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
