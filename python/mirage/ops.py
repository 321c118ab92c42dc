"""Typed wrappers of the ``torch.ops.mirage`` operators.

Every op accepts float32, float16 and bfloat16 inputs (float64 too on the CPU), accumulates in
float32 (float64 on the CPU reference), returns new tensors, and raises ``RuntimeError`` naming
the op and the argument on bad input. Weights and biases may be in the input's dtype or float32.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor


def group_norm(
    x: Tensor,
    num_groups: int,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    activation: str = "none",
) -> Tensor:
    """GroupNorm with an optional fused activation: ``act(F.group_norm(x, ...))``.

    Args:
        x: ``(N, C, *)``. NCHW-contiguous or channels-last (4-D and 5-D) input is read in
            place; other strides are copied first.
        num_groups: divides ``C``.
        weight, bias: ``(C,)`` or None.
        eps: added to the variance.
        activation: ``"none"`` or ``"silu"`` (applied after the affine).

    Returns:
        ``x``'s shape and dtype, in ``x``'s memory format (channels-last stays channels-last).
    """
    return torch.ops.mirage.group_norm(x, num_groups, weight, bias, eps, activation)


def layer_norm(
    x: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    residual: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """LayerNorm over the last dimension, with an optional fused residual add.

    Args:
        x: ``(*, D)``; on CUDA, ``D`` up to 16384.
        weight, bias: ``(D,)`` or None.
        eps: added to the variance.
        residual: None, or a tensor of ``x``'s shape and dtype.

    Returns:
        Without ``residual``: ``F.layer_norm(x, (D,), weight, bias, eps)``.
        With it: ``(layer_norm(x + residual), x + residual)``, the sum rounded to ``x``'s dtype
        (the pre-norm transformer step: the sum is the next residual stream).
    """
    if residual is None:
        return torch.ops.mirage.layer_norm(x, weight, bias, eps)
    return torch.ops.mirage.add_layer_norm(x, residual, weight, bias, eps)


def geglu(x: Tensor, approximate: str = "none") -> Tensor:
    """The GEGLU gate of diffusers' feed-forward: ``a * F.gelu(b, approximate)``.

    Args:
        x: ``(*, 2H)``; ``a, b = x.chunk(2, dim=-1)``.
        approximate: ``"none"`` (erf GELU) or ``"tanh"``.

    Returns:
        ``(*, H)`` in ``x``'s dtype.
    """
    return torch.ops.mirage.geglu(x, approximate)
