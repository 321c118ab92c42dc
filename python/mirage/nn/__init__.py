"""Fused drop-in modules. Each loads (shares) the parameters of the torch module it replaces."""

from .geglu import GEGLU
from .group_norm import GroupNorm
from .layer_norm import LayerNorm

__all__ = ["GEGLU", "GroupNorm", "LayerNorm"]
