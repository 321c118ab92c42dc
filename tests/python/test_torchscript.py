import os

import torch
from torch import nn

import mirage  # noqa: F401  (registers torch.ops.mirage)
from common import randn


class ScriptedGroupNormSiLU(nn.Module):
    def __init__(self, num_groups: int, channels: int):
        super().__init__()
        self.num_groups = num_groups
        self.eps = 1e-5
        self.weight = nn.Parameter(randn(channels))
        self.bias = nn.Parameter(randn(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mirage.group_norm(x, self.num_groups, self.weight, self.bias, self.eps, "silu")


def test_script_save_and_load(tmp_path):
    """Scripts and saves the module that tests/cpp/test_api.cpp loads and runs from C++."""
    path = os.environ.get("MIRAGE_TORCHSCRIPT_MODULE") or str(tmp_path / "scripted_group_norm.pt")
    module = ScriptedGroupNormSiLU(4, 16)
    scripted = torch.jit.script(module)
    scripted.save(path)
    loaded = torch.jit.load(path)
    x = randn(2, 16, 6, 5).contiguous(memory_format=torch.channels_last)
    expected = torch.nn.functional.silu(torch.nn.functional.group_norm(x, 4, module.weight, module.bias, 1e-5))
    torch.testing.assert_close(loaded(x), expected.detach(), atol=2e-5, rtol=2e-5)
