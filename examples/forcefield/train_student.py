"""Fit a reference model (SchNet or PaiNN, models.py) to the analytic benzene teacher (teacher.py):
the "student" whose molecular dynamics scripts/validate_nve.py checks for energy conservation.

Data: configurations drawn from the teacher's harmonic Boltzmann distribution (independent
normal-mode displacements of variance kT/omega^2 around the equilibrium) at temperatures uniform in
[T_MIN, T_MAX] K, which covers what an NVE run started at 300 K visits (about 150 K once kinetic
and potential energy have equilibrated, with excursions). Labels: the teacher's energy and forces.
Loss: mean squared error of energies over the energies' variance plus that of forces over their
mean square (the force term differentiates the predicted forces with respect to the weights:
double backward). Adam with a cosine learning-rate decay, 4000 steps of 16 configurations,
float32, one CPU thread. The weights of both students are committed (benzene_schnet.pt,
benzene_painn.pt), so this runs only to reproduce them; each file's metadata says how long its
training took and its force error. For SchNet, half the steps leave a force error of ~18% instead
of ~10%. PaiNN's student is trained with norm_eps = 1e-2 (the customary 1e-8 gave a student whose
energy is too rough for NVE at 0.5 fs: docs/perf/forcefield.md):

    python examples/forcefield/train_student.py --model painn --norm-eps 1e-2 --overwrite

The result is written with the force error on held-out configurations in its metadata:

    python examples/forcefield/train_student.py [--model schnet|painn] [--norm-eps EPS] [--out PATH] [--overwrite]

Load it with :func:`load_student`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `forcefield` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forcefield.models import PaiNN, SchNet  # noqa: E402
from forcefield.options import require_ranges  # noqa: E402
from forcefield.pair_energy import atom_energies  # noqa: E402
from forcefield.teacher import BenzeneTeacher, energy_and_forces, normal_modes  # noqa: E402

MODELS = {"schnet": SchNet, "painn": PaiNN}
# Where each model's committed student lives.
STUDENT_PATHS = {name: Path(__file__).resolve().parent / f"benzene_{name}.pt" for name in MODELS}
# v2 added PaiNN's norm_eps to the config. Code that only knows v1 then refuses the file by name
# instead of failing on an unknown config key; v1 files (no norm_eps: the model's default) still load.
FORMAT = "mirage-benzene-student-v2"
READABLE_FORMATS = ("mirage-benzene-student-v1", FORMAT)
BOLTZMANN_EV_PER_K = 8.617333262e-5
MASSES = {1: 1.008, 6: 12.011}  # amu (ASE's values)
T_MIN, T_MAX = 50.0, 600.0
DEFAULT_STEPS = 4000


def masses_of(atomic_numbers):
    return torch.tensor([MASSES[int(z)] for z in atomic_numbers], dtype=torch.float64)


def sample_configurations(teacher, count, generator, t_min=T_MIN, t_max=T_MAX):
    """count positions [count, 12, 3] (float64) from the teacher's harmonic Boltzmann distribution
    at temperatures uniform in [t_min, t_max] K, and those temperatures [count]."""
    omega2, modes = normal_modes(teacher, masses_of(teacher.atomic_numbers))
    temperatures = t_min + (t_max - t_min) * torch.rand(count, generator=generator, dtype=torch.float64)
    sigma = torch.sqrt(BOLTZMANN_EV_PER_K * temperatures[:, None] / omega2[None, :])  # [count, 30]
    q = sigma * torch.randn(count, omega2.shape[0], generator=generator, dtype=torch.float64)
    return teacher.equilibrium + torch.einsum("bk,kac->bac", q, modes), temperatures


def all_pairs(n, device=None):
    """Every ordered pair i != j of an n-atom molecule (receiver i, sender j = i + 1, ..., i + n - 1
    mod n). Without boolean indexing, which waits for the GPU: a CUDA graph can capture it."""
    i = torch.arange(n, device=device)[:, None].expand(n, n - 1)
    j = (i + torch.arange(1, n, device=device)) % n
    return i.reshape(-1), j.reshape(-1)


def batched_energy(model, atomic_numbers, positions):
    """The model's energies for a batch of conformations of one molecule: positions [B, N, 3] ->
    [B]. The model's own forward takes one molecule; this evaluates the same modules once on the
    batch as one graph of B disjoint molecules with every ordered pair of each (pair_energy.py).
    Pairs at or beyond the cutoff contribute exactly nothing, so the result equals
    model(atomic_numbers, pos[b]) up to rounding (checked by :func:`check_batched_energy`)."""
    b, n, _ = positions.shape
    i, j = all_pairs(n, positions.device)
    offsets = n * torch.arange(b, device=positions.device)[:, None]
    i, j = (i + offsets).reshape(-1), (j + offsets).reshape(-1)
    flat = positions.reshape(b * n, 3)
    energies = atom_energies(model, atomic_numbers.repeat(b), i, j, flat[j] - flat[i])
    return energies.view(b, n).sum(dim=1)


def check_batched_energy(model, atomic_numbers, positions, rtol=1e-5, atol=1e-5):
    """Raise if batched_energy disagrees with the model's own forward on these positions."""
    with torch.no_grad():
        batched = batched_energy(model, atomic_numbers, positions)
        single = torch.stack([model(atomic_numbers, p) for p in positions])
    if not torch.allclose(batched, single, rtol=rtol, atol=atol):
        raise RuntimeError(f"train_student: batched_energy does not reproduce {type(model).__name__}.forward "
                           f"(max difference {float((batched - single).abs().max()):.3g} eV)")


