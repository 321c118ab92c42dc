import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirage
from common import DEVICES, randn


class GEGLU(nn.Module):
    """diffusers' GEGLU written again (diffusers is not needed to test the swap)."""

    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x, *args, **kwargs):
        a, gate = self.proj(x).chunk(2, dim=-1)
        return a * F.gelu(gate)


@pytest.mark.parametrize("device", DEVICES)
def test_group_norm_from_torch(device):
    gn = nn.GroupNorm(4, 12, eps=1e-4).to(device)
    with torch.no_grad():
        gn.weight.copy_(randn(12)), gn.bias.copy_(randn(12))
    fused = mirage.nn.GroupNorm.from_torch(gn, activation="silu")
    assert fused.weight is gn.weight and fused.bias is gn.bias
    x = randn(2, 12, 5, 5, device=device).contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(fused(x), F.silu(gn(x)), atol=2e-5, rtol=2e-5)
    plain = mirage.nn.GroupNorm.from_torch(nn.GroupNorm(3, 12, affine=False).to(device))
    torch.testing.assert_close(plain(x), F.group_norm(x, 3), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_from_torch(device):
    ln = nn.LayerNorm(10).to(device)
    with torch.no_grad():
        ln.weight.copy_(randn(10)), ln.bias.copy_(randn(10))
    fused = mirage.nn.LayerNorm.from_torch(ln)
    x, r = randn(3, 4, 10, device=device), randn(3, 4, 10, device=device)
    torch.testing.assert_close(fused(x), ln(x), atol=2e-5, rtol=2e-5)
    out, total = fused(x, r)
    torch.testing.assert_close(out, ln(x + r), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(total, x + r)


@pytest.mark.parametrize("device", DEVICES)
def test_geglu_from_torch(device):
    module = GEGLU(8, 6).to(device)
    fused = mirage.nn.GEGLU.from_torch(module)
    assert fused.proj is module.proj
    x = randn(2, 5, 8, device=device)
    torch.testing.assert_close(fused(x), module(x), atol=2e-5, rtol=2e-5)


def test_fresh_modules_match_torch_defaults():
    x = randn(2, 8, 3, 3)
    torch.testing.assert_close(mirage.nn.GroupNorm(2, 8)(x), nn.GroupNorm(2, 8)(x), atol=2e-5, rtol=2e-5)
    t = randn(4, 8)
    torch.testing.assert_close(mirage.nn.LayerNorm(8)(t), nn.LayerNorm(8)(t), atol=2e-5, rtol=2e-5)


def test_from_torch_refuses_what_it_cannot_replace():
    with pytest.raises(ValueError, match="only normalization over the last dimension"):
        mirage.nn.LayerNorm.from_torch(nn.LayerNorm((4, 5)))
    with pytest.raises(TypeError, match="expected nn.GroupNorm itself, got LayerNorm"):
        mirage.nn.GroupNorm.from_torch(nn.LayerNorm(4))
    with pytest.raises(TypeError, match="expected a GEGLU module"):
        mirage.nn.GEGLU.from_torch(nn.Linear(4, 4))

    class SwiGLU(GEGLU):  # a `proj` Linear too, gated a * silu(b)
        def forward(self, x):
            a, gate = self.proj(x).chunk(2, dim=-1)
            return a * F.silu(gate)

    with pytest.raises(TypeError, match="expected a GEGLU module .* got SwiGLU"):
        mirage.nn.GEGLU.from_torch(SwiGLU(4, 4))

    class ScaledLayerNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(TypeError, match="expected nn.LayerNorm itself, got ScaledLayerNorm"):
        mirage.nn.LayerNorm.from_torch(ScaledLayerNorm(4))
    with pytest.raises(TypeError, match="expected nn.GroupNorm itself, got"):
        mirage.nn.GroupNorm.from_torch(type("Shifted", (nn.GroupNorm,), {})(2, 4))
    with pytest.raises(ValueError, match=r"mirage.nn.LayerNorm: only normalization over the last dimension"):
        mirage.nn.LayerNorm((3, 4))
    with pytest.raises(ValueError, match="num_channels \\(10\\) must be divisible by num_groups \\(4\\)"):
        mirage.nn.GroupNorm(4, 10)
    with pytest.raises(ValueError, match="activation must be one of"):
        mirage.nn.GroupNorm(2, 4, activation="relu")
    for groups in (0, -2, 2.0):
        with pytest.raises(ValueError, match=r"mirage.nn.GroupNorm: num_groups must be an int >= 1"):
            mirage.nn.GroupNorm(groups, 4)
    # torch's tensor-creation errors named neither (and -4 channels without affine was accepted).
    for channels in (-4, 16.0, "16"):
        with pytest.raises(ValueError, match=r"mirage.nn.GroupNorm: num_channels must be an int >= 0"):
            mirage.nn.GroupNorm(4, channels, affine=False)
    for width in (-1, 8.0, "8", (torch.tensor(8.0),)):
        with pytest.raises(ValueError, match=r"mirage.nn.LayerNorm: normalized_shape must be an int >= 0"):
            mirage.nn.LayerNorm(width)
    assert mirage.nn.LayerNorm((8,)).normalized_shape == 8 and mirage.nn.LayerNorm(torch.Size([0])).weight.shape == (0,)


def test_layer_norm_without_weights_checks_the_width():
    for norm in (mirage.nn.LayerNorm(4, elementwise_affine=False),
                 mirage.nn.LayerNorm.from_torch(nn.LayerNorm(4, elementwise_affine=False))):
        with pytest.raises(RuntimeError, match=r"mirage.nn.LayerNorm: x's last dimension must be normalized_shape=4, "
                                               r"got x of shape \(3, 6\)"):
            norm(randn(3, 6))
        t = randn(3, 4)
        torch.testing.assert_close(norm(t), F.layer_norm(t, (4,)), atol=2e-5, rtol=2e-5)


def test_conv_bias_act_takes_what_bias_act_cannot_as_pytorch_does():
    conv = torch.nn.Conv2d(3, 5, 3, padding=1).double()
    # Unbatched (C, H, W) input: the bias goes along channels, as nn.Conv2d adds it.
    x = torch.randn(3, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(mirage.nn.conv_bias_act(conv, x, activation="silu"), torch.nn.functional.silu(conv(x)))
    # One time embedding (1, C) for a batch of 2, and a residual that broadcasts.
    x, shift, residual = (torch.randn(2, 3, 4, 4, dtype=torch.float64), torch.randn(1, 5, dtype=torch.float64),
                          torch.randn(5, 1, 1, dtype=torch.float64))
    want = (conv(x) + shift[:, :, None, None] + residual) * 0.5
    torch.testing.assert_close(mirage.nn.conv_bias_act(conv, x, shift=shift, residual=residual, scale=0.5), want)
    torch.testing.assert_close(mirage.nn.conv_bias_act(conv, x, shift=shift), conv(x) + shift[:, :, None, None])
    # A shift that PyTorch's add would promote (float64 on a float32 output) runs unfused, promoted;
    # the convolution's float32 output may round its bias differently (float32's tolerance: a
    # seed in CI came out 1.5e-7 off where float64's 1e-7 was allowed).
    conv32, x32 = conv.float(), x.float()
    got = mirage.nn.conv_bias_act(conv32, x32, shift=shift)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, conv32(x32) + shift[:, :, None, None], rtol=1.3e-6, atol=1e-5)
    with pytest.raises(ValueError, match="mirage.nn.conv_bias_act: activation must be one of"):
        mirage.nn.conv_bias_act(conv32, x32[0], activation="tanh")
