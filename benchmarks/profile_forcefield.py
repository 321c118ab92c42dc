"""Where the GPU time of one energy+forces call of mirage's fused force fields goes: every kernel
of mirage.ff.optimize(SchNet / PaiNN) on benzene and the 3,000-atom box, by category, from
torch.profiler. Graphs are off here (the profiler sees the kernels one by one; a CUDA graph
replays the same ones, each costing a couple of µs even when it has nothing to do, which is
why the kernel count matters as much as their time for small molecules).

    python benchmarks/profile_forcefield.py [--top 15] [--systems benzene box3k] [--models schnet painn]
"""

from __future__ import annotations

import argparse

import torch

import mirage.ff
from bench_forcefield import MODEL_CONFIG, MODELS, energy_and_forces, make_system
from harness import kernel_times, print_kernel_report

CATEGORIES = [  # first match wins: (category, substrings of the kernel name)
    ("mirage neighbor list", ("neighbor", "cub::", "radixsort", "scan")),
    ("mirage message passing", ("message_passing", "pair_product")),
    ("mirage radial basis", ("radial_basis",)),
    ("gemm", ("gemm", "cutlass", "cublas", "nvjet", "splitk")),
    ("scatter/gather/index", ("index", "scatter", "gather", "embedding")),
    ("reductions", ("reduce",)),
    ("copies/fill", ("copy", "cat", "fill", "memset", "stack")),
]


def category(name: str) -> str:
    lowered = name.lower()
    for label, keys in CATEGORIES:
        if any(k in lowered for k in keys):
            return label
    return "other elementwise"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--systems", nargs="+", default=["benzene", "box3k"])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--warmup", type=int, default=50, help="calls before the profiled one")
    opts = parser.parse_args()
    device = torch.device("cuda")
    for model_name in opts.models:
        torch.manual_seed(0)
        fused = mirage.ff.optimize(MODELS[model_name](**MODEL_CONFIG).to(device))
        for system_name in opts.systems:
            system = make_system(system_name, False, device)

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
            print_kernel_report(f"{model_name} {system_name} ({system['pos'].shape[0]} atoms, "
                                f"{int(fused.num_pairs.item())} pairs), energy+forces, graphs off; "
                                f"one call by CUDA events: {start.elapsed_time(end) / 10:.3f} ms",
                                kernels, category, opts.top)


if __name__ == "__main__":
    main()
