"""Argument checks shared by mirage's Python modules."""

import numbers
from typing import Any


def count(value: Any, where: str, minimum: int = 1) -> int:
    """``value`` as an int of at least ``minimum``: ints and NumPy's integers (ASE passes them),
    not bools or floats; anything else raises ValueError naming ``where`` ("mirage.optimize:
    max_graphs")."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{where} must be an int >= {minimum}, got {value!r}")
    return int(value)
