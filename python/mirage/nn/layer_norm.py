from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .. import ops
from .._arguments import count


class LayerNorm(nn.Module):
    """``nn.LayerNorm`` over the last dimension; ``forward(x, residual)`` also fuses the
    pre-norm residual add and returns ``(normed, x + residual)``."""

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, (tuple, list, torch.Size)):
            if len(normalized_shape) != 1:
                raise ValueError("mirage.nn.LayerNorm: only normalization over the last dimension is fused, got "
                                 f"normalized_shape={tuple(normalized_shape)}")
            normalized_shape = normalized_shape[0]
        # 0 is nn.LayerNorm's too (an empty last dimension).
        self.normalized_shape = count(normalized_shape, "mirage.nn.LayerNorm: normalized_shape", minimum=0)
        self.eps = eps
        factory = dict(device=device, dtype=dtype)
        self.weight: Optional[nn.Parameter] = (
            nn.Parameter(torch.ones(normalized_shape, **factory)) if elementwise_affine else None
        )
        self.bias: Optional[nn.Parameter] = (
            nn.Parameter(torch.zeros(normalized_shape, **factory)) if elementwise_affine and bias else None
        )

    @classmethod
    def from_torch(cls, module: nn.LayerNorm) -> "LayerNorm":
        """The fused module for ``module`` (sharing its parameters)."""
        # The exact type: a subclass may compute something else.
        if type(module) is not nn.LayerNorm:
            raise TypeError(f"mirage.nn.LayerNorm.from_torch: expected nn.LayerNorm itself, got {type(module).__name__}")
        # The constructor refuses a normalized_shape over more than the last dimension.
        fused = cls(module.normalized_shape, module.eps, elementwise_affine=False)
        fused.weight, fused.bias = module.weight, module.bias
        return fused

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        # The op checks the width against the weight; without one, only this module knows it.
        if self.weight is None and x.dim() > 0 and x.shape[-1] != self.normalized_shape:
            raise RuntimeError(f"mirage.nn.LayerNorm: x's last dimension must be normalized_shape="
                               f"{self.normalized_shape}, got x of shape {tuple(x.shape)}")
        return ops.layer_norm(x, self.weight, self.bias, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, affine={self.weight is not None}"
