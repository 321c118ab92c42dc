import itertools
import math

import subprocess
import sys

import pytest
import torch

import mirage
from common import CUTOFF_RULE, DEVICES, assert_error, capture_graph

# Periodic cells (rows are lattice vectors) and the cutoffs tried in them. "small" has a cutoff
# beyond the whole box along every axis, so an atom meets its own images and pairs meet several.
CELLS = {
    "orthorhombic": ([[5.0, 0, 0], [0, 6.0, 0], [0, 0, 7.0]], 2.9),
    "triclinic": ([[6.0, 0, 0], [1.5, 5.5, 0], [-1.0, 1.2, 6.2]], 3.0),
    "small": ([[3.0, 0, 0], [0.4, 3.5, 0], [0.3, -0.5, 4.0]], 4.5),
}
PBCS = [(True, True, True), (True, False, True), (False, False, False)]


# ---- references and helpers ------------------------------------------------------------------

def brute_force(positions, cutoff, cell=None, pbc=None, batch=None, half=False):
    """{(i, j, S): distance} in float64 with plain torch: every pair of each molecule against
    every image in a box of images wide enough for any pair (the spread of the atoms included)."""
    pos = positions.detach().double().cpu()
    n = pos.shape[0]
    batch = torch.zeros(n, dtype=torch.long) if batch is None else batch.cpu()
    found = {}
    for m in batch.unique().tolist():
        idx = (batch == m).nonzero().flatten()
        r = pos[idx]
        if cell is None:
            lattice, periodic = torch.eye(3, dtype=torch.float64), [False] * 3
        else:
            lattice = (cell[m] if cell.dim() == 3 else cell).detach().double().cpu()
            flags = torch.ones(3, dtype=torch.bool) if pbc is None else pbc.cpu()
            periodic = (flags[m] if flags.dim() == 2 else flags).tolist()
        normals = torch.linalg.inv(lattice)  # column k: fractional coordinate k = r @ normals[:, k]
        ranges = []
        for k in range(3):
            if not periodic[k]:
                ranges.append(range(1))
                continue
            frac = r @ normals[:, k]
            reach = cutoff * normals[:, k].norm().item() + (frac.max() - frac.min()).item()
            ranges.append(range(-math.ceil(reach) - 1, math.ceil(reach) + 2))
        images = torch.tensor(list(itertools.product(*ranges)), dtype=torch.float64)  # [K, 3]
        vec = r[None, :, None, :] - r[:, None, None, :] + (images @ lattice)[None, None]  # [i, j, K, 3]
        d = vec.norm(dim=-1)
        for a, b, k in (d < cutoff).nonzero().tolist():
            i, j, s = idx[a].item(), idx[b].item(), tuple(int(v) for v in images[k].tolist())
            if i == j and s == (0, 0, 0):
                continue
            if half and not (i < j or (i == j and s > (0, 0, 0))):
                continue
            found[(i, j, s)] = d[a, b, k].item()
    return found


def listed(result, cell=None, batch=None):
    """The stored pairs of a neighbor_list result as {(i, j, S): distance}; checks that shifts
    are S @ cell with integer S and that no pair is stored twice."""
    pairs, shifts, distances, num_pairs = (t.detach().cpu() for t in result)
    stored = min(int(num_pairs), pairs.shape[1])
    i, j = pairs[:, :stored]
    sh = shifts[:stored].double()
    if cell is None:
        images = torch.zeros(stored, 3, dtype=torch.float64)
        assert (sh == 0).all()
    else:
        c = cell.detach().double().cpu()
        per_pair = c[batch.cpu()[i]] if c.dim() == 3 else c.expand(stored, 3, 3)
        images = torch.linalg.solve(per_pair.transpose(1, 2), sh.unsqueeze(-1)).squeeze(-1)
        assert (images - images.round()).abs().max().item() < 1e-3 if stored else True
        images = images.round()
    out = {(a, b, tuple(int(v) for v in s)): d
           for a, b, s, d in zip(i.tolist(), j.tolist(), images.tolist(), distances[:stored].double().tolist())}
    assert len(out) == stored, "a pair is listed twice"
    return out


def assert_same_pairs(got, want, cutoff, band, atol):
    """The same pairs, except any within `band` of the cutoff (either side: rounding decides
    those), with distances within atol."""
    for key in got.keys() ^ want.keys():
        d = got.get(key, want.get(key))
        assert abs(d - cutoff) <= band, (key, d, "only in", "mirage" if key in got else "reference")
    worst = max((abs(got[k] - want[k]) for k in got.keys() & want.keys()), default=0.0)
    assert worst <= atol, worst


def random_molecule(n, dtype=torch.float64, device="cpu", side=6.0):
    return (torch.rand(n, 3, dtype=torch.float64) * side).to(dtype=dtype, device=device)


def random_in_cell(n, cell, dtype=torch.float64, device="cpu"):
    """Fractional coordinates in [-0.5, 1.5): inside the cell and outside it (unwrapped MD)."""
    frac = torch.rand(n, 3, dtype=torch.float64) * 2 - 0.5
    return (frac @ torch.tensor(cell, dtype=torch.float64)).to(dtype=dtype, device=device)


def tensor(values, dtype=torch.float64, device="cpu"):
    return torch.tensor(values, dtype=dtype, device=device)


