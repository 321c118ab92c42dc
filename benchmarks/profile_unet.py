"""Where the GPU time of one SD-1.5-shaped U-Net forward (or VAE decode) goes (fp16,
channels_last): kernels of the mirage-optimized model and of torch.compile's, by category, from
torch.profiler.

Graphs are off here (the profiler sees the kernels one by one; a graph replays the same ones).

    python benchmarks/profile_unet.py [--model unet|vae] [--batch 2] [--top 25] [--no-compile]
"""

from __future__ import annotations

import argparse
import copy

import torch

import mirage
from bench_unet import MODELS, to_channels_last
from harness import categorizer, kernel_times, print_kernel_report

CATEGORIES = [  # first match wins: (category, substrings of the kernel name)
    ("triton (fused elementwise/norms)", ("triton",)),  # inductor names them after the ops they fuse
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("conv", ("fprop", "conv", "dgrad")),  # cuDNN's implicit GEMMs say "fprop" before "gemm"
    ("gemm", ("gemm", "cutlass", "cublas", "nvjet")),
    ("mirage norms/geglu", ("mirage",)),
    ("copies/layout", ("copy", "cat", "transpose", "permute", "upsample")),
]

category = categorizer(CATEGORIES, "other elementwise/reduction")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="unet", choices=("unet", "vae"))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also profile torch.compile's forward (about a minute of compiling)")
    opts = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    build, make_inputs = MODELS[opts.model]
    model = build()
    args, kwargs = make_inputs(opts.batch, torch.float16)
    args = to_channels_last(args)
    with torch.inference_mode():
        if opts.compile:
            fp16 = copy.deepcopy(model).half().to(memory_format=torch.channels_last)
            print_kernel_report("torch.compile (default mode)", kernel_times(torch.compile(fp16), *args, **kwargs),
                                category, opts.top)
        fast = mirage.optimize(model, dtype=torch.float16, cuda_graph=False, verbose=False)
        print_kernel_report("mirage.optimize (graphs off)", kernel_times(fast, *args, **kwargs), category,
                            opts.top)


if __name__ == "__main__":
    main()
