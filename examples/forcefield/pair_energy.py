"""The reference models' energy from a given pair list: the body of SchNet.forward and PaiNN.forward
(models.py) after radius_graph, on the same modules, per atom.

The models build their pairs with ``nonzero``, which a CUDA graph cannot capture and which takes
one molecule at a time. Two users of the same body need the pairs from outside: the benchmark's
hand-made CUDA graph peer (a static pair list) and the students' training (a batch of
conformations as one graph of disjoint molecules, every ordered pair of each).
"""

from __future__ import annotations

import math

import torch

from forcefield.models import PaiNN, SchNet, cosine_cutoff


def atom_energies(model, atomic_numbers, i, j, vec):
    """Each atom's share of ``model``'s energy [N] (the readout before its sum), from receivers i,
    senders j and pair vectors vec = r_j + shift - r_i [P, 3]. Pairs at or beyond the cutoff add
    exactly nothing (the cosine cutoff is 0 there), so all ordered pairs of a molecule give the
    model's own energy up to rounding."""
    if not isinstance(model, (SchNet, PaiNN)):
        raise TypeError(f"atom_energies: no pair-list forward for {type(model).__name__}")
    d = vec.norm(dim=-1)
    fcut = cosine_cutoff(d, model.cutoff)
    if isinstance(model, SchNet):
        rbf = torch.exp(-((d[:, None] - model.centers) ** 2) / (2 * model.width**2))
        x = model.embedding(atomic_numbers)
        for interaction in model.interactions:
            x = x + interaction(x, rbf, fcut, i, j)
        return model.readout(x)[:, 0]
    direction = vec / d[:, None]
    rbf = math.sqrt(2.0 / model.cutoff) * torch.sin(d[:, None] * model.frequencies) / d[:, None]
    s = model.embedding(atomic_numbers)
    v = torch.zeros(s.shape[0], 3, s.shape[1], dtype=s.dtype, device=s.device)
    for message, update in zip(model.messages, model.updates):
        s, v = message(s, v, rbf, fcut, direction, i, j)
        s, v = update(s, v)
    return model.readout(s)[:, 0]
