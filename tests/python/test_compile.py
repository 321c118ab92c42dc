import pytest
import torch
from torch import nn

import mirage
from common import DEVICES, randn


class Block(nn.Module):
    """All the ops in one graph: norm + SiLU, a pre-norm residual step, and the GEGLU gate."""

    def __init__(self, c):
        super().__init__()
        self.gn = mirage.nn.GroupNorm(4, c, activation="silu")
        self.ln = mirage.nn.LayerNorm(c)
        self.geglu = mirage.nn.GEGLU(c, c)

    def forward(self, x, residual):
        h = self.gn(x).flatten(2).transpose(1, 2)
        normed, stream = self.ln(h, residual)
        return self.geglu(normed) + stream


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    block = Block(16).to(device)
    compiled = torch.compile(block, fullgraph=True)
    for _ in range(2):  # new inputs each call: the compiled graph must not have baked them in
        x = randn(2, 16, 4, 4, device=device).contiguous(memory_format=torch.channels_last)
        r = randn(2, 16, 16, device=device)
        expected = block(x, r)
        got = compiled(x, r)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert not torch.equal(got, torch.zeros_like(got))
