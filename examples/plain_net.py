"""A plain PyTorch U-Net-like conv/attention net, written the way users write one, and mirage on it.

Nothing here knows about mirage: Conv2d -> BatchNorm2d -> SiLU blocks (as nn.Sequential and as a
module calling self.conv/self.bn/self.act), GroupNorm -> SiLU blocks, and attention blocks with
separate q/k/v nn.Linear projections and a hand-written softmax(q @ k^T * scale) @ v.
``mirage.optimize`` finds these patterns in the traced graph and fuses them.

    python examples/plain_net.py            # a small net on the CPU (or the GPU if there is one)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ConvBNAct(nn.Module):
    """3x3 convolution, batch norm, SiLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


def conv_bn_silu(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.SiLU(),
    )


class ResBlock(nn.Module):
    """Two conv-BN-SiLU layers with a residual connection (1x1 conv when the width changes)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.block1 = ConvBNAct(in_channels, out_channels)
        self.block2 = conv_bn_silu(out_channels, out_channels)
        self.skip = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip(x) + self.block2(self.block1(x))


class NormActConv(nn.Module):
    """GroupNorm -> SiLU -> 3x3 convolution, added to the input (a diffusion ResNet half-block)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(math.gcd(32, channels), channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(F.silu(self.norm(x)))


class AttentionBlock(nn.Module):
    """Pre-norm multi-head self-attention and MLP over the pixels of a feature map."""

    def __init__(self, channels: int, head_dim: int = 64) -> None:
        super().__init__()
        head_dim = min(head_dim, channels)
        self.heads = channels // head_dim
        self.scale = head_dim ** -0.5
        self.norm1 = nn.LayerNorm(channels)
        self.q = nn.Linear(channels, channels)
        self.k = nn.Linear(channels, channels)
        self.v = nn.Linear(channels, channels)
        self.proj = nn.Linear(channels, channels)
        self.norm2 = nn.LayerNorm(channels)
        self.mlp = nn.Sequential(nn.Linear(channels, 4 * channels), nn.GELU(), nn.Linear(4 * channels, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        tokens = x.flatten(2).transpose(1, 2)  # (B, H*W, C)
        h = self.norm1(tokens)
        q = self.q(h).reshape(B, H * W, self.heads, C // self.heads).transpose(1, 2)
        k = self.k(h).reshape(B, H * W, self.heads, C // self.heads).transpose(1, 2)
        v = self.v(h).reshape(B, H * W, self.heads, C // self.heads).transpose(1, 2)
        attn = torch.softmax(q @ k.transpose(-2, -1) * self.scale, dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(B, H * W, C)
        tokens = tokens + self.proj(out)
        tokens = tokens + self.mlp(self.norm2(tokens))
        return tokens.transpose(1, 2).reshape(B, C, H, W)


class PlainNet(nn.Module):
    """A U-Net: a stem, ``len(mults)`` levels down (ResBlocks, then a stride-2 conv-BN-SiLU), a
    middle (ResBlock, GroupNorm block, attention, ResBlock) and the mirrored levels up with skip
    connections. ``width`` channels at full resolution, ``width * mults[i]`` at level i,
    ``depth`` ResBlocks per level; attention (heads of ``head_dim`` channels) at the levels listed
    in ``attention_levels`` and in the middle."""

    def __init__(
        self,
        width: int = 32,
        depth: int = 1,
        mults: tuple = (1, 2, 4),
        attention_levels: tuple = (2,),
        head_dim: int = 64,
        in_channels: int = 3,
        out_channels: int = 3,
    ) -> None:
        super().__init__()
        self.stem = conv_bn_silu(in_channels, width)
        channels = [width * m for m in mults]

        self.down = nn.ModuleList()
        self.downsample = nn.ModuleList()
        previous = width
        for level, ch in enumerate(channels):
            blocks = []
            for _ in range(depth):
                blocks.append(ResBlock(previous, ch))
                if level in attention_levels:
                    blocks.append(AttentionBlock(ch, head_dim))
                previous = ch
            self.down.append(nn.Sequential(*blocks))
            self.downsample.append(ConvBNAct(ch, ch, stride=2))

        mid = channels[-1]
        self.middle = nn.Sequential(ResBlock(mid, mid), NormActConv(mid), AttentionBlock(mid, head_dim),
                                    ResBlock(mid, mid))

        self.up = nn.ModuleList()
        for level in reversed(range(len(channels))):
            ch = channels[level]
            blocks = [nn.Upsample(scale_factor=2, mode="nearest"), conv_bn_silu(previous, ch)]
            self.up.append(nn.Sequential(*blocks))
            merge = [ResBlock(2 * ch, ch)]
            for _ in range(depth - 1):
                merge.append(ResBlock(ch, ch))
            if level in attention_levels:
                merge.append(AttentionBlock(ch, head_dim))
            merge.append(NormActConv(ch))
            self.up.append(nn.Sequential(*merge))
            previous = ch
        self.head = nn.Conv2d(previous, out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        skips = []
        for blocks, downsample in zip(self.down, self.downsample):
            h = blocks(h)
            skips.append(h)
            h = downsample(h)
        h = self.middle(h)
        for upsample, merge in zip(self.up[::2], self.up[1::2]):
            h = merge(torch.cat([upsample(h), skips.pop()], dim=1))
        return self.head(h)

    @classmethod
    def large(cls) -> "PlainNet":
        """About 900M parameters (899.6M), the benchmark's plain net (batch 2, 3x64x64 input).

        Shaped like an SD-1.5 U-Net (multipliers (1, 2, 4, 4), two ResBlocks per level, attention
        at the 16x16 and 8x8 levels; 64x64 input reaches 4x4 in the middle). Parameters grow with
        width squared, most of them in the deepest 3x3 convolutions (9 * C^2 each): width 320
        gives 625M, and width 384 (1536 channels at the bottom) gives 899.6M.
        """
        return cls(width=384, depth=2, mults=(1, 2, 4, 4), attention_levels=(2, 3))

    @classmethod
    def tiny(cls) -> "PlainNet":
        """A net for tests: every pattern, 46K parameters, 16x16 input."""
        return cls(width=8, depth=1, mults=(1, 2), attention_levels=(1,), head_dim=4)


def randomize_batch_norms(model: nn.Module) -> None:
    """Give every BatchNorm non-trivial running statistics and affine parameters, as a trained
    net has (fresh ones are the identity, which would hide a wrong fold)."""
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, nn.BatchNorm2d):
                continue
            if module.track_running_stats:
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
            if module.affine:
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)


def main() -> None:
    import argparse
    import copy

    import mirage

    parser = argparse.ArgumentParser(description="A small PlainNet, eager and through mirage.optimize (fp32 "
                                                 "weights under autocast, no CUDA graphs), compared.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to run (default: the GPU if there is one)")
    device = parser.parse_args().device
    try:
        device = torch.device(device)
    except RuntimeError as error:
        parser.error(f"--device {device!r} is not a torch device: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: no CUDA GPU is available to this torch; use --device cpu")
    model = PlainNet(width=32, depth=1).to(device).eval()
    randomize_batch_norms(model)
    x = torch.randn(2, 3, 32, 32, device=device)
    with torch.no_grad():
        expected = model(x)
    print(f"PlainNet: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, input {tuple(x.shape)}")
    optimized = mirage.optimize(copy.deepcopy(model), dtype=None, cuda_graph=False)
    with torch.no_grad():
        got = optimized(x)
    print(f"max |optimized - eager| = {(got - expected).abs().max().item():.3g}")
    print(mirage.report(optimized))


if __name__ == "__main__":
    main()
