"""``nn.Linear`` through :func:`mirage.ops.linear`, with a residual add in the matmul's epilogue."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .. import ops
from .calls import runs_plain
from .conv import ACTIVATIONS


def linear(module: nn.Module, x: Tensor, residual: Optional[Tensor] = None, input_activation: str = "none") -> Tensor:
    """``module(activation(x)) + residual`` (or without the residual): for a plain ``nn.Linear``,
    one :func:`mirage.ops.linear` call, a cuBLASLt matmul whose epilogue adds the bias and the
    residual (PyTorch: the matmul, then a second kernel reading and writing the output for the
    add), or for up to 8 rows mirage's own kernel, which applies the activation as it reads ``x``.
    ``input_activation`` is one of :data:`mirage.nn.conv.ACTIVATIONS`.

    Where the op cannot take the operands as they are, the module runs as it is and PyTorch adds
    the residual (exactly the unfused code): a module other than a plain ``nn.Linear`` (or one with
    hooks or a patched forward, :func:`~mirage.nn.calls.runs_plain`), operands of
    different dtypes or devices, a residual of another shape (a broadcast), or, under an autocast
    that would cast, a residual (PyTorch's add would then promote; the fused op would not) or an
    input activation (the op would cast x before activating it, PyTorch after).
    """
    if input_activation not in ACTIVATIONS:
        raise ValueError(f"mirage.nn.linear: input_activation must be one of {', '.join(ACTIVATIONS)}, "
                         f"got {input_activation!r}")
    if runs_plain(module, nn.Linear) and fusable(module.weight, module.bias, x, residual, input_activation):
        return ops.linear(x, module.weight, module.bias, residual, input_activation)
    y = module(ACTIVATIONS[input_activation](x))
    return y if residual is None else y + residual


def fusable(weight: Tensor, bias: Optional[Tensor], x: Tensor, residual: Optional[Tensor],
            input_activation: str = "none") -> bool:
    """Whether ``mirage.ops.linear(x, weight, bias, residual, input_activation)`` computes what
    ``F.linear(activation(x), weight, bias) + residual`` computes, dtype and device included."""
    if x.device != weight.device or x.dim() == 0 or (x.is_cuda and x.dtype == torch.float64):
        return False
    if autocast_casts(x) or autocast_casts(weight):
        # The op's autocast casts x, weight and bias as F.linear's does; but it casts x before the
        # activation, where PyTorch activates first.
        return residual is None and (input_activation == "none" or not autocast_casts(x))
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        return False
    return residual is None or (residual.dtype == x.dtype and residual.device == x.device
                                and residual.shape == x.shape[:-1] + (weight.shape[0],))


def autocast_casts(x: Tensor) -> bool:
    """Whether autocast is on for ``x``'s device with a dtype other than ``x``'s: a fused op would
    then cast every operand before using it, where a separate PyTorch add uses them as they are."""
    # Not torch.amp.is_autocast_available: torch 2.11's dynamo cannot trace it (fullgraph breaks).
    device_type = x.device.type
    return (device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type)
            and x.dtype != torch.get_autocast_dtype(device_type))
