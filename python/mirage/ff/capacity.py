"""The neighbor-capacity protocol, seen from the caller (the Calculator, the MD driver).

A model with a fixed-capacity neighbor list (mirage's fused models) has an int attribute
``max_pairs`` (the capacity its next forward uses; settable; None before its first forward) and
a ``[1]`` int64 buffer ``num_pairs`` that each forward overwrites on the device with the true
pair count. After an evaluation, replayed from a CUDA graph or not, the caller asks
:func:`needed_pairs`: None means the result is valid; a number means the neighbor list overflowed,
the result is invalid, and the caller sets ``model.max_pairs`` to that number, drops its graphs
(the capacity is frozen into them), recaptures and recomputes.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator, Optional, Union

import torch

__all__ = ["GROWTH", "MARGIN", "MAX_GROWS", "caller_checks", "checked_by_caller", "has_capacity", "holder",
           "needed_pairs", "refuse_unchecked_capture", "unchecked_by"]

#: An overflowing capacity grows at least by this factor, so that a slowly densifying system
#: (a compressed box, a cluster forming) recaptures a logarithmic number of times.
GROWTH = 1.5
#: The new capacity is at least the count seen times this, for the same reason.
MARGIN = 1.2
#: Grows a caller tries for one evaluation before it gives up (a model whose num_pairs does not
#: follow max_pairs would otherwise loop for ever).
MAX_GROWS = 16


_callers = threading.local()


@contextlib.contextmanager
def checked_by_caller() -> Iterator[None]:
    """Within it, a model that would grow its own capacity on an overflow (mirage's fused models
    do in a call outside a CUDA-graph capture) leaves that to the caller. The Calculator and the MD
    driver evaluate their models inside it: their graphs hold the capacity they were captured with,
    so a capacity grown in the warm-up before a capture would leave the graphs captured earlier
    replaying with the old one, their overflows judged against the new one. They check
    ``num_pairs`` after every evaluation instead and recapture all their graphs."""
    _callers.depth = getattr(_callers, "depth", 0) + 1
    try:
        yield
    finally:
        _callers.depth -= 1


def caller_checks() -> bool:
    """Whether the current call is inside :func:`checked_by_caller` (on this thread)."""
    return getattr(_callers, "depth", 0) > 0


@contextlib.contextmanager
def unchecked_by(who: str) -> Iterator[None]:
    """Within it, the caller ``who`` (the Calculator, the MD driver) checks no capacity: it found no
    module implementing the protocol in its model, which may still call one it cannot see (a
    fused model in a plain function or a list). Called directly, such a model grows its own
    capacity; captured in a CUDA graph, where it cannot, it raises (:func:`refuse_unchecked_capture`)
    rather than replay with an overflow nobody would notice."""
    previous = getattr(_callers, "unchecked_by", None)
    _callers.unchecked_by = who
    try:
        yield
    finally:
        _callers.unchecked_by = previous


def refuse_unchecked_capture(model_who: str) -> None:
    """For a model with a capacity, captured in a CUDA graph outside :func:`checked_by_caller`:
    raises inside :func:`unchecked_by` (a caller that will not check it); elsewhere the one who
    captures checks ``num_pairs`` (the protocol).

    Raises:
        ValueError: inside :func:`unchecked_by`.
    """
    caller = getattr(_callers, "unchecked_by", None)
    if caller is not None:
        raise ValueError(
            f"{caller}: the model calls {model_who}, which has a neighbor capacity, but holds it where the "
            "capacity cannot be checked (not the model itself nor one of its submodules: a plain function, a "
            "list); in a CUDA graph an overflow would drop pairs unnoticed. Pass the fused model, or an "
            "nn.Module holding it as a submodule, or use cuda_graph=False")


def has_capacity(model) -> bool:
    """Whether ``model`` implements the protocol (``max_pairs`` attribute and ``num_pairs`` buffer)."""
    return hasattr(model, "max_pairs") and isinstance(getattr(model, "num_pairs", None), torch.Tensor)


def holder(model, who: str) -> Optional[torch.nn.Module]:
    """What a caller checks in ``model``: the model itself when it implements the protocol, else the
    one module inside it that does (a fused model inside the user's own module, which inside
    :func:`checked_by_caller` would otherwise overflow unchecked); None when nothing does.

    Raises:
        ValueError: several modules inside ``model`` implement it (an ensemble of fused models):
            one capacity check cannot cover them.
    """
    if has_capacity(model):
        return model
    found = [module for module in model.modules() if has_capacity(module)] if isinstance(model, torch.nn.Module) else []
    if len(found) > 1:
        raise ValueError(f"{who}: the model holds {len(found)} modules with a neighbor capacity (mirage's fused "
                         "models); one capacity check cannot cover several: give each its own calculator")
    return found[0] if found else None


def needed_pairs(model, num_pairs: Union[None, int, torch.Tensor] = None) -> Optional[int]:
    """The capacity ``model`` must grow to after its last evaluation, or None if it sufficed.

    Args:
        model: any model; one without the protocol (no ``max_pairs``/``num_pairs``, or
            ``max_pairs`` still None) never needs more.
        num_pairs: the pair count to judge, when the caller already has it on the host (read with
            its other results, or the largest of several evaluations); default: ``model.num_pairs``
            (read from the device, which synchronizes).

    Returns:
        None when the count fits in ``model.max_pairs``; otherwise the new capacity,
        ``max(ceil(GROWTH * max_pairs), ceil(MARGIN * count))``.

    Raises:
        ValueError: the count is -1 (the model's neighbor search found invalid input on the
            device: non-finite positions or cell, a singular cell), or otherwise negative.
    """
    if not has_capacity(model) or model.max_pairs is None:
        return None
    count = model.num_pairs if num_pairs is None else num_pairs
    count = int(count.reshape(-1)[0].item()) if isinstance(count, torch.Tensor) else int(count)
    if count < 0:
        raise ValueError(
            f"mirage.ff.capacity: the model's neighbor search reported num_pairs = {count}: invalid input "
            "(non-finite positions or cell, or a singular cell); check the structure (did the simulation "
            "blow up? a smaller timestep may help)")
    capacity = int(model.max_pairs)
    if count <= capacity:
        return None
    return max(math.ceil(GROWTH * capacity), math.ceil(MARGIN * count))
