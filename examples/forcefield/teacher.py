"""An analytic force field for benzene: the "teacher" the NVE validation's students (SchNet, PaiNN) learn.

The reference models of models.py have random weights; molecular dynamics on a random energy
surface says nothing (the molecule flies apart, and free particles conserve energy trivially).
This valence force field gives benzene a physical surface to learn: harmonic C-C and C-H bonds,
harmonic C-C-C and C-C-H angles, torsions around the ring bonds, an out-of-plane term at each
carbon and a short-range repulsive wall between atoms three or more bonds apart. Every term is at
its minimum at the geometry of benzene.py, so that geometry is an exact minimum with energy 0.

Units: eV, Å, radians. The constants are round numbers of the size of real benzene force
constants (C-C stretch 7.2 mdyn/Å, C-H 5.1 mdyn/Å); the harmonic spectrum
(:func:`harmonic_wavenumbers`) spans 289 to 3074 cm^-1 (the real molecule: 398 to ~3060), which is
what matters for the integration: the C-H stretch period (~11 fs) sets the time step.

Only benzene in the atom order of benzene.py (six ring carbons, then hydrogen k bonded to carbon
k) is described; other inputs are refused.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from .benzene import benzene

K_CC = 45.0  # eV/Å^2, ring C-C bond
K_CH = 32.0  # eV/Å^2, C-H bond
K_CCC = 6.0  # eV/rad^2
K_CCH = 3.5  # eV/rad^2
K_TORSION = 0.25  # eV, E = K (1 - cos(phi - phi0)) for every dihedral around a ring bond
K_OOP = 8.0  # eV/Å^2, E = K/2 h^2, h = height of a carbon over the plane of its three neighbours
WALL_RADIUS = 2.0  # Å, below every 1-4 (and farther) distance of the equilibrium geometry (>= 2.48 Å)
K_WALL = 20.0  # eV/Å^3, E = K (WALL_RADIUS - r)^3 for r < WALL_RADIUS

# eV/(Å^2 amu) -> cm^-1: sqrt(1 eV / (1 Å^2 * 1 amu)) / (2 pi c)
_WAVENUMBER_PER_SQRT_EV_A2_AMU = 521.47


def _angle(a, b):
    """Angle between vectors [..., 3]; atan2 keeps it accurate near 0 and pi."""
    return torch.atan2(torch.linalg.cross(a, b).norm(dim=-1), (a * b).sum(-1))


def _cos_dihedral(p0, p1, p2, p3):
    n1 = torch.linalg.cross(p1 - p0, p2 - p1)
    n2 = torch.linalg.cross(p2 - p1, p3 - p2)
    return (n1 * n2).sum(-1) / (n1.norm(dim=-1) * n2.norm(dim=-1))


def _height(p, a, b, c):
    """Signed distance of p from the plane through a, b, c."""
    n = torch.linalg.cross(b - a, c - a)
    return ((p - a) * n).sum(-1) / n.norm(dim=-1)


class BenzeneTeacher(nn.Module):
    """Valence force field of benzene. ``energy = teacher(atomic_numbers, positions)`` in eV.

    Same call as the models of models.py (cell and pbc must be None: an isolated molecule), so it
    can stand wherever they do; forces are ``-autograd.grad(energy, positions)``. Positions may
    carry leading batch dimensions ([..., 12, 3] -> energy [...]).
    """

    def __init__(self):
        super().__init__()
        z, eq = benzene(torch.float64)
        self.register_buffer("atomic_numbers", z)
        self.register_buffer("equilibrium", eq)
        ring = [(k, (k + 1) % 6) for k in range(6)]
        bonds = ring + [(k, k + 6) for k in range(6)]
        neighbours = {a: set() for a in range(12)}
        for a, b in bonds:
            neighbours[a].add(b)
            neighbours[b].add(a)
        angles = [(a, c, b) for c in range(6) for a, b in itertools.combinations(sorted(neighbours[c]), 2)]
        torsions = [(a, b, c, d) for b, c in ring for a in sorted(neighbours[b] - {c})
                    for d in sorted(neighbours[c] - {b})]
        impropers = [(c, *sorted(neighbours[c])) for c in range(6)]
        within_two = {frozenset(b) for b in bonds} | {frozenset((a, b)) for a, _, b in angles}
        far = [(a, b) for a, b in itertools.combinations(range(12), 2) if frozenset((a, b)) not in within_two]

        def index(rows):
            return torch.tensor(rows, dtype=torch.long)

        self.register_buffer("bonds", index(bonds))
        self.register_buffer("angles", index(angles))
        self.register_buffer("torsions", index(torsions))
        self.register_buffer("impropers", index(impropers))
        self.register_buffer("far_pairs", index(far))
        is_h = z == 1
        self.register_buffer("k_bond", torch.where(is_h[self.bonds[:, 1]], K_CH, K_CC).double())
        self.register_buffer("k_angle", torch.where(is_h[self.angles].any(-1), K_CCH, K_CCC).double())
        # Equilibrium values measured on the reference geometry, so it is a minimum by construction.
        with torch.no_grad():
            self.register_buffer("r0", self._bond_lengths(eq))
            self.register_buffer("theta0", self._angles(eq))
            self.register_buffer("cos_phi0", torch.round(self._cos_dihedrals(eq)))  # planar: +-1
            far_r = self._distances(eq, self.far_pairs)
        assert float(far_r.min()) > WALL_RADIUS

    @staticmethod
    def _distances(pos, pairs):
        return (pos[..., pairs[:, 1], :] - pos[..., pairs[:, 0], :]).norm(dim=-1)

    def _bond_lengths(self, pos):
        return self._distances(pos, self.bonds)

    def _angles(self, pos):
        a, c, b = self.angles.unbind(-1)
        return _angle(pos[..., a, :] - pos[..., c, :], pos[..., b, :] - pos[..., c, :])

    def _cos_dihedrals(self, pos):
        a, b, c, d = self.torsions.unbind(-1)
        return _cos_dihedral(pos[..., a, :], pos[..., b, :], pos[..., c, :], pos[..., d, :])

    def terms(self, positions):
        """The energy split by term (dict of [...] tensors, eV), for inspection and tests."""
        pos = positions.to(self.equilibrium.dtype)
        c, n1, n2, n3 = self.impropers.unbind(-1)
        h = _height(pos[..., c, :], pos[..., n1, :], pos[..., n2, :], pos[..., n3, :])
        wall = torch.clamp(WALL_RADIUS - self._distances(pos, self.far_pairs), min=0.0)
        return {
            "bond": (0.5 * self.k_bond * (self._bond_lengths(pos) - self.r0) ** 2).sum(-1),
            "angle": (0.5 * self.k_angle * (self._angles(pos) - self.theta0) ** 2).sum(-1),
            "torsion": (K_TORSION * (1.0 - self.cos_phi0 * self._cos_dihedrals(pos))).sum(-1),
            "out_of_plane": (0.5 * K_OOP * h**2).sum(-1),
            "wall": (K_WALL * wall**3).sum(-1),
        }

    def forward(self, atomic_numbers, positions, cell=None, pbc=None):
        if cell is not None or pbc is not None:
            raise ValueError("BenzeneTeacher: an isolated molecule only (cell and pbc must be None)")
        if positions.shape[-2:] != (12, 3) or not torch.equal(atomic_numbers.cpu(), self.atomic_numbers.cpu()):
            raise ValueError("BenzeneTeacher: expects benzene in the atom order of benzene.py "
                             f"(atomic numbers {self.atomic_numbers.tolist()}, positions [..., 12, 3]); "
                             f"got atomic numbers {atomic_numbers.tolist()}, positions {list(positions.shape)}")
        energy = sum(self.terms(positions).values())
        return energy.to(positions.dtype)


def energy_and_forces(teacher, positions):
    """Energy [...] and forces [..., 12, 3] (eV, eV/Å) at positions [..., 12, 3]."""
    pos = positions.detach().requires_grad_(True)
    energy = teacher(teacher.atomic_numbers, pos)
    (grad,) = torch.autograd.grad(energy.sum(), pos)
    return energy.detach(), -grad


def hessian(teacher, positions=None):
    """Cartesian Hessian [36, 36] (eV/Å^2) at positions [12, 3] (default: the equilibrium)."""
    pos = teacher.equilibrium if positions is None else positions.to(teacher.equilibrium.dtype)
    flat = pos.reshape(-1).detach()
    h = torch.autograd.functional.hessian(lambda x: teacher(teacher.atomic_numbers, x.reshape(12, 3)), flat)
    return 0.5 * (h + h.T)


def normal_modes(teacher, masses):
    """Vibrational modes at the equilibrium: (omega^2 [30] in eV/(Å^2 amu), Cartesian mode vectors
    [30, 12, 3], mass-weighted-orthonormal: sum_a m_a u_ka . u_la = delta_kl). The six zero modes
    (translations, rotations) are dropped."""
    m = torch.as_tensor(masses, dtype=torch.float64).repeat_interleave(3)
    weighted = hessian(teacher) / torch.sqrt(m[:, None] * m[None, :])
    omega2, vectors = torch.linalg.eigh(weighted)
    omega2, vectors = omega2[6:], vectors[:, 6:]
    return omega2, (vectors / torch.sqrt(m)[:, None]).T.reshape(-1, 12, 3)


def harmonic_wavenumbers(teacher, masses):
    """The 30 harmonic vibrational wavenumbers (cm^-1) at the equilibrium."""
    omega2, _ = normal_modes(teacher, masses)
    return _WAVENUMBER_PER_SQRT_EV_A2_AMU * torch.sqrt(omega2)
