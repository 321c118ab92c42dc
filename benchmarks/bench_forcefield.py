"""Force-field benchmark of issue 4: the reference SchNet- and PaiNN-style models of
examples/forcefield/models.py (hidden 128, 3 interactions, 20 radial basis functions, cutoff
5 A, float32, random weights from a fixed seed) on benzene (12 atoms), a periodic water-like box
of 3,000 atoms (~130k pairs) and one of ~100,000 atoms, side by side in one process:

  eager        the model as written (radius graph from all pairwise distances + nonzero)
  compile      torch.compile(model) (default mode), forces by torch.autograd.grad outside it, as
               a user compiles a model (compiling the energy+forces function instead made the
               harness's own requires_grad_ a graph break)
  compile-ro   the same with mode="reduce-overhead" (CUDA graphs where PyTorch can use them; the
               reference's nonzero makes its shapes data-dependent)
  eager+graph  what a user would hand-write to use a CUDA graph: the pair list computed once
               outside with the reference's own radius_graph, the rest of the model (the same
               modules, the same math, written out below in static_pair_energy) captured with
               that static pair list. Valid only while the pairs do not change, which is why it
               is a peer and not a product. Where radius_graph does not fit in memory the pair
               list comes from mirage.ops.neighbor_list instead (said in the notes).
  mirage       mirage.ff.optimize(model), energy+forces captured with mirage.graphs.capture,
               the neighbor list rebuilt inside the graph on every call

Every peer computes energy and forces = -dE/dpositions (torch.autograd.grad) for new positions
on every call (small jitters of the system, rotated). ms = median over repeats of CUDA-event
timings of many back-to-back calls, the host work of each call included ("call"). For the
graphed peers also "device": the same calls queued behind a GPU sleep, so only GPU time counts.
Force error: each peer's forces at the unjittered positions against the same model in float64
(max abs and RMS over all components, eV/A). MD: steps/s of mirage.ff.md.VelocityVerlet (K
steps per graph replay) and of ASE's VelocityVerlet driving mirage.ff.Calculator (Python
included), counted over wall time, and ns/day at a 0.5 fs time step; on benzene both models run
their MD with the trained students' weights, so the molecule stays bound (see md_weights).

    python benchmarks/bench_forcefield.py [--models schnet,painn] [--systems benzene,box3k,box100k]
        [--peers eager,compile,compile-ro,eager+graph,mirage] [--precision fp32|tf32|bf16-mixed] [--no-md]
        [--json out.json] [--quick]

--precision (default fp32) holds for every peer alike: fp32 runs float32 matmuls with TF32 off;
tf32 lets matmuls (and mirage's filter products) take TF32; bf16-mixed runs each peer's
energy+forces call under torch.autocast(bfloat16) (mirage.ff.Calculator autocasts the forward
only; the backward runs in the forward's dtypes either way). The force errors then say what the
precision costs; the MD drivers take the calculator's option of the same name.

--quick: hidden 16 and tiny boxes (24 and 81 atoms), short timings, K=2 for MD; runs on the CPU
(the graphed peers then report n/a, mirage runs eagerly), for the smoke test. Peers that fail
report the error text in their cell; peers whose code is missing report "unavailable: <import
error>"; the run goes on either way.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import math
import os
import platform
import statistics
import sys
import time
import traceback

import torch

from harness import capture_graph, code_commit, device_facts, print_table, write_json

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from forcefield.benzene import benzene  # noqa: E402
from forcefield.models import PaiNN, SchNet, radius_graph  # noqa: E402
from forcefield.pair_energy import atom_energies  # noqa: E402

PEERS = ("eager", "compile", "compile-ro", "eager+graph", "mirage")
PRECISIONS = ("fp32", "tf32", "bf16-mixed")  # mirage.ff.precision.PRECISIONS (mirage is imported only where needed)
# mirage runs before the hand-made graph: a failed capture there must not take mirage's row with it.
RUN_ORDER = ("eager", "compile", "compile-ro", "mirage", "eager+graph")
MODELS = {"schnet": SchNet, "painn": PaiNN}
CUTOFF = 5.0
MODEL_CONFIG = dict(hidden=128, num_interactions=3, num_rbf=20, cutoff=CUTOFF)
QUICK_MODEL_CONFIG = dict(hidden=16, num_interactions=3, num_rbf=8, cutoff=CUTOFF)
# Water-like boxes: molecules (O + 2 H, random orientations) on a jittered cubic lattice. The
# spacing gives 0.083 atoms/A^3, ~43 neighbours within 5 A: ~130k pairs for 3,000 atoms.
SPACING = 3.3
OH_BOND, HOH_ANGLE = 0.9572, math.radians(104.52)
# molecules per box side: (full run, --quick)
BOXES = {"box3k": (10, 2), "box100k": (32, 3)}
SYSTEMS = ("benzene",) + tuple(BOXES)
MD_SYSTEMS = ("benzene", "box3k")
MD_REPLAY_STEPS = (10, 50)
QUICK_MD_REPLAY_STEPS = (2,)
MD_WRITE_EVERY = 1000  # steps between mirage.ff.md's records (each one reads the state back to the host)
TIMESTEP_FS = 0.5
# A: the rotated inputs. Pairs it moves across the cutoff have a cosine-cutoff weight near 1e-5,
# so eager+graph's static pair list stays valid in effect.
JITTER = 0.005
INPUT_SETS = 4
MEMORY_MARGIN = 0.85  # share of the free memory a peer may plan to use


def log(message: str) -> None:
    print(f"[bench_forcefield {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Skip(Exception):
    """A peer that cannot run here (not a failure): its reason goes in the table as n/a."""


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def human_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 1e3:.3g} kB"


def free_bytes(device) -> int:
    if device.type == "cuda":
        release()
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def radius_graph_bytes(n_atoms: int, periodic: bool, dtype: torch.dtype) -> int:
    """Peak bytes of the reference radius_graph: the [S, N, N, 3] differences, [S, N, N]
    distances, the bool mask and nonzero's int32 scratch, S = 27 images in a periodic box."""
    images = 27 if periodic else 1
    item = torch.empty((), dtype=dtype).element_size()
    return images * n_atoms * n_atoms * (3 * item + item + 1 + 4)


