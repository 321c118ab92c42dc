"""Two reference force-field models, SchNet and PaiNN, written as ordinary PyTorch.

This is "user code": nothing here knows about mirage. Both models have the signature

    energy = model(atomic_numbers, positions, cell=None, pbc=None)

with atomic_numbers [N] long, positions [N, 3] (Å), cell [3, 3] (rows are the lattice vectors, the
ASE convention) and pbc [3] bools. Forces are ``-torch.autograd.grad(energy, positions)[0]``.

The radius graph is built the way users usually build it: all pairwise differences, a mask
``d < cutoff and not (i == j in the same image)``, ``nonzero``. Periodic boxes (orthorhombic or
triclinic) are handled by wrapping the atoms into the cell and looping over the 27 neighbouring
images (-1, 0, 1 along each periodic lattice vector). Limit: the graph is exact only when the cutoff is
at most the smallest perpendicular width of the cell along a periodic direction (a ValueError is
raised otherwise); with cutoff <= half that width each pair appears at most once (minimum image),
between half and the full width an atom may also see its own images and several images of a
neighbour, which is still correct.

References: Schütt et al., SchNet (2017); Schütt, Unke, Gastegger, PaiNN (ICML 2021).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn


def radius_graph(positions, cutoff, cell=None, pbc=None):
    """Pairs (i, j) with |r_j + shift - r_i| < cutoff. Returns i, j and the vectors r_j + shift - r_i."""
    dtype, device = positions.dtype, positions.device
    offsets = [(0, 0, 0)]
    if cell is not None and pbc is not None:
        cell = torch.as_tensor(cell, dtype=dtype, device=device)
        pbc = [bool(p) for p in torch.as_tensor(pbc).reshape(3).tolist()]
        if any(pbc):
            volume = torch.linalg.det(cell).abs()
            if not volume > 0:  # ASE's zero lattice vector on an open axis included
                raise ValueError("radius_graph: the cell is singular (volume 0); a periodic axis needs three "
                                 "independent lattice vectors")
            for k in range(3):
                if pbc[k]:
                    width = volume / torch.linalg.cross(cell[(k + 1) % 3], cell[(k + 2) % 3]).norm()
                    if cutoff > width:
                        raise ValueError(f"radius_graph: cutoff {cutoff} exceeds the cell width "
                                         f"{float(width):.4g} along lattice vector {k}")
            ranges = [(-1, 0, 1) if p else (0,) for p in pbc]
            offsets = list(itertools.product(*ranges))
            offsets.remove((0, 0, 0))
            offsets.insert(0, (0, 0, 0))  # image 0 is the home cell
            # Wrap the atoms into the cell along periodic directions (a constant shift per atom,
            # so gradients are unchanged).
            with torch.no_grad():
                periodic = torch.tensor(pbc, device=device)
                image = torch.where(periodic, torch.floor(positions @ torch.linalg.inv(cell)), 0.0)
            positions = positions - image @ cell
    offsets = torch.tensor(offsets, dtype=dtype, device=device)  # [S, 3]
    shifts = offsets @ cell if len(offsets) > 1 else offsets  # [S, 3] Cartesian
    with torch.no_grad():
        diff = positions[None, None, :, :] + shifts[:, None, None, :] - positions[None, :, None, :]
        dist = diff.norm(dim=-1)  # [S, N, N]
        mask = dist < cutoff
        n = positions.shape[0]
        mask[0] &= ~torch.eye(n, dtype=torch.bool, device=device)
        s, i, j = mask.nonzero(as_tuple=True)
    vec = positions[j] + shifts[s] - positions[i]  # differentiable in positions (and cell)
    return i, j, vec


def cosine_cutoff(d, cutoff):
    return 0.5 * (torch.cos(math.pi * d / cutoff) + 1.0) * (d < cutoff)


def shifted_softplus(x):
    return F.softplus(x) - math.log(2.0)


class ShiftedSoftplus(nn.Module):
    def forward(self, x):
        return shifted_softplus(x)


# ----------------------------------------------------------------------------------------- SchNet
class SchNetInteraction(nn.Module):
    """Continuous-filter convolution: x_i += MLP(sum_j x_j W(r_ij) * f_cut(r_ij))."""

    def __init__(self, hidden, num_rbf):
        super().__init__()
        self.filter = nn.Sequential(nn.Linear(num_rbf, hidden), ShiftedSoftplus(), nn.Linear(hidden, hidden))
        self.in2f = nn.Linear(hidden, hidden, bias=False)
        self.f2out = nn.Sequential(nn.Linear(hidden, hidden), ShiftedSoftplus(), nn.Linear(hidden, hidden))

    def forward(self, x, rbf, fcut, i, j):
        w = self.filter(rbf) * fcut[:, None]  # [P, F]
        h = self.in2f(x)
        messages = h[j] * w
        agg = torch.zeros_like(h).index_add_(0, i, messages)
        return self.f2out(agg)


class SchNet(nn.Module):
    def __init__(self, hidden=128, num_interactions=3, num_rbf=20, cutoff=5.0, max_z=100):
        super().__init__()
        self.cutoff = cutoff
        self.embedding = nn.Embedding(max_z, hidden)
        self.interactions = nn.ModuleList(SchNetInteraction(hidden, num_rbf) for _ in range(num_interactions))
        self.readout = nn.Sequential(nn.Linear(hidden, hidden // 2), ShiftedSoftplus(), nn.Linear(hidden // 2, 1))
        # Gaussian RBF: centres evenly over [0, cutoff], width = spacing.
        self.register_buffer("centers", torch.linspace(0.0, cutoff, num_rbf))
        self.width = cutoff / (num_rbf - 1)

    def forward(self, atomic_numbers, positions, cell=None, pbc=None):
        i, j, vec = radius_graph(positions, self.cutoff, cell, pbc)
        d = vec.norm(dim=-1)
        rbf = torch.exp(-((d[:, None] - self.centers) ** 2) / (2 * self.width**2))
        fcut = cosine_cutoff(d, self.cutoff)
        x = self.embedding(atomic_numbers)
        for interaction in self.interactions:
            x = x + interaction(x, rbf, fcut, i, j)
        return self.readout(x).sum()


# ------------------------------------------------------------------------------------------ PaiNN
class PaiNNMessage(nn.Module):
    def __init__(self, hidden, num_rbf):
        super().__init__()
        self.hidden = hidden
        self.phi = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 3 * hidden))
        self.filter = nn.Linear(num_rbf, 3 * hidden)

    def forward(self, s, v, rbf, fcut, direction, i, j):
        x = self.phi(s)[j] * self.filter(rbf) * fcut[:, None]  # [P, 3F]
        ds, dv_v, dv_s = torch.split(x, self.hidden, dim=-1)
        dv = v[j] * dv_v[:, None, :] + dv_s[:, None, :] * direction[:, :, None]  # [P, 3, F]
        s = s + torch.zeros_like(s).index_add_(0, i, ds)
        v = v + torch.zeros_like(v).index_add_(0, i, dv)
        return s, v


class PaiNNUpdate(nn.Module):
    """PaiNN's update block. norm_eps goes under the square root of |V v|: 1e-8 is the customary
    value; a larger one smooths the norm's cone where V v passes near zero (in molecular dynamics
    a much smoother energy, docs/perf/forcefield.md)."""

    def __init__(self, hidden, norm_eps=1e-8):
        super().__init__()
        self.hidden = hidden
        self.norm_eps = norm_eps
        self.U = nn.Linear(hidden, hidden, bias=False)
        self.V = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, 3 * hidden))

    def forward(self, s, v):
        uv, vv = self.U(v), self.V(v)  # [N, 3, F]
        vv_norm = torch.sqrt((vv**2).sum(dim=1) + self.norm_eps)
        a = self.mlp(torch.cat([s, vv_norm], dim=-1))
        a_vv, a_sv, a_ss = torch.split(a, self.hidden, dim=-1)
        v = v + a_vv[:, None, :] * uv
        s = s + a_sv * (uv * vv).sum(dim=1) + a_ss
        return s, v


class PaiNN(nn.Module):
    def __init__(self, hidden=128, num_interactions=3, num_rbf=20, cutoff=5.0, max_z=100, norm_eps=1e-8):
        super().__init__()
        self.cutoff = cutoff
        self.embedding = nn.Embedding(max_z, hidden)
        self.messages = nn.ModuleList(PaiNNMessage(hidden, num_rbf) for _ in range(num_interactions))
        self.updates = nn.ModuleList(PaiNNUpdate(hidden, norm_eps) for _ in range(num_interactions))
        self.readout = nn.Sequential(nn.Linear(hidden, hidden // 2), nn.SiLU(), nn.Linear(hidden // 2, 1))
        # sinc (Bessel) RBF: sqrt(2/c) sin(n pi d / c) / d, n = 1..num_rbf.
        self.register_buffer("frequencies", torch.arange(1, num_rbf + 1, dtype=torch.float32) * math.pi / cutoff)

    def forward(self, atomic_numbers, positions, cell=None, pbc=None):
        i, j, vec = radius_graph(positions, self.cutoff, cell, pbc)
        d = vec.norm(dim=-1)
        direction = vec / d[:, None]
        rbf = math.sqrt(2.0 / self.cutoff) * torch.sin(d[:, None] * self.frequencies) / d[:, None]
        fcut = cosine_cutoff(d, self.cutoff)
        s = self.embedding(atomic_numbers)
        v = torch.zeros(s.shape[0], 3, s.shape[1], dtype=s.dtype, device=s.device)
        for message, update in zip(self.messages, self.updates):
            s, v = message(s, v, rbf, fcut, direction, i, j)
            s, v = update(s, v)
        return self.readout(s).sum()
