"""What calling a module runs: the swapped modules read their kept children's weights directly
(a fused epilogue in place of the child's forward) only where that forward is all a call would run."""

from __future__ import annotations

from typing import Optional

from torch import nn


def forward_extras(module: nn.Module) -> Optional[str]:
    """What a call of ``module`` runs besides its class's forward, or None: forward hooks or
    pre-hooks, or a ``forward`` set on the instance (LoRA patchers such as kohya-ss's, offloading
    and caching wrappers replace a module's forward that way, keeping its type)."""
    if module._forward_hooks or module._forward_pre_hooks:
        return "forward hooks"
    if "forward" in vars(module):
        return "a forward set on the instance"
    return None


def runs_plain(module: Optional[nn.Module], cls: type) -> bool:
    """Whether ``module`` is exactly a ``cls`` whose call runs its class's forward alone, so that a
    fused path may read its weights in place of calling it. Checked at every call: hooks and
    patched forwards added after optimize (or after a graph capture, which then needs
    ``graphs.clear()``) make the swapped modules call the module instead."""
    return type(module) is cls and forward_extras(module) is None