# ------------------------------------------------------------------------------------ systems
def water_box(per_side: int, seed: int = 0):
    """(atomic_numbers, positions, cell) of per_side^3 water-like molecules, float64, wrapped."""
    g = torch.Generator().manual_seed(seed)
    m = per_side**3
    axis = torch.arange(per_side, dtype=torch.float64)
    sites = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), dim=-1).reshape(m, 3)
    oxygens = (sites + 0.5 + 0.1 * (torch.rand(m, 3, generator=g, dtype=torch.float64) - 0.5)) * SPACING
    half = HOH_ANGLE / 2
    local = torch.tensor([[math.sin(half), math.cos(half), 0.0], [-math.sin(half), math.cos(half), 0.0]],
                         dtype=torch.float64) * OH_BOND  # [2, 3]
    q, r = torch.linalg.qr(torch.randn(m, 3, 3, generator=g, dtype=torch.float64))
    rotations = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]  # uniform random
    hydrogens = oxygens[:, None, :] + local[None] @ rotations.transpose(1, 2)  # [m, 2, 3]
    positions = torch.cat([oxygens[:, None, :], hydrogens], dim=1).reshape(3 * m, 3)
    numbers = torch.tensor([8, 1, 1], dtype=torch.long).repeat(m)
    cell = torch.eye(3, dtype=torch.float64) * (per_side * SPACING)
    positions = positions.remainder(per_side * SPACING)
    return numbers, positions, cell


def make_system(name: str, quick: bool, device):
    """dict(z, pos (float32), pos64, cell, cell64, pbc) on device; cell/pbc None for benzene."""
    if name == "benzene":
        z, pos64 = benzene(dtype=torch.float64)
        cell64 = pbc = None
    else:
        z, pos64, cell64 = water_box(BOXES[name][1 if quick else 0])
        pbc = torch.ones(3, dtype=torch.bool)
    to = lambda t, dtype=None: None if t is None else t.to(device=device, dtype=dtype or t.dtype)  # noqa: E731
    return dict(name=name, z=to(z), pos=to(pos64, torch.float32), pos64=to(pos64), cell=to(cell64, torch.float32),
                cell64=to(cell64), pbc=to(pbc), periodic=cell64 is not None)


