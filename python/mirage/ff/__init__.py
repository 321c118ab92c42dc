"""mirage.ff: machine-learned force fields on the GPU.

- :func:`optimize` swaps the neighbor search, radial basis and message passing of SchNet- and
  PaiNN-style models for mirage's fused ops and returns a model with the same call,
  ``energy = model(atomic_numbers, positions, cell, pbc)`` (:func:`report` says what it swapped).
- :class:`Calculator` is an ASE calculator around any such model, graph-captured per atom count.
- :mod:`mirage.ff.md` runs molecular dynamics on the GPU, many steps per CUDA-graph replay.

The neighbor-capacity protocol: a model whose neighbor list has a fixed capacity (mirage's fused
models) has an int attribute ``max_pairs`` (the capacity its next forward uses; settable) and a
``[1]`` int64 buffer ``num_pairs`` holding the true pair count of its last forward, written on the
device (graph-safe). ``num_pairs > max_pairs`` means the last result is invalid (overflow): grow
``max_pairs`` and recompute (recapture). ``num_pairs == -1`` means invalid input (non-finite
positions, a singular cell) detected on the device. See :mod:`mirage.ff.capacity`.

ASE is imported only when the calculator or the MD driver is used.
"""

import importlib

# Eager, not lazy: importing the submodule mirage.ff.optimize sets the package attribute
# `optimize` to that module, which would shadow the function after the first lazy lookup.
from .optimize import optimize, report  # noqa: E402

__all__ = ["Calculator", "capacity", "md", "optimize", "report"]

_LAZY = {
    "Calculator": ("calculator", "Calculator"),
}


def __getattr__(name):
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    if name in ("md", "capacity"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