def predict(model, atomic_numbers, positions, create_graph=False):
    """Energies [B] and forces [B, N, 3] of the model at positions [B, N, 3]."""
    pos = positions.detach().requires_grad_(True)
    energy = batched_energy(model, atomic_numbers, pos)
    (grad,) = torch.autograd.grad(energy.sum(), pos, create_graph=create_graph)
    return energy, -grad


def predict_in_batches(model, atomic_numbers, positions, batch):
    """:func:`predict` over ``batch`` conformations at a time (bounded memory), detached."""
    energies, forces = [], []
    for start in range(0, positions.shape[0], batch):
        e, f = predict(model, atomic_numbers, positions[start:start + batch])
        energies.append(e.detach())
        forces.append(f.detach())
    return torch.cat(energies), torch.cat(forces)


def force_errors(model, atomic_numbers, positions, energies, forces, batch=100):
    """Held-out errors: energy MAE (eV), force RMSE and MAE per component (eV/Å), force RMSE
    relative to the RMS of the reference forces."""
    e, f = predict_in_batches(model, atomic_numbers, positions, batch)
    e_err, f_err = (e.double() - energies).abs(), (f.double() - forces).reshape(-1)
    rmse = float(f_err.pow(2).mean().sqrt())
    return {
        "energy_mae_eV": float(e_err.mean()),
        "force_rmse_eV_per_A": rmse,
        "force_mae_eV_per_A": float(f_err.abs().mean()),
        "force_rmse_relative": rmse / float(forces.pow(2).mean().sqrt()),
    }


def student_config(model, hidden=128, num_interactions=3, num_rbf=20, cutoff=5.0, norm_eps=None):
    """The constructor arguments of a student of ``model`` ("schnet" or "painn"), as its file
    stores them; ValueError for a setting the model does not take. ``norm_eps`` (PaiNN only;
    None: the model's default) goes under the square root of |V v|."""
    config = {"hidden": hidden, "num_interactions": num_interactions, "num_rbf": num_rbf, "cutoff": cutoff}
    if norm_eps is not None:
        if MODELS[model] is not PaiNN:
            raise ValueError(f"train_student: norm_eps is a PaiNN setting, not {model}'s")
        if not (math.isfinite(norm_eps) and norm_eps > 0):
            raise ValueError(f"train_student: norm_eps must be finite and > 0, got {norm_eps}")
        config["norm_eps"] = norm_eps
    return config


def train(out, *, model="schnet", hidden=128, num_interactions=3, num_rbf=20, cutoff=5.0, norm_eps=None,
          steps=DEFAULT_STEPS, batch=16, n_train=2000, n_test=300, lr=2e-3, seed=0, log=print):
    """Train the student and save it to ``out`` (None: do not save). Returns (model, metadata).
    The model's settings as :func:`student_config` takes them."""
    config = student_config(model, hidden, num_interactions, num_rbf, cutoff, norm_eps)
    threads = torch.get_num_threads()
    # Small tensors: one thread is faster, by 10x on a busy two-core machine (thread contention).
    torch.set_num_threads(1)
    try:
        return _train(out, MODELS[model], config, steps, batch, n_train, n_test, lr, seed, log)
    finally:
        torch.set_num_threads(threads)