def jittered(system, count: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    base = system["pos"]
    return [base + (JITTER * torch.randn(base.shape, generator=g)).to(base.device) for _ in range(count)]


def pair_list(system):
    """(i, j, shift [P, 3] float64) of the system's positions from mirage.ops.neighbor_list, the
    capacity grown until it suffices (outside any graph: the count is read on the host)."""
    import mirage

    pos = system["pos"]
    n = pos.shape[0]
    if system["periodic"]:
        capacity = int(1.5 * n * 4 / 3 * math.pi * CUTOFF**3 * 3 / SPACING**3) + 1024
    else:
        capacity = max(n * (n - 1), 1)
    while True:
        out = mirage.ops.neighbor_list(pos, CUTOFF, system["cell"], system["pbc"], max_pairs=capacity)
        count = int(out.num_pairs.item())
        if count < 0:
            raise RuntimeError("mirage.ops.neighbor_list reported invalid input (num_pairs = -1)")
        if count <= capacity:
            break
        capacity = int(count * 1.1) + 1
    i, j = out.pairs[0, :count], out.pairs[1, :count]
    return i, j, lattice_shift(out.shifts[:count], system)


def lattice_shift(shift, system):
    """shift rounded to the nearest lattice vector, in float64 (the float32 image offsets of a
    wrapped box carry rounding that the float64 reference must not inherit)."""
    if not system["periodic"]:
        return torch.zeros(shift.shape, dtype=torch.float64, device=shift.device)
    cell64 = system["cell64"]
    return torch.round(shift.double() @ torch.linalg.inv(cell64)) @ cell64


def reference_pairs(system):
    """(i, j, shift float64) from the reference's own radius_graph (float32, as the model runs)."""
    with torch.no_grad():
        i, j, vec = radius_graph(system["pos"], CUTOFF, system["cell"], system["pbc"])
        shift = vec.double() - (system["pos64"][j] - system["pos64"][i])
    return i, j, lattice_shift(shift, system)


# ------------------------------------------------------------------------- the static-pair peer
def static_pair_energy(model, atomic_numbers, positions, i, j, shift):
    """The reference model's energy with a given pair list (i, j, image shift [P, 3]): the body
    of SchNet.forward / PaiNN.forward after radius_graph, on the same modules
    (examples/forcefield/pair_energy.py), because the reference builds its pairs with nonzero,
    which a CUDA graph cannot capture."""
    return atom_energies(model, atomic_numbers, i, j, positions[j] + shift - positions[i]).sum()


def energy_and_forces(energy_fn, positions):
    """(energy, forces = -dE/dpositions) of energy_fn(positions); works under no_grad too."""
    with torch.enable_grad():
        positions = positions.detach().requires_grad_(True)
        energy = energy_fn(positions)
        (grad,) = torch.autograd.grad(energy, positions)
    return energy.detach(), -grad


def autocast_for(precision, device):
    """torch.autocast(bfloat16) for "bf16-mixed", nothing otherwise (TF32 is a global setting)."""
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------- timing
def time_calls(fn, input_sets, device, target_s: float, repeats: int) -> tuple[float, float]:
    """(median ms per call, warm-up s) of fn(positions): `repeats` runs of back-to-back calls
    (cycling through input_sets), each run timed as a whole (CUDA events on the GPU), host work
    included; the warm-up (each input set twice) holds torch.compile's recompilations."""
    t0 = time.perf_counter()
    for inputs in input_sets * 2:
        fn(inputs)
    sync(device)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fn(input_sets[0])
    sync(device)
    calls = max(1, min(200, int(target_s / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for k in range(calls):
                fn(input_sets[k % len(input_sets)])
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            for k in range(calls):
                fn(input_sets[k % len(input_sets)])
            times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times), warmup_s


@functools.lru_cache(maxsize=None)
def _sleep_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def time_queued(fn, input_sets, calls: int, repeats: int) -> float | None:
    """Median device ms per call: the calls are queued behind a GPU sleep that outlasts their
    host work, so the events see the GPU run them back to back. Repeats in which the host did not
    finish queueing before the sleep ended are dropped; None if that happened every time."""
    cycles_per_ms = _sleep_cycles_per_ms()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k in range(calls):
        fn(input_sets[k % len(input_sets)])
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    sleep_ms = 2 * host_ms + 5
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        torch.cuda._sleep(int(cycles_per_ms * sleep_ms))
        start.record()
        for k in range(calls):
            fn(input_sets[k % len(input_sets)])
        end.record()
        queued_ms = (time.perf_counter() - t0) * 1e3
        end.synchronize()
        if queued_ms < 0.8 * sleep_ms:
            times.append(start.elapsed_time(end) / calls)
    return statistics.median(times) if times else None


def graph_floor_ms(device, opts) -> float:
    """ms per call of the least a graphed peer can cost: copy 12 positions in, replay a graph of
    one small kernel (the launch-latency floor that benzene runs into)."""
    static = torch.zeros(12, 3, device=device)
    graph, out = capture_graph(lambda: static * 2.0, lambda: static * 2.0)

    def call(p):
        static.copy_(p)
        graph.replay()
        return out

    inputs = [torch.randn(12, 3, device=device) for _ in range(INPUT_SETS)]
    return time_calls(call, inputs, device, opts.target_s, opts.repeats)[0]


# -------------------------------------------------------------------------------------- peers
class Peer:
    """A peer ready to time: call(positions) -> (energy, forces); first_s: seconds from the start
    of its preparation to its first result; fused, report: mirage's model and report (mirage only)."""

    def __init__(self, call, first_s, fused=None, report=None, graph=None):
        self.call, self.first_s, self.fused, self.report, self.graph = call, first_s, fused, report, graph


def overflow(model) -> int | None:
    """The capacity to grow the fused model to after its last forward, or None when it sufficed
    (the neighbor-capacity protocol of mirage.ff, as the Calculator and the MD driver apply it)."""
    from mirage.ff.capacity import needed_pairs

    return needed_pairs(model)


def mirage_energy_and_forces(fused, system):
    z, cell, pbc = system["z"], system["cell"], system["pbc"]
    return lambda p: energy_and_forces(lambda q: fused(z, q, cell, pbc), p)


def capture_mirage(fused, system):
    """energy+forces of the fused model in one graph (mirage.graphs.capture), after eager calls
    over the base and rotated positions that let the model pick, and if needed grow, its capacity:
    a graph is only valid for the capacity it was recorded with."""
    import mirage.graphs

    ef = mirage_energy_and_forces(fused, system)
    for p in [system["pos"]] + jittered(system, INPUT_SETS):
        ef(p)
        grow = overflow(fused)
        if grow is not None:
            fused.max_pairs = grow
            ef(p)
    if system["pos"].device.type != "cuda":
        return ef
    release()
    return mirage.graphs.capture(ef, system["pos"], copy_outputs=False)


def build_peer(peer, model, system, notes, key) -> Peer:
    z, cell, pbc, device = system["z"], system["cell"], system["pbc"], system["pos"].device
    n = z.shape[0]
    t0 = time.perf_counter()
    if peer in ("eager", "compile", "compile-ro"):
        need = radius_graph_bytes(n, system["periodic"], torch.float32)
        free = free_bytes(device)
        if need > MEMORY_MARGIN * free:
            raise Skip(f"needs {human_bytes(need)} for radius_graph's [{27 if system['periodic'] else 1}, N, N] "
                       f"tensors, {human_bytes(free)} free")
        if peer != "eager":
            torch._dynamo.reset()
            model = torch.compile(model, mode="reduce-overhead" if peer == "compile-ro" else "default")
        call = functools.partial(energy_and_forces, lambda p: model(z, p, cell, pbc))
        call(system["pos"])
        sync(device)
        return Peer(call, time.perf_counter() - t0)
    if peer == "eager+graph":
        if device.type != "cuda":
            raise Skip("needs CUDA (a CUDA graph)")
        need = radius_graph_bytes(n, system["periodic"], torch.float32)
        if need <= MEMORY_MARGIN * free_bytes(device):
            i, j, shift = reference_pairs(system)
        else:
            i, j, shift = pair_list(system)
            notes.append(f"eager+graph on {system['name']}: pair list from mirage.ops.neighbor_list "
                         f"(radius_graph needs {human_bytes(need)})")
        shift = shift.float()
        static_pos = system["pos"].clone()

        def record():
            return energy_and_forces(lambda p: static_pair_energy(model, z, p, i, j, shift), static_pos)

        def warmup():
            # Out of memory shows here, before the capture (a failed capture can leave the
            # process's CUDA state unusable for the peers after it). The graph's private pool
            # cannot reuse the blocks the warm-up leaves cached: hand them back first.
            for _ in range(2):
                record()
            release()

        graph, (energy, forces) = capture_graph(record, warmup)

        def call(p):
            static_pos.copy_(p)
            graph.replay()
            return energy, forces

        call(system["pos"])
        sync(device)
        return Peer(call, time.perf_counter() - t0, graph=graph)
    if peer == "mirage":
        import mirage.ff

        fused = mirage.ff.optimize(model)
        report = str(mirage.ff.report(fused))
        if fused is model:
            notes.append(f"mirage.ff.optimize left {key} alone:\n{report}")
            raise Skip("mirage.ff.optimize left the model alone (its report is in the notes)")
        if device.type != "cuda":
            notes.append(f"mirage on {system['name']}: no CUDA, so eager (no graph)")
        call = capture_mirage(fused, system)
        call(system["pos"])
        sync(device)
        return Peer(call, time.perf_counter() - t0, fused=fused, report=report)
    raise ValueError(f"unknown peer {peer!r}")


def measure_peer(peer, model, system, ref, opts, notes, reports, key):
    """One table row: timings, first-result time, force errors; n/a, unavailable or the error
    text when the peer cannot run."""
    row = dict(peer=peer, status="ok")
    device = system["pos"].device
    inputs = jittered(system, INPUT_SETS)
    runner = None
    try:
        runner = build_peer(peer, model, system, notes, key)
        row["first_s"] = runner.first_s
        if runner.report is not None:
            reports[key] = runner.report
        for _ in range(3):
            row["ms"], row["warmup_s"] = time_calls(runner.call, inputs, device, opts.target_s, opts.repeats)
            if device.type == "cuda" and peer in ("eager+graph", "mirage"):
                calls = max(5, min(100, int(opts.target_s * 1e3 / row["ms"])))
                row["device_ms"] = time_queued(runner.call, inputs, calls, opts.repeats)
            if runner.fused is None:
                break
            grow = overflow(runner.fused)
            if grow is None:
                break
            # A rotated input outgrew the capacity, so the timed replays were invalid: grow, recapture.
            notes.append(f"mirage on {system['name']}: capacity grown to {grow} pairs after timing; timed again")
            runner.fused.max_pairs = grow
            runner.call = capture_mirage(runner.fused, system)
        energy, forces = runner.call(system["pos"])
        energy, forces = energy.detach().double().clone(), forces.detach().double().clone()
        if runner.fused is not None and overflow(runner.fused) is not None:
            raise RuntimeError("the mirage model overflowed its neighbor capacity on the base positions")
        if ref is not None:
            err = forces - ref["forces"]
            row["f_max_err"] = err.abs().max().item()
            row["f_rms_err"] = err.square().mean().sqrt().item()
            row["f_rel_rms_err"] = row["f_rms_err"] / max(ref["f_rms"], 1e-30)
            row["e_abs_err"] = abs(energy.item() - ref["energy"])
    except Skip as skip:
        row["status"] = f"n/a: {skip}"
    except ImportError as error:
        row["status"] = f"unavailable: {first_line(error)}"
    except torch.cuda.OutOfMemoryError as error:
        row["status"] = f"n/a: out of memory ({first_line(error)[:120]})"
    except Exception as error:  # a peer's failure is a result: reported in the table, the run goes on
        traceback.print_exc()
        row["status"] = f"error: {first_line(error)}"
    if row["status"] != "ok":
        log(f"  {peer}: {row['status']}")
    else:
        extra = f", device {row['device_ms']:.4f} ms" if row.get("device_ms") else ""
        errs = f", F max err {row['f_max_err']:.2e}" if "f_max_err" in row else ""
        log(f"  {peer}: {row['ms']:.4f} ms/call{extra}, first result {row['first_s']:.2f} s{errs}")
    del runner
    if peer.startswith("compile"):
        torch._dynamo.reset()
    release()
    return row


def fp64_reference(model, system, notes):
    """Energy and forces of the float64 copy of the model at the base positions, or None."""
    device = system["pos"].device
    model64 = copy.deepcopy(model).double()
    pos64, z = system["pos64"], system["z"]
    try:
        need = radius_graph_bytes(z.shape[0], system["periodic"], torch.float64)
        if need <= MEMORY_MARGIN * free_bytes(device):
            energy, forces = energy_and_forces(lambda p: model64(z, p, system["cell64"], system["pbc"]), pos64)
        else:
            i, j, shift = pair_list(system)
            notes.append(f"float64 reference on {system['name']}: static-pair forward, pairs from "
                         f"mirage.ops.neighbor_list (radius_graph needs {human_bytes(need)})")
            energy, forces = energy_and_forces(lambda p: static_pair_energy(model64, z, p, i, j, shift), pos64)
        ref = dict(energy=energy.item(), forces=forces.detach().clone(), f_rms=forces.square().mean().sqrt().item())
    except torch.cuda.OutOfMemoryError as error:
        notes.append(f"float64 reference on {system['name']}: out of memory, no force errors "
                     f"({first_line(error)[:100]})")
        ref = None
    except Exception as error:
        traceback.print_exc()
        notes.append(f"float64 reference on {system['name']}: {first_line(error)}")
        ref = None
    del model64
    release()
    return ref


# ----------------------------------------------------------------------------------------- MD
def ase_atoms(system):
    import ase

    cell = system["cell64"]
    return ase.Atoms(numbers=system["z"].cpu().numpy(), positions=system["pos64"].cpu().numpy(),
                     cell=None if cell is None else cell.cpu().numpy(), pbc=system["periodic"])


def thermalize(atoms, seed=0):
    """Maxwell-Boltzmann momenta at 300 K (fixed seed), zero total momentum."""
    import numpy as np
    from ase.md import velocitydistribution

    rng = np.random.default_rng(seed)
    if hasattr(velocitydistribution, "thermalize_momenta"):  # ASE >= 3.29
        velocitydistribution.thermalize_momenta(atoms, 300.0, rng=rng)
    else:
        velocitydistribution.MaxwellBoltzmannDistribution(atoms, temperature_K=300.0, rng=rng)
    velocitydistribution.Stationary(atoms)
    return atoms


def steps_per_second(run, multiple: int, device, target_s: float) -> tuple[float, int]:
    """(steps/s, steps timed) of run(steps) over at least target_s of wall time, after a warm-up
    (capture) of 2 * multiple steps."""
    run(2 * multiple)
    sync(device)
    chunk, steps, elapsed = multiple, 0, 0.0
    while elapsed < target_s:
        t0 = time.perf_counter()
        run(chunk)
        sync(device)
        dt = time.perf_counter() - t0
        steps, elapsed = steps + chunk, elapsed + dt
        if dt < target_s / 4:
            chunk *= 2
    return steps / elapsed, steps


def md_weights(model_name, model, system):
    """(the model MD runs, what its weights are). SchNet and PaiNN on benzene at the trained
    students' size take the students' weights (examples/forcefield/benzene_<model>.pt): the
    molecule stays bound, so every step sees all of its pairs, as a real run does. Other systems
    keep their random weights, under which a molecule may fly apart: fewer pairs within the
    cutoff, less work per step than a real run (the table's "pairs end" says how many were left)."""
    if system["name"] != "benzene":
        return model, "random"
    try:
        from forcefield.train_student import STUDENT_PATHS, load_student

        student, _ = load_student(STUDENT_PATHS[model_name])
    except Exception as error:  # the MD still runs, and says why its weights are random
        return model, f"random (student: {first_line(error)})"
    mine, theirs = model.state_dict(), student.state_dict()
    if type(student) is not type(model) or student.cutoff != model.cutoff or mine.keys() != theirs.keys() or any(
            mine[k].shape != theirs[k].shape for k in mine):
        return model, "random (the student has another size)"
    # The student itself, not its state_dict in the model: settings that are not parameters
    # (PaiNN's norm_eps) come with it.
    return student.to(device=next(model.parameters()).device).eval().requires_grad_(False), "trained student"


def measure_md(model_name, model, system, opts):
    """MD steps/s of mirage.ff.md.VelocityVerlet (K steps per replay) and of ASE's VelocityVerlet
    with mirage.ff.Calculator, from a 300 K Maxwell-Boltzmann start (see md_weights)."""
    rows = []
    device = system["pos"].device
    model, weights = md_weights(model_name, model, system)
    fused = None
    drivers = [(f"mirage md K={k}", k) for k in opts.md_replay_steps] + [("ase+calculator", 1)]
    for label, k in drivers:
        row = dict(model=model_name, system=system["name"], atoms=int(system["z"].shape[0]), driver=label,
                   steps_per_replay=k, weights=weights, status="ok")
        try:
            import ase.units
            import mirage.ff

            if fused is None:
                fused = mirage.ff.optimize(model)
            if fused is model:
                raise Skip("mirage.ff.optimize left the model alone")
            atoms = thermalize(ase_atoms(system))
            timestep = TIMESTEP_FS * ase.units.fs
            if label.startswith("mirage md"):
                from mirage.ff.md import VelocityVerlet

                dyn = VelocityVerlet(fused, atoms, timestep, steps_per_replay=k, device=str(device),
                                     precision=opts.precision, progress_every=None)
                run = functools.partial(dyn.run, write_every=MD_WRITE_EVERY)
            else:
                from ase.md.verlet import VelocityVerlet as AseVelocityVerlet

                atoms.calc = mirage.ff.Calculator(fused, device=str(device), precision=opts.precision)
                dyn = AseVelocityVerlet(atoms, timestep)
                run = dyn.run
            rate, steps = steps_per_second(run, k, device, opts.md_seconds)
            # The end state says whether the run stayed sane (random weights promise no physics).
            final = dyn.atoms if label.startswith("mirage md") else atoms
            row.update(steps_per_s=rate, ms_per_step=1e3 / rate, ns_per_day=rate * TIMESTEP_FS * 86400 / 1e6,
                       steps=steps, temperature_end_K=float(final.get_temperature()),
                       pairs_end=int(fused.num_pairs.reshape(-1)[0].item()))
            log(f"  {label}: {rate:.0f} steps/s, {1e3 / rate:.4f} ms/step, {row['ns_per_day']:.1f} ns/day "
                f"({steps} steps; at the end {row['temperature_end_K']:.0f} K, {row['pairs_end']} pairs)")
        except Skip as skip:
            row["status"] = f"n/a: {skip}"
        except ImportError as error:
            row["status"] = f"unavailable: {first_line(error)}"
        except Exception as error:  # reported in the table, the run goes on
            traceback.print_exc()
            row["status"] = f"error: {first_line(error)}"
        if row["status"] != "ok":
            log(f"  {label}: {row['status']}")
        rows.append(row)
        release()
    return rows


# ------------------------------------------------------------------------------------- report
def table_cell(row, key, fmt):
    """A table cell: the number, or a short marker whose full text is in the notes."""
    if row is None:
        return "-"
    if row["status"] != "ok":
        return row["status"].split(":")[0]
    value = row.get(key)
    return "-" if value is None else format(value, fmt)


def print_report(rows, md_rows, systems_info, notes, reports, targets, peers, quick):
    for model_name in dict.fromkeys(r["model"] for r in rows):
        print(f"\n{model_name}: ms per energy+forces (call: host work included; device: GPU time of the same calls)")
        table = []
        for system_name in dict.fromkeys(r["system"] for r in rows if r["model"] == model_name):
            by_peer = {r["peer"]: r for r in rows if r["model"] == model_name and r["system"] == system_name}
            info = systems_info[system_name]
            line = dict(system=system_name, atoms=str(info["atoms"]), pairs=str(info.get("pairs", "?")))
            for peer in peers:
                line[peer] = table_cell(by_peer.get(peer), "ms", ".4f")
            for peer in ("eager+graph", "mirage"):
                line[peer + " dev"] = table_cell(by_peer.get(peer), "device_ms", ".4f")
            mirage_row = by_peer.get("mirage")
            line["x best peer"] = "-" if not mirage_row or mirage_row.get("vs_best_peer") is None \
                else f"{mirage_row['vs_best_peer']:.2f}"
            table.append(line)
        graphed = [p + " dev" for p in ("eager+graph", "mirage") if p in peers]
        keys = ["system", "atoms", "pairs"] + list(peers) + graphed
        print_table(table, [(k, k, "s") for k in keys] + [("x best peer", "mirage x best peer", "s")])

        print(f"\n{model_name}: force error vs float64 (eV/A; rel = RMS error / RMS force); first result: seconds "
              "from the start of preparing the peer (compile, capture, optimize) to its first energy+forces; "
              f"warm-up: {2 * INPUT_SETS} more calls on the rotated inputs (compile's recompilations)")
        table = []
        for r in rows:
            if r["model"] != model_name:
                continue
            table.append(dict(system=r["system"], peer=r["peer"], status=r["status"][:60],
                              fmax=table_cell(r, "f_max_err", ".2e"), frms=table_cell(r, "f_rms_err", ".2e"),
                              frel=table_cell(r, "f_rel_rms_err", ".2e"), eerr=table_cell(r, "e_abs_err", ".2e"),
                              first=table_cell(r, "first_s", ".2f"), warm=table_cell(r, "warmup_s", ".2f")))
        print_table(table, [("system", "system", "s"), ("peer", "peer", "s"), ("fmax", "F max err", "s"),
                            ("frms", "F RMS err", "s"), ("frel", "F rel RMS", "s"), ("eerr", "|E err| eV", "s"),
                            ("first", "first result s", "s"), ("warm", "warm-up s", "s"), ("status", "status", "s")])
    if md_rows:
        print(f"\nMD at {TIMESTEP_FS} fs from 300 K (steps/s over wall time, Python included; ns/day = steps/s x "
              f"{TIMESTEP_FS} fs; mirage md records the state every {MD_WRITE_EVERY} steps)")
        table = [dict(model=r["model"], system=r["system"], atoms=str(r["atoms"]), weights=r["weights"],
                      driver=r["driver"], rate=table_cell(r, "steps_per_s", ".0f"),
                      ms=table_cell(r, "ms_per_step", ".4f"),
                      nsday=table_cell(r, "ns_per_day", ".1f"), temp=table_cell(r, "temperature_end_K", ".0f"),
                      pairs=table_cell(r, "pairs_end", "d"), status=r["status"][:70]) for r in md_rows]
        print_table(table, [("model", "model", "s"), ("system", "system", "s"), ("atoms", "atoms", "s"),
                            ("weights", "weights", "s"), ("driver", "driver", "s"), ("rate", "steps/s", "s"),
                            ("ms", "ms/step", "s"),
                            ("nsday", "ns/day", "s"), ("temp", "T end K", "s"), ("pairs", "pairs end", "s"),
                            ("status", "status", "s")])
    print("\nStatus of every cell that is not a number:")
    for r in rows:
        if r["status"] != "ok":
            print(f"  {r['model']} {r['system']} {r['peer']}: {r['status']}")
    for r in md_rows:
        if r["status"] != "ok":
            print(f"  {r['model']} {r['system']} {r['driver']}: {r['status']}")
    if notes:
        print("\nNotes:")
        for note in dict.fromkeys(notes):
            print(f"  {note}")
    for key, report in reports.items():
        print(f"\nmirage.ff.report ({key}):\n{report}")
    if targets:
        print("\nIssue 4 targets:" + (" (--quick: not the issue's sizes, for the record only)" if quick else ""))
        for t in targets:
            verdict = "n/a" if t["pass"] is None else ("pass" if t["pass"] else "FAIL")
            value = "-" if t["value"] is None else f"{t['value']:.4g}"
            print(f"  {verdict:4s}  {t['name']}: {value} (limit {t['limit']})")


def evaluate_targets(rows, md_rows, peers):
    def get(model, system, peer, key="ms"):
        for r in rows:
            if (r["model"], r["system"], r["peer"]) == (model, system, peer) and r["status"] == "ok":
                return r.get(key)
        return None

    targets = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for system, limit in (("benzene", 0.10), ("box3k", 1.0)):
            if any(r["model"] == model and r["system"] == system for r in rows):
                value = get(model, system, "mirage")
                targets.append(dict(name=f"{model} {system}: mirage ms per energy+forces (call)", value=value,
                                    limit=f"<= {limit}", pass_=None if value is None else value <= limit))
        for system in dict.fromkeys(r["system"] for r in rows if r["model"] == model):
            ours = get(model, system, "mirage")
            others = [v for v in (get(model, system, p) for p in peers if p != "mirage") if v is not None]
            targets.append(dict(name=f"{model} {system}: mirage faster than every peer that ran", value=ours,
                                limit=f"< {min(others):.4g}" if others else "no peer ran",
                                pass_=None if ours is None or not others else ours < min(others)))
    for r in md_rows:
        if r["system"] == "benzene" and r["driver"] == "ase+calculator":
            value = r.get("ms_per_step")
            targets.append(dict(name=f"{r['model']} benzene: ms per ASE VelocityVerlet step with mirage.ff.Calculator",
                                value=value, limit="<= 0.5", pass_=None if value is None else value <= 0.5))
        if r["system"] == "benzene" and r["driver"].startswith("mirage md"):
            value = r.get("steps_per_s")
            targets.append(dict(name=f"{r['model']} benzene: {r['driver']} steps/s", value=value,
                                limit=">= 20000", pass_=None if value is None else value >= 20000))
    for t in targets:
        t["pass"] = t.pop("pass_")
    return targets


# --------------------------------------------------------------------------------------- main
def environment(device) -> dict:
    if device.type == "cuda":
        facts = device_facts()
    else:
        facts = dict(gpu="none (CPU run)", torch=torch.__version__, cuda=torch.version.cuda,
                     python=platform.python_version(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     commit=code_commit())
    try:
        import mirage

        facts["mirage"] = getattr(mirage, "__version__", "?")
    except ImportError as error:
        facts["mirage"] = f"unavailable: {first_line(error)}"
    return facts


def parse_list(text, allowed, what, parser):
    items = [x for x in text.split(",") if x]
    unknown = [x for x in items if x not in allowed]
    if unknown:
        parser.error(f"unknown {what}: {unknown}; choose from {', '.join(allowed)}")
    return items


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of: " + ", ".join(MODELS))
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of: " + ", ".join(SYSTEMS))
    parser.add_argument("--peers", default=",".join(PEERS), help="comma list of: " + ", ".join(PEERS))
    parser.add_argument("--no-md", dest="md", action="store_false", help="skip the MD steps/s measurements")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per peer (median); default 7, quick 2")
    parser.add_argument("--quick", action="store_true", help="tiny boxes and short timings (CPU smoke test)")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS,
                        help="float32 matmuls (fp32, the default), TF32 matmuls (tf32) or autocast to bfloat16 "
                             "(bf16-mixed), for every peer")
    parser.add_argument("--json", help="write the results here")
    opts = parser.parse_args(argv)
    models = parse_list(opts.models, MODELS, "models", parser)
    systems = parse_list(opts.systems, SYSTEMS, "systems", parser)
    peers = [p for p in PEERS if p in parse_list(opts.peers, PEERS, "peers", parser)]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not opts.quick:
        parser.error("no CUDA GPU: the full sizes need one; run with --quick for the CPU smoke test")
    opts.repeats = opts.repeats or (2 if opts.quick else 7)
    opts.target_s = 0.001 if opts.quick else 0.2
    opts.md_seconds = 0.01 if opts.quick else 2.0
    opts.md_replay_steps = QUICK_MD_REPLAY_STEPS if opts.quick else MD_REPLAY_STEPS
    opts.model_config = QUICK_MODEL_CONFIG if opts.quick else MODEL_CONFIG

    facts = environment(device)
    command = " ".join(["python", os.path.relpath(__file__)] + list(sys.argv[1:] if argv is None else argv))
    print(f"{facts['gpu']}, torch {facts['torch']}, CUDA {facts['cuda']}, mirage {facts['mirage']} "
          f"(commit {facts['commit'] or 'unknown'}), {facts['date']}")
    print(f"command: {command}")
    print(f"precision: {opts.precision}")
    if device.type == "cuda":
        # TF32 only where asked for: it changes the force error of every peer.
        torch.backends.cuda.matmul.allow_tf32 = opts.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = opts.precision == "tf32"
        facts["graph_floor_ms"] = graph_floor_ms(device, opts)
        print(f"graph floor (copy 12 positions in + replay a one-kernel graph): {facts['graph_floor_ms']:.4f} ms")
    rows, md_rows, notes, reports, systems_info = [], [], [], {}, {}
    for system_name in systems:
        system = make_system(system_name, opts.quick, device)
        info = dict(atoms=int(system["z"].shape[0]), periodic=system["periodic"])
        if system["periodic"]:
            info["box_A"] = float(system["cell64"][0, 0])
        try:
            info["pairs"] = int(pair_list(system)[0].shape[0])
        except Exception as error:  # the count is informative only
            notes.append(f"pair count of {system_name}: {first_line(error)}")
        systems_info[system_name] = info
        for model_name in models:
            log(f"{model_name} on {system_name} ({info['atoms']} atoms, {info.get('pairs', '?')} pairs)")
            torch.manual_seed(0)
            model = MODELS[model_name](**opts.model_config).to(device).eval().requires_grad_(False)
            ref = fp64_reference(model, system, notes)
            case = []
            for peer in sorted(peers, key=RUN_ORDER.index):
                with autocast_for(opts.precision, device):
                    row = measure_peer(peer, model, system, ref, opts, notes, reports,
                                       f"{model_name} on {system_name}")
                row.update(model=model_name, system=system_name, atoms=info["atoms"])
                case.append(row)
            case.sort(key=lambda r: PEERS.index(r["peer"]))
            timed = [r for r in case if r["status"] == "ok" and r["peer"] != "mirage"]
            best = min(timed, key=lambda r: r["ms"], default=None)
            for r in case:
                r["vs_best_peer"] = best["ms"] / r["ms"] if best and r["status"] == "ok" else None
            rows += case
            if opts.md and system_name in MD_SYSTEMS:
                md_rows += measure_md(model_name, model, system, opts)
            del model, ref
            release()
    targets = evaluate_targets(rows, md_rows, peers)
    print_report(rows, md_rows, systems_info, notes, reports, targets, peers, opts.quick)
    write_json(opts.json, {"device": facts, "command": command, "argv": sys.argv,
                           "config": dict(model=opts.model_config, precision=opts.precision,
                                          timestep_fs=TIMESTEP_FS, jitter_A=JITTER,
                                          repeats=opts.repeats, quick=opts.quick, peers=peers,
                                          md_replay_steps=list(opts.md_replay_steps),
                                          md_write_every=MD_WRITE_EVERY),
                           "systems": systems_info, "rows": rows, "md": md_rows, "targets": targets,
                           "notes": list(dict.fromkeys(notes)), "reports": reports})
    return 0


if __name__ == "__main__":
    sys.exit(main())
