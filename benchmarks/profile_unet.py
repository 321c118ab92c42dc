"""Where the GPU time of one SD-1.5-shaped U-Net forward goes (fp16, batch 2, channels_last):
kernels of the mirage-optimized model and of torch.compile's, by category, from torch.profiler.

Graphs are off here (the profiler sees the kernels one by one; a graph replays the same ones).

    python benchmarks/profile_unet.py [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import copy

import torch
from torch.profiler import ProfilerActivity, profile

import mirage
from bench_unet import build_unet, to_channels_last, unet_inputs

CATEGORIES = [  # first match wins: (category, substrings of the kernel name)
    ("triton (fused elementwise/norms)", ("triton",)),  # inductor names them after the ops they fuse
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("conv", ("fprop", "conv", "dgrad")),  # cuDNN's implicit GEMMs say "fprop" before "gemm"
    ("gemm", ("gemm", "cutlass", "cublas", "nvjet")),
    ("mirage norms/geglu", ("mirage",)),
    ("copies/layout", ("copy", "cat", "transpose", "permute", "upsample")),
]


def category(name: str) -> str:
    lowered = name.lower()
    for label, keys in CATEGORIES:
        if any(k in lowered for k in keys):
            return label
    return "other elementwise/reduction"


def kernel_times(fn, args, kwargs):
    for _ in range(3):
        fn(*args, **kwargs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args, **kwargs)
        torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0]


def report(label: str, kernels, top: int) -> None:
    total = sum(t for _, t in kernels)
    print(f"\n== {label}: {len(kernels)} kernels, {total / 1e3:.2f} ms of GPU time")
    by_cat = collections.defaultdict(lambda: [0.0, 0])
    for name, t in kernels:
        entry = by_cat[category(name)]
        entry[0] += t
        entry[1] += 1
    for cat, (t, n) in sorted(by_cat.items(), key=lambda kv: -kv[1][0]):
        print(f"   {t / 1e3:7.3f} ms  {100 * t / total:5.1f}%  {n:4d} kernels  {cat}")
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for name, t in kernels:
        by_name[name][0] += t
        by_name[name][1] += 1
    print(f"   top {top} kernels:")
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"   {t / 1e3:7.3f} ms x{n:3d}  {name[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=25)
    opts = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    model = build_unet()
    args, kwargs = unet_inputs(2, torch.float16)
    args = to_channels_last(args)
    with torch.inference_mode():
        fp16 = copy.deepcopy(model).half().to(memory_format=torch.channels_last)
        report("torch.compile (default mode)", kernel_times(torch.compile(fp16), args, kwargs), opts.top)
        fast = mirage.optimize(model, dtype=torch.float16, cuda_graph=False, verbose=False)
        report("mirage.optimize (graphs off)", kernel_times(fast, args, kwargs), opts.top)


if __name__ == "__main__":
    main()
