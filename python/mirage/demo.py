"""``python -m mirage demo``: swap mirage's fused modules into a small U-Net-style model and
report the largest error against the original and the time of both.

The swap here is written out by hand for this one model, to show the modules themselves;
``mirage.optimize`` does it for any model (docs/optimize.md).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from . import nn as mnn


class ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm1, self.act1 = nn.GroupNorm(32, channels), nn.SiLU()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2, self.act2 = nn.GroupNorm(32, channels), nn.SiLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        h = self.conv1(self.act1(self.norm1(x)))
        return x + self.conv2(self.act2(self.norm2(h)))


class GEGLU(nn.Module):
    """Shaped like diffusers' GEGLU: a projection to twice the width, then a * gelu(b)."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner * 2)

    def forward(self, x):
        a, b = self.proj(x).chunk(2, dim=-1)
        return a * F.gelu(b)


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(GEGLU(dim, 4 * dim), nn.Linear(4 * dim, dim))

    def forward(self, x):  # x: (N, C, H, W)
        n, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        q, k, v = self.qkv(self.norm1(t)).view(n, -1, 3, self.heads, c // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        t = t + self.out(a.transpose(1, 2).reshape(n, -1, c))
        t = t + self.ff(self.norm2(t))
        return t.transpose(1, 2).reshape(n, c, h, w)


class DemoNet(nn.Module):
    def __init__(self, channels: int = 320) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(4, channels, 3, padding=1)
        self.blocks = nn.Sequential(ResBlock(channels), TransformerBlock(channels), ResBlock(channels))
        self.norm_out, self.act_out = nn.GroupNorm(32, channels), nn.SiLU()
        self.conv_out = nn.Conv2d(channels, 4, 3, padding=1)

    def forward(self, x):
        return self.conv_out(self.act_out(self.norm_out(self.blocks(self.conv_in(x)))))


def fuse(model: DemoNet) -> DemoNet:
    """A copy of ``model`` with mirage's fused modules in place."""
    fused = copy.deepcopy(model)
    for parent in list(fused.modules()):
        for name in list(parent._modules):
            child = parent._modules[name]
            if isinstance(child, nn.GroupNorm):
                act = name.replace("norm", "act")
                parent._modules[name] = mnn.GroupNorm.from_torch(child, activation="silu")
                parent._modules[act] = nn.Identity()  # its SiLU now runs inside the norm
            elif isinstance(child, nn.LayerNorm):
                parent._modules[name] = mnn.LayerNorm.from_torch(child)
            elif isinstance(child, nn.Sequential) and isinstance(child[0], GEGLU):
                parent._modules[name] = nn.Sequential(mnn.GEGLU.from_torch(child[0]), child[1])
    return fused


def _time_ms(fn, x, iters: int) -> float:
    times = []
    for _ in range(iters):
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_demo(device: str | None = None) -> None:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.startswith("cuda")
    dtype = torch.float16 if on_gpu else torch.float32
    size, iters = (64, 50) if on_gpu else (16, 5)
    print(f"mirage demo on {device} ({dtype}, batch 2, 4x{size}x{size} input, channels_last)")
    torch.manual_seed(0)
    model = DemoNet().to(device=device, dtype=dtype, memory_format=torch.channels_last).eval()
    fused = fuse(model)
    x = torch.randn(2, 4, size, size, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        reference = model(x)
        out = fused(x)
        swapped = sum(type(m).__module__.startswith("mirage.nn") for m in fused.modules())
        error = (out.float() - reference.float()).abs().max().item()
        scale = reference.float().abs().max().item()
        print(f"swapped {swapped} modules for mirage's fused ones")
        print(f"max abs error vs the original: {error:.3e} (output max {scale:.3f})")
        for fn in (model, fused):  # warm-up
            fn(x)
        eager_ms, fused_ms = _time_ms(model, x, iters), _time_ms(fused, x, iters)
    print(f"original {eager_ms:.3f} ms, with mirage {fused_ms:.3f} ms per forward "
          f"(median of {iters}; {eager_ms / fused_ms:.2f}x)")
    if not on_gpu:
        print("(on the CPU mirage runs its plain float64 reference kernels, so expect no speed-up there)")
