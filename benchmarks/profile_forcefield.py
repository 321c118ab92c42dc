"""Where the GPU time of one energy+forces call of mirage's fused force fields goes: every kernel
of mirage.ff.optimize(SchNet / PaiNN) on benzene and the 3,000-atom box, by category, from
torch.profiler. Graphs are off here (the profiler sees the kernels one by one; a CUDA graph
replays the same ones, each costing a couple of µs even when it has nothing to do, which is
why the kernel count matters as much as their time for small molecules).

    python benchmarks/profile_forcefield.py [--top 15] [--systems benzene,box3k] [--models schnet,painn]
    python benchmarks/profile_forcefield.py --parts | --whole-model | --fused-interactions
    python benchmarks/profile_forcefield.py --md [--models schnet,painn]

--md lists the kernels of a mirage.ff.md replay on benzene as the CUDA graph runs them (the profiler
sees a graph's kernels): each kernel's start, duration and the gap before it, and the time a step.
There the launches between kernels count, which a profile with graphs off cannot show.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter

import torch
import torch.nn.functional as F

import mirage.ff
from bench_forcefield import MODEL_CONFIG, MODELS, SYSTEMS, energy_and_forces, make_system, parse_list
from harness import categorizer, kernel_times, print_kernel_report, time_in_graph

CATEGORIES = [  # first match wins: (category, substrings of the lower-cased kernel name)
    ("mirage neighbor list", ("neighbor", "cub::", "radixsort", "scan")),
    ("mirage sender order, pair vectors", ("sender", "scatter_pairs", "check_order", "pair_vectors")),
    # PaiNN's kernels are named after their params (VectorMessagePassingParams); SchNet's table
    # of the filter network belongs to radial_cfconv.
    ("mirage message passing", ("message_passing", "messagepassing", "pair_product", "cfconv", "filter_table")),
    ("mirage radial basis", ("radial_basis",)),
    ("mirage painn update", ("painnupdate",)),
    ("mirage whole-model kernels", ("schnet_energy", "schnet_filters", "painn_energy", "painn_transpose")),
    ("gemm (cuBLAS, mirage::linear)", ("gemm", "cutlass", "cublas", "nvjet", "splitk", "linear_kernel")),
    ("mirage finish passes", ("finish_kernel",)),
    ("scatter/gather/index", ("index", "scatter", "gather", "embedding")),
    ("reductions", ("reduce",)),
    ("copies/fill", ("copy", "cat", "fill", "memset", "stack")),
]

category = categorizer(CATEGORIES, "other elementwise")


def grads_of(fn, *leaves):
    """fn's outputs and their gradients w.r.t. leaves (a forward + first backward, as forces do)."""
    leaves = [t.detach().requires_grad_() for t in leaves]
    outputs = fn(*leaves)
    outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
    return torch.autograd.grad([o.sum() for o in outputs], leaves)