def check_padding(result, cutoff):
    pairs, shifts, distances, num_pairs = result
    count = int(num_pairs)
    pad = slice(min(count, pairs.shape[1]), None)
    assert (pairs[:, pad] == 0).all()
    assert (distances[pad] == cutoff).all()
    assert (shifts[pad, 0] == cutoff).all() and (shifts[pad, 1:] == 0).all()


# ---- CPU reference against brute force --------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("half", [False, True])
def test_open_boundaries_match_brute_force(dtype, half):
    pos = random_molecule(40, dtype)
    result = mirage.ops.neighbor_list(pos, 2.5, half=half)
    assert result.pairs.shape == (2, 40 * 39) and result.pairs.dtype == torch.int64
    assert result.distances.dtype == dtype and result.shifts.dtype == dtype
    assert_same_pairs(listed(result), brute_force(pos, 2.5, half=half), 2.5, 1e-12,
                      1e-12 if dtype == torch.float64 else 1e-6)
    check_padding(result, 2.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(CELLS))
@pytest.mark.parametrize("pbc", PBCS)
@pytest.mark.parametrize("half", [False, True])
def test_periodic_boxes_match_brute_force(dtype, name, pbc, half):
    cell_values, cutoff = CELLS[name]
    pos = random_in_cell(24, cell_values, dtype)
    cell = tensor(cell_values, dtype)
    flags = torch.tensor(pbc)
    result = mirage.ops.neighbor_list(pos, cutoff, cell, flags, max_pairs=20000, half=half)
    want = brute_force(pos, cutoff, cell, flags, half=half)
    assert int(result.num_pairs) == len(want)
    assert_same_pairs(listed(result, cell), want, cutoff, 1e-12, 1e-12 if dtype == torch.float64 else 1e-5)
    check_padding(result, cutoff)


def test_pbc_defaults_to_periodic_when_a_cell_is_given():
    cell_values, cutoff = CELLS["triclinic"]
    pos, cell = random_in_cell(20, cell_values), tensor(cell_values)
    implicit = mirage.ops.neighbor_list(pos, cutoff, cell, max_pairs=5000)
    explicit = mirage.ops.neighbor_list(pos, cutoff, cell, torch.ones(3, dtype=torch.bool), max_pairs=5000)
    for a, b in zip(implicit, explicit):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_atoms_on_boundaries_and_at_the_cutoff(dtype):
    # A 3x3x3 lattice of spacing 1.5 filling a periodic 4.5 box, plus a twin of atom 0 on the far
    # face (x = 4.5: exactly atom 0's image). Every value is exact in binary, so distances of
    # exactly 1.5 are computed exactly, and the rule d < cutoff excludes them at cutoff 1.5.
    grid = torch.tensor(list(itertools.product(range(3), repeat=3)), dtype=torch.float64) * 1.5
    pos = torch.cat([grid, tensor([[4.5, 0.0, 0.0]])]).to(dtype)
    cell = (torch.eye(3, dtype=torch.float64) * 4.5).to(dtype)
    at_cutoff = mirage.ops.neighbor_list(pos, 1.5, cell, max_pairs=400)
    assert int(at_cutoff.num_pairs) == 2  # only the twins, at distance 0 through one image
    assert listed(at_cutoff, cell) == {(0, 27, (-1, 0, 0)): 0.0, (27, 0, (1, 0, 0)): 0.0}
    beyond = mirage.ops.neighbor_list(pos, 1.5 * (1 + 1e-6), cell, max_pairs=400)
    # 28 atoms x 6 lattice neighbors, the 6 neighbors of the twinned site see 2 atoms there, + 2.
    assert int(beyond.num_pairs) == 28 * 6 + 6 + 2
    assert_same_pairs(listed(beyond, cell), brute_force(pos, 1.5 * (1 + 1e-6), cell), 1.5, 0.0, 1e-6)
    # Open boundaries: a pair exactly at the cutoff is out, just inside it is in.
    pair = tensor([[0.0, 0.0, 0.0], [1.5, 0.0, 0.0]], dtype)
    assert int(mirage.ops.neighbor_list(pair, 1.5).num_pairs) == 0
    assert int(mirage.ops.neighbor_list(pair, math.nextafter(1.5, 2.0)).num_pairs) == 2


@pytest.mark.parametrize("half", [False, True])
def test_batch_of_open_molecules(half):
    sizes = [5, 1, 9, 2]
    pos = random_molecule(sum(sizes), side=3.0)
    batch = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    result = mirage.ops.neighbor_list(pos, 2.5, batch=batch, half=half)
    got = listed(result)
    assert all(batch[i] == batch[j] for i, j, _ in got)
    assert_same_pairs(got, brute_force(pos, 2.5, batch=batch, half=half), 2.5, 1e-12, 1e-12)
    # Molecule indices need only be sorted without cells (no cell row to name).
    shifted = mirage.ops.neighbor_list(pos, 2.5, batch=batch * 7 - 3, half=half)
    assert listed(shifted) == got


