"""Conv2d with an inference-time BatchNorm folded into its weights and an activation after it."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops

# name -> the function applied to the convolution's output. "gelu_tanh" is nn.GELU(approximate="tanh").
ACTIVATIONS = {
    "none": lambda x: x,
    "relu": F.relu,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class Conv2dAct(nn.Conv2d):
    """``activation(conv2d(x))``: an ``nn.Conv2d`` followed by an activation (``from_conv_bn`` gives
    it a bias: the folded batch norm's shift).

    Built by :meth:`from_conv_bn`, which folds an eval-mode ``BatchNorm2d`` into the weights and
    bias, so the batch norm costs nothing at run time. It stays an ``nn.Conv2d`` so dtype, device
    and ``channels_last`` conversions treat it like any convolution.

    The bias and the activation run as one ``mirage.ops.bias_act`` pass after cuDNN's
    convolution (see :func:`conv_bias_act`), where PyTorch spends two: its convolution adds the
    bias in a kernel of its own, then the activation reads and writes the tensor again.
    """

    def __init__(self, *args, activation: str = "none", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"mirage.nn.Conv2dAct: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}"
            )
        self.activation = activation

    @classmethod
    def from_conv_bn(
        cls, conv: nn.Conv2d, bn: Optional[nn.BatchNorm2d] = None, activation: str = "none"
    ) -> "Conv2dAct":
        """``activation(bn(conv(x)))`` as one module, with ``bn``'s running statistics folded in.

        The folded weights are new parameters (``conv`` and ``bn`` are left unchanged), computed
        in float64 and rounded once to ``conv``'s dtype. ``bn`` must be in eval mode with running
        statistics: a training-mode batch norm normalizes with each batch's own statistics, which
        no fixed weights reproduce.
        """
        if type(conv) is not nn.Conv2d:
            raise TypeError(f"mirage.nn.Conv2dAct.from_conv_bn: expected nn.Conv2d, got {type(conv).__name__}")
        # Built on the meta device: its own initialization would be thrown away (and costs seconds
        # on a large model); the parameters below replace it.
        fused = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
            dilation=conv.dilation, groups=conv.groups, bias=True, padding_mode=conv.padding_mode,
            device="meta", activation=activation,
        )
        weight = conv.weight.detach().double()
        bias = conv.bias.detach().double() if conv.bias is not None else weight.new_zeros(conv.out_channels)
        if bn is not None:
            scale, shift = batch_norm_affine(bn, conv.out_channels)
            weight = weight * scale.view(-1, 1, 1, 1)
            bias = bias * scale + shift
        requires_grad = conv.weight.requires_grad
        # empty_like keeps conv's memory format (a channels_last model stays channels_last).
        fused.weight = nn.Parameter(torch.empty_like(conv.weight).copy_(weight), requires_grad=requires_grad)
        fused.bias = nn.Parameter(bias.to(conv.weight.dtype), requires_grad=requires_grad)
        fused.training = conv.training
        return fused

    def forward(self, x: Tensor) -> Tensor:
        return conv_bias_act(self, x, activation=self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"


def batch_norm_affine(bn: nn.BatchNorm2d, channels: int) -> tuple[Tensor, Tensor]:
    """Eval-mode ``bn`` as ``x * scale + shift`` per channel, in float64.

    Raises:
        ValueError: ``bn`` is in training mode, keeps no running statistics, or has a channel
            count other than ``channels``.
    """
    if bn.training:
        raise ValueError("BatchNorm2d is in training mode (it normalizes with batch statistics); call .eval() first")
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("BatchNorm2d keeps no running statistics (track_running_stats=False)")
    if bn.num_features != channels:
        raise ValueError(f"BatchNorm2d has {bn.num_features} channels, the convolution produces {channels}")
    inv_std = torch.rsqrt(bn.running_var.detach().double() + bn.eps)
    gamma = bn.weight.detach().double() if bn.weight is not None else torch.ones_like(inv_std)
    beta = bn.bias.detach().double() if bn.bias is not None else torch.zeros_like(inv_std)
    scale = gamma * inv_std
    return scale, beta - bn.running_mean.detach().double() * scale


def conv_bias_act(
    conv: nn.Conv2d,
    x: Tensor,
    *,
    shift: Optional[Tensor] = None,
    residual: Optional[Tensor] = None,
    activation: str = "none",
    scale: float = 1.0,
    conv_bias: bool = True,
) -> Tensor:
    """``(activation(conv(x) + shift) + residual) * scale`` with the convolution's bias, the shift,
    the activation, the residual add and the scale in one ``mirage.ops.bias_act`` pass.

    PyTorch's convolution adds its bias in a separate broadcast kernel (a full read and write of
    the output); here cuDNN runs without the bias and ``bias_act`` applies everything after it.

    Args:
        conv: an ``nn.Conv2d``. Its ``forward`` is not called: only its weight, bias and
            ``_conv_forward`` (stride, padding, padding mode, dilation, groups) are used.
        shift: None, ``(C,)``, ``(N, C)`` or ``(1, C)`` added with the bias (e.g. a time
            embedding, or the bias of a shortcut convolution whose output is ``residual``).
        residual: None or a tensor added after the activation.
        activation: one of :data:`ACTIVATIONS`.
        scale: multiplies the result.
        conv_bias: False leaves out the convolution's bias (a caller that folded it into
            ``shift`` already).

    Where ``bias_act`` cannot take the arguments as they are, the same steps run as separate
    PyTorch ops with PyTorch's broadcasting and type promotion (exactly the unfused code, the
    convolution's bias in the convolution's dtype): unbatched ``(C, H, W)`` input, float64 on
    CUDA, a residual of another dtype (autocast) or shape, a shift that is neither per channel nor
    per sample, or of a dtype other than the output's or float32 (which would promote it).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"mirage.nn.conv_bias_act: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    y = conv._conv_forward(x, conv.weight, None)
    own_bias = conv.bias if conv_bias else None
    fused = (y.dim() == 4 and not (y.is_cuda and y.dtype == torch.float64)
             and (residual is None or (residual.dtype == y.dtype and residual.shape == y.shape))
             and (shift is None or shift.dtype in (y.dtype, torch.float32)))
    bias = own_bias
    if fused and shift is not None:
        bias = shift if bias is None else bias + shift
        if bias.dim() == 2 and bias.shape[0] == 1:
            bias = bias.expand(y.shape[0], -1)  # one time embedding for the whole batch
        # Dimension by dimension: `tuple(bias.shape) in ((C,), (N, C))` compares (N, C) with (C,)
        # element-wise, N with C, which under torch.export with a batch Dim adds the guard N != C.
        fused = (bias.dim() in (1, 2) and bias.shape[-1] == y.shape[1]
                 and (bias.dim() == 1 or bias.shape[0] == y.shape[0]))
    if not fused:
        if own_bias is not None:
            y = y + own_bias.reshape(-1, 1, 1).to(y.dtype)
        if shift is not None:
            y = y + shift.reshape(shift.shape + (1, 1))
        y = ACTIVATIONS[activation](y)
        if residual is not None:
            y = y + residual
        return y * scale if scale != 1.0 else y
    return ops.bias_act(y, bias, residual, activation, scale)
