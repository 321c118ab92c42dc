"""The check every ``from_diffusers`` constructor makes first."""

from torch import nn


def require_diffusers(block: nn.Module, name: str, who: str) -> None:
    """TypeError unless ``block`` is diffusers' ``name`` (the class, or a subclass of it): another
    module would fail later with an AttributeError, or with a reason that misleads."""
    if not any(base.__name__ == name and base.__module__.startswith("diffusers.") for base in type(block).__mro__):
        raise TypeError(f"{who}: expected a diffusers {name}, got {type(block).__name__}")