@pytest.mark.parametrize("per_molecule_pbc", [False, True])
def test_batch_of_periodic_molecules(per_molecule_pbc):
    names = ["orthorhombic", "triclinic", "small"]
    cells = tensor([CELLS[k][0] for k in names])
    sizes = [7, 4, 6]
    pos = torch.cat([random_in_cell(s, CELLS[k][0]) for s, k in zip(sizes, names)])
    batch = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes))
    pbc = torch.tensor(PBCS) if per_molecule_pbc else torch.tensor([True, True, False])
    result = mirage.ops.neighbor_list(pos, 3.2, cells, pbc, batch, max_pairs=5000)
    want = brute_force(pos, 3.2, cells, pbc, batch)
    assert int(result.num_pairs) == len(want)
    assert_same_pairs(listed(result, cells, batch), want, 3.2, 1e-12, 1e-12)


def test_overflow_keeps_the_first_pairs_and_counts_them_all():
    pos = random_molecule(30, side=4.0)
    full = mirage.ops.neighbor_list(pos, 2.5)
    count = int(full.num_pairs)
    assert count > 10
    for capacity in [0, count // 2, count, count + 7]:
        part = mirage.ops.neighbor_list(pos, 2.5, max_pairs=capacity)
        assert part.pairs.shape == (2, capacity) and part.distances.shape == (capacity,)
        assert int(part.num_pairs) == count  # the true count, even when it does not fit
        stored = min(count, capacity)
        assert torch.equal(part.pairs[:, :stored], full.pairs[:, :stored])
        assert torch.equal(part.distances[:stored], full.distances[:stored])
        check_padding(part, 2.5)


def test_memory_is_bounded_by_the_capacity_not_the_pairs_found():
    # ~13 million pairs through the periodic images (730 MB as a list); 1,000 kept, all counted.
    script = """
import resource, torch, mirage
torch.manual_seed(0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
result = mirage.ops.neighbor_list(torch.rand(20, 3, dtype=torch.float64), 20.0, torch.eye(3, dtype=torch.float64),
                                  max_pairs=1000)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(int(result.num_pairs), grown)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    count, grown_kib = int(out[0]), int(out[1])
    assert count > 10_000_000 and grown_kib < 100_000, (count, grown_kib)


def test_default_capacity_holds_every_ordered_pair():
    pos = random_molecule(12, side=1.0)
    result = mirage.ops.neighbor_list(pos, 10.0)
    assert result.pairs.shape == (2, 12 * 11) and int(result.num_pairs) == 12 * 11
    assert (result.distances < 10.0).all()


def test_order_is_grouped_by_center_atom_and_deterministic():
    cell_values, cutoff = CELLS["triclinic"]
    pos, cell = random_in_cell(30, cell_values), tensor(cell_values)
    first = mirage.ops.neighbor_list(pos, cutoff, cell, max_pairs=4000)
    count = int(first.num_pairs)
    assert (first.pairs[0, 1:count] >= first.pairs[0, : count - 1]).all()
    second = mirage.ops.neighbor_list(pos, cutoff, cell, max_pairs=4000)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(CELLS))
def test_half_list_and_its_mirror_make_the_full_list(name):
    cell_values, cutoff = CELLS[name]
    pos, cell = random_in_cell(16, cell_values), tensor(cell_values)
    full = listed(mirage.ops.neighbor_list(pos, cutoff, cell, max_pairs=20000), cell)
    half = listed(mirage.ops.neighbor_list(pos, cutoff, cell, max_pairs=20000, half=True), cell)
    mirrored = {(j, i, tuple(-v for v in s)): d for (i, j, s), d in half.items()}
    assert not half.keys() & mirrored.keys()
    assert half.keys() | mirrored.keys() == full.keys()


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_single_atom(device):
    none = mirage.ops.neighbor_list(torch.empty(0, 3, device=device), 2.0)
    assert none.pairs.shape == (2, 0) and none.shifts.shape == (0, 3) and int(none.num_pairs) == 0
    padded = mirage.ops.neighbor_list(torch.empty(0, 3, device=device), 2.0, max_pairs=3)
    assert int(padded.num_pairs) == 0
    check_padding(padded, 2.0)
    one = torch.zeros(1, 3, device=device)
    assert int(mirage.ops.neighbor_list(one, 2.0, max_pairs=4).num_pairs) == 0
    # Alone in a periodic box smaller than the cutoff: its own images are its neighbors.
    alone = mirage.ops.neighbor_list(one, 2.0, torch.eye(3, device=device) * 1.5, max_pairs=8)
    assert int(alone.num_pairs) == 6  # the face images at 1.5 (the edge ones are 2.12 away)
    assert set(listed(alone, torch.eye(3) * 1.5)) == {
        (0, 0, s) for s in [(1, 0, 0), (-1, 0, 0), (0, 1, 0), (0, -1, 0), (0, 0, 1), (0, 0, -1)]}


# ---- differentiability ------------------------------------------------------------------------

def cutoff_in_a_gap(pos, near, cell=None, pbc=None, batch=None):
    """A cutoff within 0.5 of `near` in the middle of the widest gap between the pair distances
    there (the window's ends count as gap ends: a random system may have no distance near it), so
    that finite-difference steps never move a pair across it."""
    d = sorted(set(round(v, 9) for v in brute_force(pos, near + 1.0, cell, pbc, batch).values()
                   if abs(v - near) < 0.5))
    ends = [near - 0.5] + d + [near + 0.5]
    width, cutoff = max((b - a, (a + b) / 2) for a, b in zip(ends, ends[1:]))
    assert width > 1e-3
    return cutoff


@pytest.mark.parametrize("name", list(CELLS))
@pytest.mark.parametrize("pbc", PBCS[:2])
def test_gradcheck_positions_and_cell(name, pbc):
    cell_values, cutoff = CELLS[name]
    pos = random_in_cell(7, cell_values)
    cell, flags = tensor(cell_values), torch.tensor(pbc)
    cutoff = cutoff_in_a_gap(pos, cutoff, cell, flags)
    count = len(brute_force(pos, cutoff, cell, flags))
    pos.requires_grad_()
    cell.requires_grad_()

    def fn(pos, cell):  # shifts depend on the cell, distances on both; padding entries included
        result = mirage.ops.neighbor_list(pos, cutoff, cell, flags, max_pairs=count + 3)
        return result.shifts, result.distances

    assert torch.autograd.gradcheck(fn, (pos, cell))
    assert torch.autograd.gradgradcheck(fn, (pos, cell))


def test_a_constant_cell_gives_constant_shifts():
    """Positions that require grad in a cell that does not: the distances are differentiable (to
    second order), the shifts, images of the constant cell, are constants with no graph behind."""
    cell_values, cutoff = CELLS["triclinic"]
    pos = random_in_cell(7, cell_values)
    cell, flags = tensor(cell_values), torch.tensor(PBCS[0])
    cutoff = cutoff_in_a_gap(pos, cutoff, cell, flags)
    pos.requires_grad_()
    result = mirage.ops.neighbor_list(pos, cutoff, cell, flags, max_pairs=200)
    assert not result.shifts.requires_grad and result.distances.requires_grad
    fn = lambda pos: mirage.ops.neighbor_list(pos, cutoff, cell, flags, max_pairs=200).distances  # noqa: E731
    assert torch.autograd.gradcheck(fn, (pos,))
    assert torch.autograd.gradgradcheck(fn, (pos,))


def test_gradcheck_open_batch():
    pos = random_molecule(9, side=3.0)
    batch = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1])
    cutoff = cutoff_in_a_gap(pos, 2.0, batch=batch)
    pos.requires_grad_()
    fn = lambda pos: mirage.ops.neighbor_list(pos, cutoff, batch=batch).distances  # noqa: E731
    assert torch.autograd.gradcheck(fn, (pos,))
    assert torch.autograd.gradgradcheck(fn, (pos,))


def test_gradcheck_periodic_batch_with_a_cell_per_molecule():
    names = ["triclinic", "small"]
    cells = tensor([CELLS[k][0] for k in names])
    pos = torch.cat([random_in_cell(4, CELLS[k][0]) for k in names])
    batch = torch.tensor([0] * 4 + [1] * 4)
    cutoff = cutoff_in_a_gap(pos, 3.2, cells, None, batch)
    count = len(brute_force(pos, cutoff, cells, None, batch))
    pos.requires_grad_()
    cells.requires_grad_()
    fn = lambda pos, cells: mirage.ops.neighbor_list(  # noqa: E731
        pos, cutoff, cells, None, batch, max_pairs=count + 2).distances
    assert torch.autograd.gradcheck(fn, (pos, cells))
    assert torch.autograd.gradgradcheck(fn, (pos, cells))


def pair_energy(pos, cell, cutoff, weights, max_pairs):
    """A smooth model energy: per-pair Bessel features with a cosine cutoff, summed per atom."""
    nl = mirage.ops.neighbor_list(pos, cutoff, cell, max_pairs=max_pairs)
    per_pair = mirage.ops.radial_basis(nl.distances, "bessel", weights.numel(), cutoff, "cosine") @ weights
    return torch.zeros(pos.shape[0], dtype=pos.dtype, device=pos.device).index_add(0, nl.pairs[0], per_pair).sum()


def test_forces_and_cell_derivative_match_central_differences():
    cell_values, cutoff = CELLS["triclinic"]
    pos, cell = random_in_cell(10, cell_values), tensor(cell_values)
    weights = torch.randn(4, dtype=torch.float64)
    p = 2000
    pos.requires_grad_()
    cell.requires_grad_()
    energy = pair_energy(pos, cell, cutoff, weights, p)
    forces, d_cell = torch.autograd.grad(-energy, (pos, cell))
    h = 1e-5

    def central(tensor_, index, other_first):
        plus, minus = tensor_.detach().clone(), tensor_.detach().clone()
        plus[index] += h
        minus[index] -= h
        if other_first:
            return (pair_energy(pos.detach(), plus, cutoff, weights, p)
                    - pair_energy(pos.detach(), minus, cutoff, weights, p)) / (2 * h)
        return (pair_energy(plus, cell.detach(), cutoff, weights, p)
                - pair_energy(minus, cell.detach(), cutoff, weights, p)) / (2 * h)

    fd_forces = torch.tensor([[-central(pos, (a, c), False) for c in range(3)] for a in range(10)])
    fd_cell = torch.tensor([[-central(cell, (k, c), True) for c in range(3)] for k in range(3)])
    torch.testing.assert_close(forces, fd_forces, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(d_cell, fd_cell, atol=1e-7, rtol=1e-6)
    assert forces.abs().max() > 1e-3  # the model is not trivially flat


def test_no_gradient_through_padding():
    pos = random_molecule(6, side=2.0).requires_grad_()
    result = mirage.ops.neighbor_list(pos, 1.0, max_pairs=60)
    count = int(result.num_pairs)
    weights = torch.zeros(60, dtype=torch.float64)
    weights[count:] = 1.0  # only the padding entries
    (grad,) = torch.autograd.grad((result.distances * weights).sum(), pos)
    assert (grad == 0).all()


# ---- dispatcher, compile, autocast ------------------------------------------------------------

def opcheck_samples(device):
    cell_values, cutoff = CELLS["triclinic"]
    pos = random_in_cell(9, cell_values, torch.float32, device)
    cell = tensor(cell_values, torch.float32, device)
    cells = torch.stack([cell, cell * 1.1])
    batch = torch.tensor([0] * 5 + [1] * 4, device=device)
    pbc = torch.tensor([True, False, True], device=device)
    return [
        ((pos, 2.5), {}),
        ((pos, cutoff, cell, pbc), {"max_pairs": 300, "half": True}),
        ((pos, cutoff, cells, None, batch), {"max_pairs": 400}),
        ((pos, cutoff, cell), {"max_pairs": 10}),  # overflow
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("sample", range(4))
def test_opcheck(device, requires_grad, sample):
    args, kwargs = opcheck_samples(device)[sample]
    args = tuple(a.requires_grad_(requires_grad) if isinstance(a, torch.Tensor) and a.is_floating_point()
                 else a for a in args)
    op = torch.ops.mirage.neighbor_list.default
    if not requires_grad:
        torch.library.opcheck(op, args, kwargs)
        return
    # opcheck's test_aot_dispatch_dynamic sums every output in place into the first one, and an
    # int64 first output (pairs) cannot take a float sum. The same check (AOTAutograd tracing
    # with dynamic shapes, forward and backward against eager) is done here on the float outputs.
    torch.library.opcheck(op, args, kwargs,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    torch._dynamo.reset()

    def float_outputs(*args):
        _, shifts, distances, _ = op(*args, **kwargs)
        return shifts.sum() + distances.sum()

    traced = torch.compile(float_outputs, backend="aot_eager", dynamic=True, fullgraph=True)
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    expected = float_outputs(*args)
    got = traced(*args)
    torch.testing.assert_close(got, expected)
    for g, e in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(expected, inputs)):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager_with_forces(device):
    torch._dynamo.reset()
    cell_values, cutoff = CELLS["orthorhombic"]
    cell = tensor(cell_values, torch.float32, device)

    def energy(pos):
        nl = mirage.ops.neighbor_list(pos, cutoff, cell, max_pairs=3000)
        return mirage.ops.radial_basis(nl.distances, "bessel", 6, cutoff, "polynomial").sum()

    compiled = torch.compile(energy, fullgraph=True)
    for _ in range(2):  # new positions each call
        pos = random_in_cell(20, cell_values, torch.float32, device).requires_grad_()
        expected = energy(pos)
        (expected_forces,) = torch.autograd.grad(-expected, pos)
        got = compiled(pos)
        (forces,) = torch.autograd.grad(-got, pos)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(forces, expected_forces, atol=1e-4, rtol=1e-4)
        assert forces.abs().max() > 0


def test_autocast_runs_in_float32():
    cell_values, cutoff = CELLS["triclinic"]
    pos, cell = random_in_cell(12, cell_values, torch.float32), tensor(cell_values, torch.float32)
    plain = mirage.ops.neighbor_list(pos, cutoff, cell, max_pairs=500)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = mirage.ops.neighbor_list(pos, cutoff, cell, max_pairs=500)
    assert cast.distances.dtype == torch.float32
    for a, b in zip(plain, cast):
        assert torch.equal(a, b)


# ---- bad input --------------------------------------------------------------------------------

def nl(device, n=5, **kwargs):
    kwargs.setdefault("cutoff", 2.0)
    return mirage.ops.neighbor_list(kwargs.pop("positions", torch.rand(n, 3, device=device)), **kwargs)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda d: nl(d, positions=torch.rand(5, 2, device=d)),
         "mirage::neighbor_list: positions must have shape [N, 3], got [5, 2]"),
        (lambda d: nl(d, positions=torch.ones(5, 3, dtype=torch.int32, device=d)),
         "mirage::neighbor_list: positions must be float32 (float64 off the GPU), got Int"),
        (lambda d: nl(d, positions=torch.rand(5, 3, dtype=torch.half, device=d)),
         "mirage::neighbor_list: positions must be float32 (float64 off the GPU), got Half"),
        (lambda d: nl(d, cutoff=-1.0), f"mirage::neighbor_list: {CUTOFF_RULE}, got -1"),
        (lambda d: nl(d, cutoff=0.0), f"mirage::neighbor_list: {CUTOFF_RULE}, got 0"),
        (lambda d: nl(d, cutoff=float("nan")), f"mirage::neighbor_list: {CUTOFF_RULE}, got nan"),
        (lambda d: nl(d, cell=torch.eye(3, device=d)[:2]),
         "mirage::neighbor_list: cell must have shape [3, 3] without batch, got [2, 3]"),
        (lambda d: nl(d, cell=torch.eye(3, dtype=torch.float64, device=d)),
         "mirage::neighbor_list: cell must have positions' dtype (Float), got Double"),
        (lambda d: nl(d, cell=torch.eye(3, device=d), batch=torch.zeros(5, dtype=torch.long, device=d)),
         "mirage::neighbor_list: cell must have shape [M, 3, 3] with batch (one cell per molecule), got [3, 3]"),
        (lambda d: nl(d, pbc=torch.ones(3, dtype=torch.bool, device=d)),
         "mirage::neighbor_list: pbc needs a cell (open boundaries need neither)"),
        (lambda d: nl(d, cell=torch.eye(3, device=d), pbc=torch.ones(3, dtype=torch.long, device=d)),
         "mirage::neighbor_list: pbc must be bool, got Long"),
        (lambda d: nl(d, cell=torch.eye(3, device=d), pbc=torch.ones(4, dtype=torch.bool, device=d)),
         "mirage::neighbor_list: pbc must have shape [3] (or [M, 3] with batch and M cells), got [4]"),
        (lambda d: nl(d, cell=torch.eye(3, device=d).expand(2, 3, 3), batch=torch.zeros(5, dtype=torch.long, device=d),
                      pbc=torch.ones(3, 3, dtype=torch.bool, device=d)),
         "mirage::neighbor_list: pbc must have shape [3] (or [M, 3] with batch and M cells), got [3, 3]"),
        (lambda d: nl(d, batch=torch.zeros(5, dtype=torch.int32, device=d)),
         "mirage::neighbor_list: batch must be int64, got Int"),
        (lambda d: nl(d, batch=torch.zeros(4, dtype=torch.long, device=d)),
         "mirage::neighbor_list: batch must have shape [N] = [5], got [4]"),
        (lambda d: nl(d, max_pairs=-2),
         "mirage::neighbor_list: max_pairs must be >= 0, or -1 for N * (N - 1), got -2"),
        (lambda d: nl(d, max_pairs=2**62),
         "mirage::neighbor_list: cannot allocate the outputs for max_pairs = 4611686018427387904"),
        (lambda d: nl(d, method="grid"),
         "mirage::neighbor_list: method must be \"auto\", \"direct\" or \"cell_list\", got \"grid\""),
        (lambda d: nl(d, method="cell_list", batch=torch.zeros(5, dtype=torch.long, device=d)),
         "mirage::neighbor_list: method \"cell_list\" takes one molecule; batched molecules use \"direct\" or \"auto\""),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(call, message, device):
    assert_error(call, device, message)


def with_nan_atom():
    pos = torch.rand(5, 3)
    pos[2, 1] = float("nan")
    return pos


# Values: the CPU reads them and raises; CUDA flags them on the device (test_cuda_invalid_values).
INVALID_VALUES = [
    (dict(positions=with_nan_atom()), "mirage::neighbor_list: positions must be finite (atom 2 is not)"),
    (dict(cell=torch.tensor([[4.0, 0, 0], [0, 4.0, 0], [0, 0, 0]])),
     "mirage::neighbor_list: cell must be finite and non-singular (molecule 0 has determinant 0)"),
    (dict(cell=torch.tensor([[4.0, 0, 0], [0, 4.0, 0], [0, 0, float("inf")]])),
     "mirage::neighbor_list: cell must be finite and non-singular (molecule 0 has determinant"),
    (dict(cell=torch.eye(3) * 0.05),
     "mirage::neighbor_list: cutoff must span at most 32 cell widths along a periodic axis "
     "(molecule 0, axis 0: cutoff 2 spans 40)"),
    (dict(positions=torch.tensor([[0.0, 0, 0], [1e9, 0, 0]]), cell=torch.eye(3)),
     "mirage::neighbor_list: positions must lie within 2^24 cell widths of the origin along a periodic "
     "axis (atom 1, axis 0)"),
    (dict(batch=torch.tensor([0, 1, 0, 1, 1])),
     "mirage::neighbor_list: batch must be sorted (batch[1] = 1 > batch[2] = 0)"),
    (dict(batch=torch.tensor([0, 0, 1, 2, 2]), cell=torch.eye(3).expand(2, 3, 3) * 4),
     "mirage::neighbor_list: batch must index the rows of cell, in [0, 2), got 2 at atom 3"),
]


@pytest.mark.parametrize("kwargs,message", INVALID_VALUES)
def test_invalid_values_raise_on_cpu(kwargs, message):
    assert_error(lambda d: nl(d, **kwargs), "cpu", message)


def test_open_axes_of_a_cell_may_be_thin():
    # Only periodic axes bound the cutoff: a thin vacuum axis is fine when it is not periodic.
    cell = torch.diag(torch.tensor([4.0, 4.0, 0.01]))
    pos = random_molecule(6, torch.float32, side=3.0)
    result = mirage.ops.neighbor_list(pos, 2.0, cell, torch.tensor([True, True, False]), max_pairs=200)
    assert_same_pairs(listed(result, cell), brute_force(pos, 2.0, cell, torch.tensor([True, True, False])),
                      2.0, 1e-6, 1e-5)


# ---- CUDA against the CPU reference ----------------------------------------------------------

def assert_cuda_matches_cpu(pos, cutoff, cell=None, pbc=None, batch=None, half=False, method="auto",
                            max_pairs=20000):
    to = lambda t: None if t is None else t.cuda()  # noqa: E731
    gpu = mirage.ops.neighbor_list(pos.cuda(), cutoff, to(cell), to(pbc), to(batch), max_pairs, half, method)
    cpu = mirage.ops.neighbor_list(pos, cutoff, cell, pbc, batch, max_pairs, half)
    count = int(gpu.num_pairs)
    # Both lists whole, so that the counts may differ only by the pairs at the cutoff, which go
    # either way (about one a call in a 3,000-atom box): assert_same_pairs checks those by distance.
    assert count <= max_pairs and int(cpu.num_pairs) <= max_pairs
    assert (gpu.pairs[0, :count].diff() >= 0).all()  # grouped by center atom (no pair at all: nothing to check)
    check_padding(gpu, torch.tensor(cutoff, dtype=torch.float32).item())
    assert_same_pairs(listed(gpu, cell, batch), listed(cpu, cell, batch), cutoff, 1e-4, 5e-5)
    return gpu


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["direct", "cell_list"])
@pytest.mark.parametrize("half", [False, True])
def test_cuda_open_boundaries(method, half):
    pos = random_molecule(300, torch.float32, side=12.0)
    assert_cuda_matches_cpu(pos, 3.0, half=half, method=method, max_pairs=40000)


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["direct", "cell_list"])
@pytest.mark.parametrize("name", list(CELLS))
@pytest.mark.parametrize("pbc", PBCS)
@pytest.mark.parametrize("half", [False, True])
def test_cuda_periodic_boxes(method, name, pbc, half):
    cell_values, cutoff = CELLS[name]
    pos = random_in_cell(60, cell_values, torch.float32)
    assert_cuda_matches_cpu(pos, cutoff, tensor(cell_values, torch.float32), torch.tensor(pbc),
                            half=half, method=method, max_pairs=60000)


@pytest.mark.cuda
def test_cuda_lattice_on_boundaries():
    grid = torch.tensor(list(itertools.product(range(4), repeat=3)), dtype=torch.float32) * 1.5
    cell = torch.eye(3) * 6.0
    for method in ["direct", "cell_list"]:
        gpu = mirage.ops.neighbor_list(grid.cuda(), 1.6, cell.cuda(), max_pairs=1000, method=method)
        assert int(gpu.num_pairs) == 64 * 6
        assert_same_pairs(listed(gpu, cell), brute_force(grid, 1.6, cell), 1.6, 0.0, 1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("per_molecule_pbc", [False, True])
@pytest.mark.parametrize("max_pairs", [20_000, 70_000])  # one block; beyond its capacity limit, the grid
def test_cuda_batches(per_molecule_pbc, max_pairs):
    names = ["orthorhombic", "triclinic", "small"]
    cells = tensor([CELLS[k][0] for k in names], torch.float32)
    sizes = [40, 3, 25]
    pos = torch.cat([random_in_cell(s, CELLS[k][0], torch.float32) for s, k in zip(sizes, names)])
    batch = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes))
    pbc = torch.tensor(PBCS) if per_molecule_pbc else torch.tensor([True, False, True])
    assert_cuda_matches_cpu(pos, 3.2, cells, pbc, batch, max_pairs=max_pairs)
    assert_cuda_matches_cpu(pos, 3.2, None, None, batch, half=True, max_pairs=max_pairs)


def liquid_box(n, dtype=torch.float32):
    """n atoms at a liquid's density (0.1 / A^3) in a slightly triclinic box, positions up to half
    a box outside it."""
    side = (n / 0.1) ** (1 / 3)
    cell_values = [[side, 0, 0], [0.5, side, 0], [-0.4, 0.3, side]]
    return random_in_cell(n, cell_values, dtype), tensor(cell_values, dtype)


@pytest.mark.cuda
def test_cuda_large_periodic_box_methods_agree():
    # 3000 atoms: "auto" is the cell list there (from 1024 atoms) and must equal it bit for bit;
    # the direct search lists the same pairs; both match the CPU reference.
    pos, cell = liquid_box(3000)
    auto = assert_cuda_matches_cpu(pos, 5.0, cell, max_pairs=250_000)
    cells = mirage.ops.neighbor_list(pos.cuda(), 5.0, cell.cuda(), max_pairs=250_000, method="cell_list")
    for a, b in zip(auto, cells):
        assert torch.equal(a, b)
    direct = mirage.ops.neighbor_list(pos.cuda(), 5.0, cell.cuda(), max_pairs=250_000, method="direct")
    assert_same_pairs(listed(direct, cell), listed(cells, cell), 5.0, 1e-4, 1e-5)
    assert_cuda_matches_cpu(pos, 5.0, cell, max_pairs=250_000, method="direct")


@pytest.mark.cuda
@pytest.mark.parametrize("atoms,method", [(1023, "direct"), (1024, "cell_list"), (7000, "cell_list")])
@pytest.mark.parametrize("periodic", [True, False])
def test_cuda_auto_takes_the_cell_list_from_1024_atoms(atoms, method, periodic):
    pos, cell = liquid_box(atoms)
    cell = cell.cuda() if periodic else None  # open: the same atoms as one large molecule
    auto = mirage.ops.neighbor_list(pos.cuda(), 5.0, cell, max_pairs=600_000)
    forced = mirage.ops.neighbor_list(pos.cuda(), 5.0, cell, max_pairs=600_000, method=method)
    assert 0 < int(auto.num_pairs) <= 600_000
    for a, b in zip(auto, forced):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("atoms", [2, 127, 128, 129])
@pytest.mark.parametrize("periodic", [True, False])
def test_cuda_direct_search_in_one_block_and_in_many(atoms, periodic):
    # Up to 128 atoms the direct search runs in one block (one launch), beyond it in a grid.
    pos, cell = liquid_box(atoms)
    gpu = assert_cuda_matches_cpu(pos, 5.0, cell if periodic else None, max_pairs=30_000, method="direct")
    again = mirage.ops.neighbor_list(pos.cuda(), 5.0, cell.cuda() if periodic else None, max_pairs=30_000)
    for a, b in zip(gpu, again):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("method,atoms", [("direct", 80), ("direct", 150), ("cell_list", 80)])
def test_cuda_overflow_and_determinism(method, atoms):
    cell_values, cutoff = CELLS["triclinic"]
    pos = random_in_cell(atoms, cell_values, torch.float32).cuda()
    cell = tensor(cell_values, torch.float32, "cuda")
    full = mirage.ops.neighbor_list(pos, cutoff, cell, max_pairs=20000, method=method)
    again = mirage.ops.neighbor_list(pos, cutoff, cell, max_pairs=20000, method=method)
    for a, b in zip(full, again):
        assert torch.equal(a, b)
    count = int(full.num_pairs)
    part = mirage.ops.neighbor_list(pos, cutoff, cell, max_pairs=count // 3, method=method)
    assert int(part.num_pairs) == count
    assert torch.equal(part.pairs, full.pairs[:, : count // 3])
    assert torch.equal(part.distances, full.distances[: count // 3])


@pytest.mark.cuda
@pytest.mark.parametrize("kwargs,message", INVALID_VALUES)
# the direct search in one block, and in a grid (a capacity beyond the one block's limit)
@pytest.mark.parametrize("method,max_pairs", [("direct", 40), ("direct", 70_000), ("cell_list", 40)])
def test_cuda_invalid_values_poison_the_output(kwargs, message, method, max_pairs):
    kwargs = {k: v.cuda() for k, v in kwargs.items()}
    if "batch" in kwargs:
        if method == "cell_list":
            pytest.skip("the cell list takes no batch")
    result = nl("cuda", max_pairs=max_pairs, method=method, **kwargs)
    assert int(result.num_pairs) == -1
    assert torch.isnan(result.distances).all() and torch.isnan(result.shifts).all()
    assert (result.pairs == 0).all()


@pytest.mark.cuda
def test_cuda_rejects_mixed_devices_and_float64():
    pos = torch.rand(5, 3, device="cuda")
    with pytest.raises(RuntimeError, match=r"mirage::neighbor_list: cell must be on positions' device "
                                           r"\(positions on cuda:0, cell on cpu\)"):
        mirage.ops.neighbor_list(pos, 2.0, torch.eye(3))
    with pytest.raises(RuntimeError, match=r"mirage::neighbor_list: positions must be float32 \(float64 off the GPU\)"):
        mirage.ops.neighbor_list(pos.double(), 2.0)


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["direct", "cell_list"])
def test_cuda_graph_capture_and_replay_with_moved_positions(method):
    cell_values, cutoff = CELLS["triclinic"]
    cell = tensor(cell_values, torch.float32, "cuda")
    pos = random_in_cell(64, cell_values, torch.float32, "cuda")
    capacity = 3000  # ~2300 pairs at this density; packed 4x closer (64 atoms, cutoff over the
    # packed region) they are about 3600 (H200, 2026-11-22), which overflows it

    def step():
        result = mirage.ops.neighbor_list(pos, cutoff, cell, max_pairs=capacity, method=method)
        return result, mirage.ops.radial_basis(result.distances, "bessel", 8, cutoff, "cosine")

    graph, (captured, features) = capture_graph(step)
    for scale in [1.0, 1.0, 4.0]:  # the last round packs the atoms 8x denser: they overflow
        pos.copy_(random_in_cell(64, [[v / scale for v in row] for row in cell_values], torch.float32, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        expected, expected_features = step()
        for a, b in zip(captured, expected):
            assert torch.equal(a, b)
        assert torch.equal(features, expected_features)
    assert int(captured.num_pairs) > capacity  # overflow reported on the device, not an error


@pytest.mark.cuda
def test_cuda_graph_captures_energy_forces_and_stress():
    # What the calculator captures: energy, forces and the cell derivative of a model built on
    # both ops; the backward (recomputed with PyTorch ops) must not sync with the host either.
    cell_values, cutoff = CELLS["triclinic"]
    cell = tensor(cell_values, torch.float32, "cuda").requires_grad_()
    pos = random_in_cell(48, cell_values, torch.float32, "cuda").requires_grad_()
    weights = torch.randn(6, device="cuda")

    def step():
        energy = pair_energy(pos, cell, cutoff, weights, 4000)
        forces, d_cell = torch.autograd.grad(-energy, (pos, cell))
        return energy.detach(), forces, d_cell

    graph, captured = capture_graph(step)
    for _ in range(3):
        with torch.no_grad():
            pos.copy_(random_in_cell(48, cell_values, torch.float32, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, step()):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert captured[1].abs().max() > 0
