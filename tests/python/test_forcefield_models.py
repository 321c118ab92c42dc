"""The reference force-field models of examples/forcefield (plain PyTorch, CPU): energies, forces by
autograd against finite differences, invariances and periodic boundaries."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from forcefield.benzene import benzene  # noqa: E402
from forcefield.models import PaiNN, SchNet, radius_graph  # noqa: E402

MODELS = [SchNet, PaiNN]
CUTOFF = 5.0


def make_model(cls, dtype=torch.float64):
    torch.manual_seed(0)
    return cls(cutoff=CUTOFF).to(dtype).eval()


def energy_and_forces(model, z, pos, cell=None, pbc=None):
    pos = pos.detach().clone().requires_grad_(True)
    energy = model(z, pos, cell, pbc)
    (grad,) = torch.autograd.grad(energy, pos)
    return energy.detach(), -grad


def periodic_box(cell_shape="orthorhombic", dtype=torch.float64):
    """8 atoms on a jittered 2x2x2 grid in a 6 Å cell (kept away from the faces)."""
    gen = torch.Generator().manual_seed(1234)
    grid = torch.tensor([[a, b, c] for a in (0, 1) for b in (0, 1) for c in (0, 1)], dtype=dtype)
    frac = (grid * 0.5 + 0.25) + (torch.rand(8, 3, generator=gen, dtype=dtype) - 0.5) * 0.1
    if cell_shape == "orthorhombic":
        cell = torch.diag(torch.tensor([6.0, 6.5, 7.0], dtype=dtype))
    else:
        cell = torch.tensor([[6.0, 0.0, 0.0], [1.0, 6.2, 0.0], [0.5, 0.8, 6.4]], dtype=dtype)
    pos = frac @ cell
    z = torch.tensor([1, 6, 8, 1, 6, 1, 8, 6], dtype=torch.long)
    pbc = torch.tensor([True, True, True])
    return z, pos, cell, pbc


def random_rotation(dtype):
    q, r = torch.linalg.qr(torch.randn(3, 3, dtype=dtype))
    q = q * torch.sign(torch.diagonal(r))
    if torch.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def finite_difference_forces(model, z, pos, cell=None, pbc=None, h=1e-5):
    forces = torch.zeros_like(pos)
    with torch.no_grad():
        for a in range(pos.shape[0]):
            for k in range(3):
                plus, minus = pos.clone(), pos.clone()
                plus[a, k] += h
                minus[a, k] -= h
                forces[a, k] = -(model(z, plus, cell, pbc) - model(z, minus, cell, pbc)) / (2 * h)
    return forces


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_energy_scalar_finite(cls, dtype):
    model = make_model(cls, dtype)
    z, pos = benzene(dtype=dtype)
    energy, forces = energy_and_forces(model, z, pos)
    assert energy.dim() == 0 and energy.dtype == dtype and torch.isfinite(energy)
    assert forces.shape == pos.shape and forces.dtype == dtype and torch.isfinite(forces).all()
    zb, posb, cell, pbc = periodic_box(dtype=dtype)
    energy, forces = energy_and_forces(model, zb, posb, cell, pbc)
    assert energy.dim() == 0 and torch.isfinite(energy) and torch.isfinite(forces).all()


@pytest.mark.parametrize("cls", MODELS)
def test_float32_matches_float64(cls):
    m64, m32 = make_model(cls, torch.float64), make_model(cls, torch.float32)
    z, pos = benzene()
    e64, f64 = energy_and_forces(m64, z, pos)
    e32, f32 = energy_and_forces(m32, z, pos.float())
    torch.testing.assert_close(e32.double(), e64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(f32.double(), f64, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize("system", ["benzene", "orthorhombic", "triclinic"])
def test_forces_match_finite_differences(cls, system):
    model = make_model(cls)
    if system == "benzene":
        z, pos = benzene()
        # distort so no force vanishes by symmetry
        pos = pos + 0.05 * torch.randn(pos.shape, dtype=pos.dtype, generator=torch.Generator().manual_seed(7))
        cell = pbc = None
    else:
        z, pos, cell, pbc = periodic_box(system)
    _, forces = energy_and_forces(model, z, pos, cell, pbc)
    reference = finite_difference_forces(model, z, pos, cell, pbc)
    scale = reference.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(forces, reference, rtol=1e-5, atol=1e-6 * max(scale, 1.0))


@pytest.mark.parametrize("cls", MODELS)
def test_translation_rotation_permutation_invariance(cls):
    model = make_model(cls)
    z, pos = benzene()
    pos = pos + 0.05 * torch.randn(pos.shape, dtype=pos.dtype)
    energy, forces = energy_and_forces(model, z, pos)

    e_t, f_t = energy_and_forces(model, z, pos + torch.tensor([1.3, -2.1, 0.7], dtype=pos.dtype))
    torch.testing.assert_close(e_t, energy, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(f_t, forces, rtol=1e-8, atol=1e-10)

    rot = random_rotation(pos.dtype)
    e_r, f_r = energy_and_forces(model, z, pos @ rot.T)
    torch.testing.assert_close(e_r, energy, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(f_r, forces @ rot.T, rtol=1e-8, atol=1e-10)  # forces rotate with the molecule

    perm = torch.randperm(z.shape[0])
    e_p, f_p = energy_and_forces(model, z[perm], pos[perm])
    torch.testing.assert_close(e_p, energy, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(f_p, forces[perm], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize("cell_shape", ["orthorhombic", "triclinic"])
@pytest.mark.parametrize("axis", [0, 2])
def test_periodic_supercell_doubles_energy(cls, cell_shape, axis):
    model = make_model(cls)
    z, pos, cell, pbc = periodic_box(cell_shape)
    energy, forces = energy_and_forces(model, z, pos, cell, pbc)
    big_cell = cell.clone()
    big_cell[axis] *= 2
    z2 = torch.cat([z, z])
    pos2 = torch.cat([pos, pos + cell[axis]])
    energy2, forces2 = energy_and_forces(model, z2, pos2, big_cell, pbc)
    torch.testing.assert_close(energy2, 2 * energy, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(forces2, torch.cat([forces, forces]), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("cls", MODELS)
def test_periodic_translation_and_open_equivalence(cls):
    model = make_model(cls)
    z, pos, cell, pbc = periodic_box("triclinic")
    energy, _ = energy_and_forces(model, z, pos, cell, pbc)
    # shifting atoms by lattice vectors (out of the cell) changes nothing: the graph wraps them back
    moved = pos.clone()
    moved[3] += cell[1]
    moved[5] -= cell[0] + 2 * cell[2]
    torch.testing.assert_close(energy_and_forces(model, z, moved, cell, pbc)[0], energy, rtol=1e-10, atol=1e-10)
    # pbc all False is the open system, whatever the cell
    open_e, _ = energy_and_forces(model, z, pos)
    no_pbc_e, _ = energy_and_forces(model, z, pos, cell, torch.tensor([False, False, False]))
    torch.testing.assert_close(no_pbc_e, open_e, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(open_e, energy)


def test_radius_graph_against_brute_force():
    z, pos, cell, pbc = periodic_box("triclinic")
    i, j, vec = radius_graph(pos, CUTOFF, cell, pbc)
    found = sorted(zip(i.tolist(), j.tolist(), torch.round(vec, decimals=8).tolist()))
    expected = []
    for a in range(pos.shape[0]):
        for b in range(pos.shape[0]):
            for n in [(x, y, w) for x in range(-2, 3) for y in range(-2, 3) for w in range(-2, 3)]:
                if a == b and n == (0, 0, 0):
                    continue
                d = pos[b] + torch.tensor(n, dtype=pos.dtype) @ cell - pos[a]
                if d.norm() < CUTOFF:
                    expected.append((a, b, torch.round(d, decimals=8).tolist()))
    assert found == sorted(expected)


def test_cutoff_larger_than_cell_is_refused():
    z, pos, cell, pbc = periodic_box()
    model = make_model(SchNet)
    with pytest.raises(ValueError, match="cutoff"):
        model(z, pos, cell * 0.5, pbc)


def test_a_singular_cell_with_a_periodic_axis_is_refused():
    # ASE's slabs carry a zero third vector: with pbc on the other two the cell has no volume.
    cell = torch.diag(torch.tensor([5.0, 5.0, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="radius_graph: the cell is singular"):
        radius_graph(torch.rand(4, 3, dtype=torch.float64), 1.0, cell, [True, True, False])
