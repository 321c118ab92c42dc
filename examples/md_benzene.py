"""Molecular dynamics of benzene with a SchNet (or PaiNN) force field, two ways:

1. ASE's own VelocityVerlet driving ``mirage.ff.Calculator`` (one CUDA-graph replay per step);
2. ``mirage.ff.md.VelocityVerlet``: the whole integrator on the GPU, K steps per graph replay.

The model is the plain-PyTorch reference of examples/forcefield/models.py with random weights
(a stand-in for a trained one: the dynamics are those of an untrained potential), made fast by
``mirage.ff.optimize``. Units are ASE's (eV, Å, fs via ase.units).

    python examples/md_benzene.py                      # small runs; CUDA if available
    python examples/md_benzene.py --steps 100000 --ase-steps 2000 --trajectory benzene.traj
    python examples/md_benzene.py --device cpu --no-optimize   # the model as written, eagerly
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

import ase
from ase import units
from ase.md import velocitydistribution
from ase.md.verlet import VelocityVerlet as AseVelocityVerlet

import mirage.ff
import mirage.ff.md

sys.path.insert(0, str(Path(__file__).resolve().parent))
from forcefield.benzene import benzene  # noqa: E402
from forcefield.models import PaiNN, SchNet  # noqa: E402
from forcefield.options import require_ranges  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["schnet", "painn"], default="schnet")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=["fp32", "tf32", "bf16-mixed"], default="fp32")
    parser.add_argument("--no-optimize", action="store_true",
                        help="run the reference model as written (eager: it cannot be graph-captured)")
    parser.add_argument("--temperature", type=float, default=300.0, help="initial temperature, K")
    parser.add_argument("--timestep", type=float, default=0.5, help="fs")
    parser.add_argument("--ase-steps", type=int, default=20, help="steps of ASE's VelocityVerlet")
    parser.add_argument("--steps", type=int, default=200, help="steps of mirage.ff.md.VelocityVerlet")
    parser.add_argument("--steps-per-replay", type=int, default=50, help="K: steps per CUDA-graph replay")
    parser.add_argument("--write-every", type=int, default=100, help="steps between frames and log lines")
    parser.add_argument("--trajectory", default=None, help="write the mirage run's frames here (ASE .traj)")
    parser.add_argument("--langevin", type=float, default=None, metavar="FRICTION_PER_FS",
                        help="NVT at --temperature with this friction (1/fs, e.g. 0.01) instead of NVE")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    require_ranges(parser, args, positive=("temperature", "timestep"),
                   at_least_one=("ase_steps", "steps", "steps_per_replay", "write_every"))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA GPU is available to this torch; use --device cpu")
    return args


def largest_change(totals):
    """max |E_total - E_total(0)|: the energy's excursion, not a fitted drift (scripts/validate_nve.py)."""
    return max(abs(e - totals[0]) for e in totals)


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    model = (SchNet if args.model == "schnet" else PaiNN)(cutoff=5.0).eval().to(args.device)
    fast = model if args.no_optimize else mirage.ff.optimize(model)
    if fast is not model:
        print(mirage.ff.report(fast))
    elif not args.no_optimize:
        print(mirage.ff.report(model))
    # Only mirage's fused models can be graph-captured (the reference ones call nonzero).
    cuda_graph = fast is not model

    z, positions = benzene()
    atoms = ase.Atoms(numbers=z.numpy(), positions=positions.numpy())
    thermalize = getattr(velocitydistribution, "thermalize_momenta", None) or \
        velocitydistribution.MaxwellBoltzmannDistribution  # renamed in ASE 3.29
    thermalize(atoms, temperature_K=args.temperature, rng=np.random.default_rng(args.seed))
    velocitydistribution.Stationary(atoms)
    # 12 atoms draw a temperature far from the target: rescale to it exactly.
    atoms.set_momenta(atoms.get_momenta() * np.sqrt(args.temperature / atoms.get_temperature()))
    timestep = args.timestep * units.fs
    print(f"benzene, {args.model}, {args.device}, precision {args.precision}, dt {args.timestep} fs, "
          f"T0 {atoms.get_temperature():.0f} K")

    # 1. ASE drives the dynamics; mirage evaluates energy and forces.
    ase_atoms = atoms.copy()
    ase_atoms.calc = mirage.ff.Calculator(fast, device=args.device, precision=args.precision, cuda_graph=cuda_graph)
    totals = []
    dynamics = AseVelocityVerlet(ase_atoms, timestep=timestep)
    dynamics.attach(lambda: totals.append(ase_atoms.get_total_energy()), interval=max(1, args.ase_steps // 10))
    ase_atoms.get_forces()  # the first evaluation (on a GPU, the capture) untimed, as the integrator's below
    start = time.perf_counter()
    dynamics.run(args.ase_steps)
    seconds = time.perf_counter() - start
    print(f"ASE VelocityVerlet + mirage.ff.Calculator: {args.ase_steps} steps in {seconds:.2f} s "
          f"({args.ase_steps / seconds:.0f} steps/s), max |E_total - E_total(0)| {largest_change(totals):.2e} eV")

    # 2. The integrator itself on the device.
    thermostat = None
    if args.langevin is not None:
        thermostat = mirage.ff.md.Langevin(args.temperature, args.langevin / units.fs)
    dynamics = mirage.ff.md.VelocityVerlet(fast, atoms, timestep, thermostat=thermostat,
                                           steps_per_replay=args.steps_per_replay, precision=args.precision,
                                           device=args.device, cuda_graph=cuda_graph)
    dynamics.run(args.steps_per_replay, write_every=args.steps_per_replay)  # captures the graph, untimed
    dynamics.run(args.steps, trajectory=args.trajectory, write_every=args.write_every, log=sys.stdout)
    totals = [r["total"] for r in dynamics.records]
    # A thermostat exchanges energy with its bath: the total is not conserved there, the temperature is the measure.
    outcome = (f"mean temperature {np.mean([r['temperature'] for r in dynamics.records]):.0f} K (target "
               f"{args.temperature:.0f} K)" if thermostat is not None else
               f"max |E_total - E_total(0)| {largest_change(totals):.2e} eV")
    print(f"mirage.ff.md.VelocityVerlet (K={args.steps_per_replay}): {args.steps} timed steps (the log's step "
          f"numbers count the {args.steps_per_replay} of the untimed first replay too), "
          f"{dynamics.steps_per_second:.0f} steps/s, {outcome}"
          + (f", trajectory in {args.trajectory}" if args.trajectory else ""))


if __name__ == "__main__":
    main()