def time_parts(system, hidden: int = 128, layers: int = 3, num_rbf: int = 20) -> None:
    """µs per call (inside a CUDA graph of 20 calls) of each stage of a fused energy+forces on
    this system, alone: where the time goes when the profiler's kernel sum is not to be trusted."""
    import mirage

    pos, cell, pbc = system["pos"], system["cell"], system["pbc"]
    n = pos.shape[0]
    out = mirage.ops.neighbor_list(pos, 5.0, cell, pbc, max_pairs=max(n * (n - 1), 1) if cell is None else 64 * n)
    count = int(out.num_pairs.item())
    capacity = count + 64
    out = mirage.ops.neighbor_list(pos, 5.0, cell, pbc, max_pairs=capacity)
    pairs, distances = out.pairs, out.distances
    i, j = pairs[0], pairs[1]
    g = torch.Generator(device=pos.device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=pos.device)  # noqa: E731
    x, w = rand(n, hidden), rand(capacity, hidden)
    phi, w3, v, dirs = rand(n, 3 * hidden), rand(capacity, 3 * hidden), rand(n, 3, hidden), rand(capacity, 3)
    w1, w2 = rand(layers, num_rbf, hidden), rand(layers, hidden, hidden)
    rbf = mirage.ops.radial_basis(distances, "gaussian", num_rbf, 5.0, "none")
    b, filters = rand(layers, hidden), rand(layers, capacity, hidden)
    envelope = torch.rand(capacity, generator=g, device=pos.device)
    fw1, fw2 = rand(hidden, num_rbf) / num_rbf**0.5, rand(hidden, hidden) / hidden**0.5

    def cfconv(tf32):
        return lambda: grads_of(lambda a, r, e: mirage.ops.cfconv(a, r, e, pairs, fw1, b[0], fw2, b[0],
                                                                  "shifted_softplus", tf32=tf32), x, rbf, envelope)

    parts = {
        "neighbor_list (auto)": lambda: mirage.ops.neighbor_list(pos, 5.0, cell, pbc, max_pairs=capacity),
        "neighbor_list (direct)": lambda: mirage.ops.neighbor_list(pos, 5.0, cell, pbc, max_pairs=capacity,
                                                                   method="direct"),
        "radial_basis fwd+bwd": lambda: grads_of(
            lambda d: mirage.ops.radial_basis(d, "gaussian", num_rbf, 5.0, "none"), distances),
        f"filter GEMMs fwd+bwd (x{layers}), batched bmm": lambda: grads_of(
            lambda r: torch.bmm(torch.bmm(r.expand(layers, -1, -1), w1), w2), rbf),
        f"filter GEMMs fwd+bwd (x{layers}), F.linear per layer with bias": lambda: grads_of(
            lambda r: [F.linear(F.linear(r, w1[t].T, b[t]), w2[t].T, b[t]) for t in range(layers)], rbf),
        f"shifted softplus fwd+bwd on [{layers}, P, {hidden}]": lambda: grads_of(
            lambda h: F.softplus(h) - math.log(2.0), filters),
        "pair vectors fwd+bwd, index_select": lambda: grads_of(
            lambda r: torch.linalg.vector_norm(
                (lambda e: e[1] - e[0])(r.index_select(0, pairs.view(-1)).view(2, -1, 3)), dim=-1), pos),
        "pair vectors fwd+bwd, advanced indexing": lambda: grads_of(
            lambda r: torch.linalg.vector_norm(r[pairs[1]] - r[pairs[0]], dim=-1), pos),
        "message_passing fwd": lambda: mirage.ops.message_passing(x, w, pairs),
        "message_passing fwd+bwd": lambda: grads_of(lambda a, b: mirage.ops.message_passing(a, b, pairs), x, w),
        "index_add composite fwd+bwd": lambda: grads_of(
            lambda a, b: torch.zeros_like(a).index_add_(0, i, a[j] * b), x, w),
        "cfconv fwd+bwd (one layer, float32: 3xTF32)": cfconv(False),
        "cfconv fwd+bwd (one layer, TF32)": cfconv(True),
        "vector_message_passing fwd": lambda: mirage.ops.vector_message_passing(phi, w3, v, dirs, pairs),
        "vector_message_passing fwd+bwd": lambda: grads_of(
            lambda *t: mirage.ops.vector_message_passing(*t, pairs), phi, w3, v, dirs),
    }
    print(f"\n== stages alone, {system['name']} ({n} atoms, {count} pairs, capacity {capacity}): "
          "µs per call in a CUDA graph of 20 calls")
    for name, fn in parts.items():
        print(f"   {time_in_graph(lambda: fn(), [()], calls=20, repeats=5):9.1f}  {name}")


