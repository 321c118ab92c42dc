"""Benzene (C6H6): atomic numbers and a planar D6h geometry in Å (C-C 1.39 Å, C-H 1.09 Å)."""

from __future__ import annotations

import math

import torch

CC_BOND = 1.39  # Å; in a regular hexagon the C ring radius equals the C-C bond length
CH_BOND = 1.09  # Å


def benzene(dtype=torch.float64, device=None):
    """Return (atomic_numbers [12] long, positions [12, 3]) for benzene centred at the origin.

    Atoms 0-5 are carbons around the ring, atoms 6-11 the hydrogens bonded to them, in the xy plane.
    """
    angles = [k * math.pi / 3 for k in range(6)]
    carbons = [(CC_BOND * math.cos(a), CC_BOND * math.sin(a), 0.0) for a in angles]
    r_h = CC_BOND + CH_BOND
    hydrogens = [(r_h * math.cos(a), r_h * math.sin(a), 0.0) for a in angles]
    atomic_numbers = torch.tensor([6] * 6 + [1] * 6, dtype=torch.long, device=device)
    positions = torch.tensor(carbons + hydrogens, dtype=dtype, device=device)
    return atomic_numbers, positions
