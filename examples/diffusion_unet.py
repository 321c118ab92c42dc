"""Make a diffusers U-Net faster with one call, and check that it still computes the same thing.

    python examples/diffusion_unet.py            # SD-1.5-shaped UNet2DConditionModel on the GPU
    python examples/diffusion_unet.py --tiny     # a small config; runs on the CPU too

Random weights stand in for a checkpoint (no download); with a real one, build the UNet with
``UNet2DConditionModel.from_pretrained(...)`` and pass it to ``mirage.optimize`` the same way.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from diffusers import UNet2DConditionModel

import mirage

SD15 = dict(block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8,
            layers_per_block=2, sample_size=64)
TINY = dict(block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
            layers_per_block=1, norm_num_groups=8, sample_size=16)


def mean_ms(fn, iters: int) -> float:
    """Mean wall time of whole calls, the GPU finished after each batch of calls."""
    fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) * 1e3 / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a small UNet (CPU-friendly)")
    parser.add_argument("--batch", type=int, default=2)
    opts = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config = TINY if opts.tiny or not cuda else SD15

    with torch.device(device):
        unet = UNet2DConditionModel(**config).eval()
    size, context_dim = config["sample_size"], config["cross_attention_dim"]
    sample = torch.randn(opts.batch, 4, size, size, device=device)
    timestep = torch.tensor([500] * opts.batch, device=device)
    context = torch.randn(opts.batch, 77, context_dim, device=device)

    with torch.inference_mode():
        reference = unet(sample, timestep, encoder_hidden_states=context).sample.float()

    # fp16 on the GPU; the CPU keeps float32 (its fp16 convolutions are slow).
    dtype = torch.float16 if cuda else torch.float32
    fast = mirage.optimize(copy.deepcopy(unet), dtype=dtype)
    print(mirage.report(fast))

    args = (sample.to(dtype), timestep)
    kwargs = {"encoder_hidden_states": context.to(dtype)}
    with torch.inference_mode():
        out = fast(*args, **kwargs).sample.float()
        error = ((out - reference).norm() / reference.norm()).item()
        slow = (unet.half() if cuda else unet).to(memory_format=torch.channels_last)
        eager_ms = mean_ms(lambda: slow(*args, **kwargs), 10)
        mirage_ms = mean_ms(lambda: fast(*args, **kwargs), 10)
    print(f"relative L2 error vs float32 eager: {error:.1e}")
    print(f"eager {dtype}: {eager_ms:.2f} ms   mirage: {mirage_ms:.2f} ms   ({eager_ms / mirage_ms:.2f}x)")
    if not cuda:
        print("(on the CPU mirage runs its float64 reference kernels: the speed-up is a GPU matter)")


if __name__ == "__main__":
    main()