def time_fused_interactions(system_name: str = "box3k") -> None:
    """mirage's SchNet energy+forces (a CUDA graph of 10 calls, µs) with its interactions as
    mirage::radial_cfconv (where the GPU takes it), mirage::cfconv and batched filter GEMMs +
    message_passing (SchNet.radial_interactions, fused_interactions), with TF32 off and on,
    alternating in one process; the forces' difference from the first."""
    from mirage.ff.precision import matmul_precision

    device = torch.device("cuda")
    torch.manual_seed(0)
    fused = mirage.ff.optimize(MODELS["schnet"](**MODEL_CONFIG).to(device)).eval()
    system = make_system(system_name, False, device)

    def call():
        return energy_and_forces(lambda p: fused(system["z"], p, system["cell"], system["pbc"]), system["pos"])

    call()
    print(f"\n== SchNet {system_name} ({int(fused.num_pairs.item())} pairs), energy+forces in a CUDA graph of 10 calls")
    reference = None
    for round_ in range(2):
        for interactions, fused_on, radial in (("batched filters", False, False), ("cfconv", True, False),
                                               ("radial_cfconv", True, True)):
            for precision in ("fp32", "tf32"):
                fused.fused_interactions, fused.radial_interactions = fused_on, radial
                with matmul_precision(precision):
                    us = time_in_graph(call, [()], calls=10, repeats=5)
                    _, forces = call()
                reference = forces.double() if reference is None else reference
                difference = ((forces.double() - reference).norm() / reference.norm()).item()
                print(f"   round {round_}  {interactions:16s} {precision}  {us:8.1f} µs   forces vs the first "
                      f"{difference:.1e} (relative)")
    del fused.fused_interactions, fused.radial_interactions


