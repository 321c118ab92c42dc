"""Fused drop-in modules. Each shares the parameters of the torch module it replaces, but for those
it folds into new ones: ``Conv2dAct.from_conv_bn``'s batch norm folded into the convolution, and
``FusedAttention``'s joined q/k/v (or k/v) projection."""

from .attention import FUSED_ATTENTION, FusedAttention
from .conv import Conv2dAct, conv_bias_act
from .geglu import GEGLU
from .group_norm import GroupNorm
from .layer_norm import LayerNorm
from .linear import linear
from .resnet import ResnetBlock2D
from .transformer import BasicTransformerBlock, Transformer2DModel
from .up_blocks import CrossAttnUpBlock2D, UpBlock2D, cat_channels
from .upsample import Upsample2D

__all__ = ["FUSED_ATTENTION", "BasicTransformerBlock", "Conv2dAct", "CrossAttnUpBlock2D", "FusedAttention", "GEGLU", "GroupNorm", "LayerNorm", "ResnetBlock2D", "Transformer2DModel", "UpBlock2D", "Upsample2D", "cat_channels", "conv_bias_act", "linear"]
