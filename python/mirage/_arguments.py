"""Argument checks shared by mirage's Python modules."""

import numbers
from typing import Any, Callable


def count(value: Any, where: str, minimum: int = 1) -> int:
    """``value`` as an int of at least ``minimum``: ints and NumPy's integers (ASE passes them),
    not bools or floats; anything else raises ValueError naming ``where`` ("mirage.optimize:
    max_graphs")."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{where} must be an int >= {minimum}, got {value!r}")
    return int(value)


def flag(value: Any, where: str) -> bool:
    """``value`` if it is a bool; anything else raises ValueError naming ``where`` (a string such
    as "False" is truthy, and would turn an option on)."""
    if not isinstance(value, bool):
        raise ValueError(f"{where} must be True or False, got {value!r}")
    return value


def function(value: Any, where: str) -> Callable[..., Any]:
    """``value`` if it can be called; anything else raises TypeError naming ``where`` (it would
    otherwise fail at its first call, inside a warm-up)."""
    if not callable(value):
        raise TypeError(f"{where} must be callable, got {type(value).__name__}")
    return value