def time_whole_model(name: str, sizes=(12, 16, 18, 20, 24, 48, 96)) -> None:
    """µs per energy+forces (a CUDA graph of 20 calls) of mirage's model `name` in eval mode on
    random molecules at liquid density (open boundaries, 0.1 atoms/Å^3): its one-op path
    (mirage::schnet_energy, mirage::painn_energy) against the layer-by-layer path, which places
    the model's whole_model_max_pairs and whole_model_max_atoms (with MIRAGE_CLUSTER_LIMIT=1 the op
    runs as one block, as below sm_90: its one_block_max_pairs and one_block_max_atoms)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    fused = mirage.ff.optimize(MODELS[name](**MODEL_CONFIG).to(device)).eval()
    print(f"\n{name} eval, energy+forces in a CUDA graph of 20 calls (µs)")
    print(f"{'atoms':>6} {'capacity':>9} {'one op':>11} {'layers':>8}")
    for n in sizes:
        radius = (3 * n / (4 * math.pi * 0.1)) ** (1 / 3)
        points = torch.randn(max(8 * n, 64), 3, dtype=torch.float64)  # about 30% fall in the ball
        points = points[points.norm(dim=1) < 1.2][:n] * radius / 1.2  # uniform enough in a ball
        assert points.shape[0] == n, "too few draws in the ball"
        positions = points.to(device, torch.float32)
        z = torch.randint(1, 10, (positions.shape[0],), device=device)
        fused.max_pairs = None
        fused(z, positions)  # chooses the capacity eagerly
        times = []
        for limit in (1 << 30, 0):
            fused.whole_model_max_pairs = fused.whole_model_max_atoms = limit
            fused.one_block_max_pairs = fused.one_block_max_atoms = limit
            times.append(time_in_graph(lambda: energy_and_forces(lambda q: fused(z, q), positions), [()],
                                       calls=20, repeats=5))
        print(f"{positions.shape[0]:>6} {fused.max_pairs:>9} {times[0]:>11.1f} {times[1]:>8.1f}")
    del fused.whole_model_max_pairs, fused.whole_model_max_atoms, fused.one_block_max_pairs, fused.one_block_max_atoms


def md_timeline(model_name: str, steps: int = 10, listed: int = 40, device: str = "cuda") -> None:
    """One replay of `steps` steps of mirage.ff.md (benzene, the trained student) under
    torch.profiler: the first `listed` device events (the replay's state copies, then its steps),
    and the time a step: the spacing of a kernel that runs once a step."""
    import ase.units
    from torch.profiler import ProfilerActivity, profile

    from bench_forcefield import ase_atoms, md_weights, sync, thermalize
    from mirage.ff.md import VelocityVerlet

    device = torch.device(device)
    system = make_system("benzene", False, device)
    torch.manual_seed(0)
    model, weights = md_weights(model_name, MODELS[model_name](**MODEL_CONFIG).to(device).eval(), system)
    dynamics = VelocityVerlet(mirage.ff.optimize(model), thermalize(ase_atoms(system)), 0.5 * ase.units.fs,
                              steps_per_replay=steps, device=str(device), progress_every=None)
    dynamics.run(2 * steps)  # capture, and the clock up
    sync(device)
    # (On the CPU, where this only checks that the replay runs, the profiler needs an activity of its own.)
    with profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]) as prof:
        dynamics.run(steps)
        sync(device)
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    print(f"\n{model_name} benzene ({weights} weights), mirage.ff.md, one replay of {steps} steps: "
          f"{len(events)} device events")
    last_end = None
    for e in events[:listed]:
        gap = 0.0 if last_end is None else e.time_range.start - last_end
        print(f"  t={e.time_range.start - events[0].time_range.start:9.2f} µs  {e.time_range.elapsed_us():7.2f} µs  "
              f"gap {gap:6.2f}  {e.name[:90]}")
        last_end = e.time_range.end
    once = [name for name, count in Counter(e.name for e in events).items() if count == steps]  # in order of first run
    if once and steps > 1:
        starts = [e.time_range.start for e in events if e.name == once[0]]
        print(f"  a step: {(starts[-1] - starts[0]) / (steps - 1):.1f} µs ({once[0][:60]} to the next)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--systems", default="benzene,box3k", help="comma list of: " + ", ".join(SYSTEMS))
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of: " + ", ".join(MODELS))
    parser.add_argument("--warmup", type=int, default=50, help="calls before the profiled one")
    parser.add_argument("--parts", action="store_true", help="also time each stage alone in a CUDA graph")
    parser.add_argument("--fused-interactions", action="store_true",
                        help="only time SchNet on the 3,000-atom box with its interactions as radial_cfconv, cfconv "
                             "and layers, TF32 off and on")
    parser.add_argument("--whole-model", action="store_true",
                        help="only time each model's one-op path against its layers over molecule sizes")
    parser.add_argument("--atoms", default="12,16,18,20,24,48,96",
                        help="--whole-model: comma list of molecule sizes (atoms)")
    parser.add_argument("--md", action="store_true",
                        help="only list the kernels of a mirage.ff.md replay on benzene, as its CUDA graph runs them")
    opts = parser.parse_args()
    opts.systems = parse_list(opts.systems, SYSTEMS, "systems", parser)  # as bench_forcefield.py takes them
    opts.models = parse_list(opts.models, MODELS, "models", parser)
    device = torch.device("cuda")
    if opts.md:
        for name in opts.models:
            md_timeline(name)
        return
    if opts.whole_model:
        for name in opts.models:
            time_whole_model(name, [int(n) for n in opts.atoms.split(",")])
        return
    if opts.fused_interactions:
        time_fused_interactions()
        return
    if opts.parts:
        for system_name in opts.systems:
            time_parts(make_system(system_name, False, device))
    for model_name in opts.models:
        torch.manual_seed(0)
        # Eval mode, as the benchmark and MD run it (the one-kernel and cfconv paths).
        fused = mirage.ff.optimize(MODELS[model_name](**MODEL_CONFIG).to(device)).eval()
        for system_name in opts.systems:
            system = make_system(system_name, False, device)
            fused.max_pairs = None  # a capacity chosen for this system, not kept from the last one

            def call(positions):
                return energy_and_forces(lambda p: fused(system["z"], p, system["cell"], system["pbc"]), positions)

            # A long warm-up: the GPU idles at a low clock after the build, and the first calls
            # would be timed at it.
            kernels = kernel_times(call, system["pos"], warmup=opts.warmup)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                call(system["pos"])
            end.record()
            torch.cuda.synchronize()
            with torch.no_grad():
                forward_us = time_in_graph(lambda: fused(system["z"], system["pos"], system["cell"], system["pbc"]),
                                           [()], calls=20, repeats=5)
            both_us = time_in_graph(lambda: call(system["pos"]), [()], calls=20, repeats=5)
            print(f"\n{model_name} {system_name} in a CUDA graph of 20 calls: energy {forward_us:.1f} µs, "
                  f"energy+forces {both_us:.1f} µs")
            print_kernel_report(f"{model_name} {system_name} ({system['pos'].shape[0]} atoms, "
                                f"{int(fused.num_pairs.item())} pairs), energy+forces, graphs off; "
                                f"one call by CUDA events: {start.elapsed_time(end) / 10:.3f} ms",
                                kernels, category, opts.top)


if __name__ == "__main__":
    main()
