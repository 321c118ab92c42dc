from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .. import ops
from .._arguments import count

ACTIVATIONS = ("none", "silu")


class GroupNorm(nn.Module):
    """``nn.GroupNorm`` followed by an optional fused activation, in one kernel.

    Channels-last input stays channels-last with no layout copies.
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        activation: str = "none",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        num_groups = count(num_groups, "mirage.nn.GroupNorm: num_groups")
        num_channels = count(num_channels, "mirage.nn.GroupNorm: num_channels", minimum=0)  # 0, as nn.GroupNorm
        if num_channels % num_groups != 0:
            raise ValueError(
                f"mirage.nn.GroupNorm: num_channels ({num_channels}) must be divisible by "
                f"num_groups ({num_groups})"
            )
        if activation not in ACTIVATIONS:
            raise ValueError(f"mirage.nn.GroupNorm: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = eps
        self.activation = activation
        if affine:
            self.weight: Optional[nn.Parameter] = nn.Parameter(torch.ones(num_channels, device=device, dtype=dtype))
            self.bias: Optional[nn.Parameter] = nn.Parameter(torch.zeros(num_channels, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    @classmethod
    def from_torch(cls, module: nn.GroupNorm, activation: str = "none") -> "GroupNorm":
        """The fused module for ``module`` (sharing its parameters), then ``activation``."""
        # The exact type: a subclass may compute something else.
        if type(module) is not nn.GroupNorm:
            raise TypeError(f"mirage.nn.GroupNorm.from_torch: expected nn.GroupNorm itself, got {type(module).__name__}")
        fused = cls(module.num_groups, module.num_channels, module.eps, affine=False, activation=activation)
        fused.weight, fused.bias = module.weight, module.bias
        return fused

    def forward(self, x: Tensor) -> Tensor:
        return ops.group_norm(x, self.num_groups, self.weight, self.bias, self.eps, self.activation)

    def extra_repr(self) -> str:
        return (f"{self.num_groups}, {self.num_channels}, eps={self.eps}, "
                f"affine={self.weight is not None}, activation={self.activation!r}")
