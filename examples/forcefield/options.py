"""Range checks of command-line options, shared by the force-field scripts (md_benzene.py,
train_student.py, scripts/validate_nve.py): a bad value stops at parse time with argparse's usage
and a message naming the option, rather than deep inside a run."""

from __future__ import annotations

import argparse
from typing import Iterable


def require_ranges(parser: argparse.ArgumentParser, args: argparse.Namespace, *, positive: Iterable[str] = (),
                   at_least_one: Iterable[str] = ()) -> None:
    """parser.error for the first of the `positive` options not above 0 (NaN included) or of the
    `at_least_one` options below 1; names are attributes of `args`, written as --their-names."""
    for name in positive:
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive (got {getattr(args, name)})")
    for name in at_least_one:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