def _train(out, model_class, config, steps, batch, n_train, n_test, lr, seed, log):
    started = time.monotonic()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    teacher = BenzeneTeacher()
    z = teacher.atomic_numbers
    positions, _ = sample_configurations(teacher, n_train + n_test, gen)
    energies, forces = energy_and_forces(teacher, positions)
    train_pos, test_pos = positions[:n_train].float(), positions[n_train:]
    train_e, train_f = energies[:n_train].float(), forces[:n_train].float()
    e_scale, f_scale = float(train_e.std()), float(train_f.pow(2).mean().sqrt())

    model = model_class(**config)
    check_batched_energy(model, z, train_pos[:4])
    with torch.no_grad():  # start from the teacher's mean energy: the readout bias is per atom
        model.readout[-1].bias += float(train_e.mean() - batched_energy(model, z, train_pos[:256]).mean()) / len(z)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    settings = ", ".join(f"{k}={v}" for k, v in config.items())
    log(f"train_student: {model_class.__name__}({settings}) on {n_train} teacher configurations "
        f"({T_MIN:.0f}-{T_MAX:.0f} K), {steps} steps of {batch}")
    last_log = time.monotonic()
    for step in range(steps):
        idx = torch.randint(n_train, (batch,), generator=gen)
        e, f = predict(model, z, train_pos[idx], create_graph=True)
        loss = ((e - train_e[idx]) / e_scale).pow(2).mean() + ((f - train_f[idx]) / f_scale).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)  # rare large steps (stiff bonds) stay bounded
        optimizer.step()
        schedule.step()
        if time.monotonic() - last_log > 10 or step == steps - 1:
            last_log = time.monotonic()
            log(f"train_student: step {step + 1}/{steps}  loss {loss.item():.4g}  ({last_log - started:.0f} s)")

    model.eval()
    errors = force_errors(model, z, test_pos.float(), energies[n_train:], forces[n_train:])
    metadata = {
        "teacher": "examples/forcefield/teacher.py BenzeneTeacher",
        "train_configurations": n_train, "test_configurations": n_test,
        "temperature_range_K": [T_MIN, T_MAX], "steps": steps, "batch": batch, "lr": lr, "seed": seed,
        "reference_force_rms_eV_per_A": float(forces[n_train:].pow(2).mean().sqrt()),
        "held_out": errors, "train_seconds": round(time.monotonic() - started, 1),
        "torch": str(torch.__version__),
    }
    log(f"train_student: held-out ({n_test} configurations): force RMSE {errors['force_rmse_eV_per_A']:.4f} eV/Å "
        f"({100 * errors['force_rmse_relative']:.1f}% of the RMS force), "
        f"force MAE {errors['force_mae_eV_per_A']:.4f} eV/Å, energy MAE {errors['energy_mae_eV']:.4f} eV")
    if out is not None:
        torch.save({"format": FORMAT, "model": model_class.__name__, "config": config,
                    "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "metadata": metadata}, out)
        log(f"train_student: wrote {out} ({Path(out).stat().st_size / 1e6:.2f} MB)")
    return model, metadata


def load_student(path):
    """A trained student: (its model, SchNet or PaiNN as the file says, in eval mode, float32, CPU;
    the file's metadata with the model's ``config``)."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") not in READABLE_FORMATS:
        found = saved.get("format") if isinstance(saved, dict) else None
        raise ValueError(f"load_student: {path} is not a student file of a format this code reads "
                         f"({', '.join(READABLE_FORMATS)}; the file's: {found!r})")
    classes = {cls.__name__: cls for cls in MODELS.values()}
    if saved.get("model") not in classes:
        raise ValueError(f"load_student: {path} holds a {saved.get('model')!r}, not one of {sorted(classes)}")
    model = classes[saved["model"]](**saved["config"])
    model.load_state_dict(saved["state_dict"])
    return model.eval(), {**saved["metadata"], "config": saved["config"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="schnet")
    parser.add_argument("--out", type=Path, default=None, help="default: the model's committed student file")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing file (the committed student)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--interactions", type=int, default=3)
    parser.add_argument("--norm-eps", type=float, default=None,
                        help="PaiNN: added under the square root of |V v| (default: the model's, 1e-8)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    require_ranges(parser, args, positive=("lr",), at_least_one=("hidden", "interactions", "steps", "batch"))
    try:
        student_config(args.model, norm_eps=args.norm_eps)
    except ValueError as error:
        parser.error(str(error))
    out = args.out or STUDENT_PATHS[args.model]
    if out.exists() and not args.overwrite:
        parser.error(f"{out} exists (the committed student, by default); pass --overwrite to replace it, or --out "
                     "for another file (the committed PaiNN student was trained with --norm-eps 1e-2)")
    train(out, model=args.model, hidden=args.hidden,
          num_interactions=args.interactions, norm_eps=args.norm_eps, steps=args.steps, batch=args.batch,
          lr=args.lr, seed=args.seed)


if __name__ == "__main__":
    main()
