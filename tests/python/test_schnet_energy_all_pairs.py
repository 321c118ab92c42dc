"""mirage::schnet_energy_all_pairs: schnet_energy over every pair of an open system, the pair search
inside the op. The reference is schnet_energy's float64 composite on an explicit list of every pair."""
import pytest
import torch

import mirage
from common import (DEVICES, _in_float64, assert_error, assert_first_order_only, assert_within_pytorch_error, capture_graph,
                    onto_atoms, replace_item)
from test_schnet_energy import PREPARABLE, _prepare, _preparable_on, make_inputs, schnet_composite
from tolerances import tolerance

# test_schnet_energy's configs: 12 atoms; odd widths and absent biases; one atom (no pairs); 40
# atoms (1,560 pairs: more than a block keeps in shared memory, and more atoms than blocks); 30
# atoms with widths past 128.
NAMES = ["benzene", "odd", "lonely", "many_atoms", "wide"]


def make_all_pairs_inputs(name, device="cpu", dtype=torch.float64, spread=1.6):
    """(atomic_numbers, embedding, positions, cutoff, num_rbf, weights, activations): atoms in a
    cube ``spread`` cutoffs wide, so that some pairs lie beyond the cutoff."""
    atomic_numbers, embedding, _, _, cutoff, num_rbf, weights, activations = make_inputs(name, device, dtype)
    positions = torch.rand(atomic_numbers.shape[0], 3, dtype=torch.float64) * (spread * cutoff)
    return atomic_numbers, embedding, positions.to(device=device, dtype=dtype), cutoff, num_rbf, weights, activations


def every_pair(atoms, device):
    """[2, N (N - 1)]: every (i, j), i != j."""
    i, j = torch.meshgrid(torch.arange(atoms, device=device), torch.arange(atoms, device=device), indexing="ij")
    apart = i != j
    return torch.stack([i[apart], j[apart]])


def as_pair_list(args):
    """schnet_energy's arguments for the same model and atoms, every pair listed."""
    atomic_numbers, embedding, positions, cutoff, num_rbf, weights, activations = args
    pairs = every_pair(positions.shape[0], positions.device)
    return atomic_numbers, embedding, pairs, positions[pairs[1]] - positions[pairs[0]], cutoff, num_rbf, weights, \
        activations


def within_cutoff(positions, cutoff):
    pairs = every_pair(positions.shape[0], positions.device)
    return int(((positions[pairs[1]] - positions[pairs[0]]).double().norm(dim=1) < cutoff).sum())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("prepared", [False, True], ids=["weights", "prepared"])
def test_all_pairs_matches_the_composite_on_every_pair(device, name, prepared):
    dtype = torch.float32 if device == "cuda" else torch.float64
    if prepared and (name not in PREPARABLE or not _preparable_on(device, name)):
        pytest.skip("no tables for this filter network")
    torch.manual_seed(1)
    args = make_all_pairs_inputs(name, device, dtype)
    listed = as_pair_list(args)
    table = _prepare(listed) if prepared else None
    num_pairs = torch.full((1,), -7, dtype=torch.int64, device=device)
    energy, grad = mirage.ops.schnet_energy_all_pairs(*args, prepared=table, num_pairs=num_pairs)
    assert energy.shape == () and grad.shape == args[2].shape and energy.dtype == grad.dtype == dtype
    atoms, pairs = args[0].shape[0], listed[2]
    assert int(num_pairs) == within_cutoff(args[2], args[3])
    assert name == "lonely" or 0 < int(num_pairs) < pairs.shape[1]  # some pairs beyond the cutoff

    ref_energy, ref_grad = schnet_composite(*_in_float64(listed))
    ref_positions = onto_atoms(ref_grad, pairs, atoms)
    if dtype == torch.float64:
        # The tables interpolate the filter networks to ~1e-11 of their largest values.
        tol = dict(rtol=1e-9, atol=1e-9 * max(ref_positions.abs().max().item(), 1.0)) if prepared \
            else tolerance(dtype)
        torch.testing.assert_close(energy, ref_energy, **tol)
        torch.testing.assert_close(grad, ref_positions, **tol)
        return
    torch_energy, torch_grad = schnet_composite(*listed)
    assert_within_pytorch_error(energy, torch_energy, ref_energy, name)
    assert_within_pytorch_error(grad, onto_atoms(torch_grad, pairs, atoms), ref_positions, name)


@pytest.mark.parametrize("device", DEVICES)
def test_all_pairs_counts_as_the_neighbor_list(device):
    dtype = torch.float32 if device == "cuda" else torch.float64
    torch.manual_seed(2)
    args = make_all_pairs_inputs("many_atoms", device, dtype, spread=3.0)
    num_pairs = torch.zeros((), dtype=torch.int64, device=device)  # a 0-dim count works too
    mirage.ops.schnet_energy_all_pairs(*args, num_pairs=num_pairs)
    atoms = args[0].shape[0]
    listed = mirage.ops.neighbor_list(args[2], args[3], max_pairs=atoms * (atoms - 1))
    assert int(num_pairs) == int(listed.num_pairs) == within_cutoff(args[2], args[3])
    assert 0 < int(num_pairs) < atoms * (atoms - 1) // 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("prepared", [False, True], ids=["weights", "prepared"])
def test_all_pairs_non_finite_positions(device, value, prepared):
    """NaN or Inf in a position: a count of -1 (what the neighbor list reports, and mirage.ff.md
    turns into an error) and NaN in the gradient; with NaN, a NaN energy; with Inf, the energy of
    the atom far away (an infinite vector lies beyond the cutoff, as in schnet_energy), from
    prepared tables too but on CUDA, where the energy is not finite (docs/ops.md; held here, so
    that the page changes with it)."""
    name = "padded" if prepared else "odd"
    if prepared and not _preparable_on(device, name):
        pytest.skip("no tables for this filter network")
    dtype = torch.float32 if device == "cuda" else torch.float64
    args = list(make_all_pairs_inputs(name, device, dtype, spread=0.5))  # every pair within the cutoff
    table = _prepare(as_pair_list(args)) if prepared else None
    args[2][4] = 1e6
    far = mirage.ops.schnet_energy_all_pairs(*args, prepared=table)[0]
    args[2][4, 1] = value
    num_pairs = torch.zeros(1, dtype=torch.int64, device=device)
    energy, grad = mirage.ops.schnet_energy_all_pairs(*args, prepared=table, num_pairs=num_pairs)
    assert int(num_pairs) == -1 and torch.isnan(grad).any()
    if value != value:
        assert torch.isnan(energy)
    elif prepared and device == "cuda":
        assert not torch.isfinite(energy)
    else:
        torch.testing.assert_close(energy, far, rtol=1e-6 if device == "cuda" else 1e-12, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("atoms", [0, 1])
def test_all_pairs_of_no_pairs(device, atoms):
    dtype = torch.float32 if device == "cuda" else torch.float64
    atomic_numbers, embedding, positions, *rest = make_all_pairs_inputs("lonely", device, dtype)
    num_pairs = torch.full((1,), 5, dtype=torch.int64, device=device)
    energy, grad = mirage.ops.schnet_energy_all_pairs(atomic_numbers[:atoms], embedding, positions[:atoms], *rest,
                                                      num_pairs=num_pairs)
    listed = mirage.ops.schnet_energy(*as_pair_list((atomic_numbers[:atoms], embedding, positions[:atoms], *rest)))
    assert int(num_pairs) == 0 and grad.shape == (atoms, 3) and (grad == 0).all()
    torch.testing.assert_close(energy, listed[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_all_pairs_strided_positions(device):
    dtype = torch.float32 if device == "cuda" else torch.float64
    torch.manual_seed(3)
    args = list(make_all_pairs_inputs("odd", device, dtype))
    contiguous = mirage.ops.schnet_energy_all_pairs(*args)
    wide = torch.zeros(args[2].shape[0], 7, dtype=dtype, device=device)
    wide[:, 1:7:2] = args[2]
    args[2] = wide[:, 1:7:2]
    assert not args[2].is_contiguous()
    for got, want in zip(mirage.ops.schnet_energy_all_pairs(*args), contiguous):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * max(want.abs().max().item(), 1.0))


def test_all_pairs_gradcheck():
    torch.manual_seed(4)
    atomic_numbers, embedding, positions, *rest = make_all_pairs_inputs("odd")
    positions.requires_grad_(True)
    torch.autograd.gradcheck(
        lambda r: mirage.ops.schnet_energy_all_pairs(atomic_numbers, embedding, r, *rest)[0], (positions,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count", [False, True], ids=["no_count", "count"])
def test_all_pairs_opcheck(device, count):
    dtype = torch.float32 if device == "cuda" else torch.float64
    args = list(make_all_pairs_inputs("odd", device, dtype))
    args[2].requires_grad_(True)
    args[6] = ",".join(args[6])
    num_pairs = torch.zeros(1, dtype=torch.int64, device=device) if count else None
    torch.library.opcheck(torch.ops.mirage.schnet_energy_all_pairs.default, (*args, None, num_pairs))
    if count:  # written in place, as an in-place op's output: its version moves
        version = num_pairs._version
        torch.ops.mirage.schnet_energy_all_pairs.default(*args, None, num_pairs)
        assert num_pairs._version > version


@pytest.mark.parametrize("device", DEVICES)
def test_all_pairs_refuses_parameter_gradients(device):
    dtype = torch.float32 if device == "cuda" else torch.float64
    atomic_numbers, embedding, positions, cutoff, num_rbf, weights, activations = \
        make_all_pairs_inputs("odd", device, dtype, spread=0.8)
    weights[4].requires_grad_(True)
    positions.requires_grad_(True)
    energy, _ = mirage.ops.schnet_energy_all_pairs(atomic_numbers, embedding, positions, cutoff, num_rbf, weights,
                                                   activations)
    assert_first_order_only(energy, positions, "no gradient in the model's parameters")


@pytest.mark.cuda
@pytest.mark.parametrize("prepared", [False, True], ids=["weights", "prepared"])
def test_all_pairs_cuda_graph_replays_new_positions(prepared):
    """Captured with its count, replayed on new positions: the energy, gradient and count of eager
    calls (float atomics: not bitwise). Without prepared tables: the filters kernel, which reads
    the positions too, and the cluster kernel launched beside it."""
    torch.manual_seed(5)
    args = list(make_all_pairs_inputs("benzene", "cuda", torch.float32))
    table = _prepare(as_pair_list(args)) if prepared else None
    static = args[2].clone()
    count = torch.zeros(1, dtype=torch.int64, device="cuda")
    graph, (energy, grad) = capture_graph(
        lambda: mirage.ops.schnet_energy_all_pairs(*args[:2], static, *args[3:], prepared=table, num_pairs=count))
    for spread in (0.9, 1.3, 2.5):
        positions = torch.rand_like(static) * (spread * args[3])
        static.copy_(positions)
        graph.replay()
        eager_count = torch.zeros(1, dtype=torch.int64, device="cuda")
        want_energy, want_grad = mirage.ops.schnet_energy_all_pairs(*args[:2], positions, *args[3:], prepared=table,
                                                                    num_pairs=eager_count)
        assert int(count) == int(eager_count) == within_cutoff(positions, args[3])
        torch.testing.assert_close(energy, want_energy, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-5 * max(want_grad.abs().max().item(), 1.0))


def _call(device, **changes):
    dtype = torch.float32 if device == "cuda" else torch.float64
    names = ["atomic_numbers", "embedding", "positions", "cutoff", "num_rbf", "weights", "activations", "num_pairs"]
    values = list(make_all_pairs_inputs("odd", device, dtype)) + [torch.zeros(1, dtype=torch.int64, device=device)]
    args = dict(zip(names, values))
    for key, change in changes.items():
        args[key] = change(args[key])
    return mirage.ops.schnet_energy_all_pairs(**args)


BAD = [
    (dict(positions=lambda r: r[:, :2]), "positions must have shape [N, 3] = [7, 3]"),
    (dict(positions=lambda r: r[:-1]), "positions must have shape [N, 3] = [7, 3]"),
    (dict(positions=lambda r: r.to(torch.float16)), "positions must have embedding's dtype"),
    (dict(num_pairs=lambda n: n.int()), "num_pairs must be a one-element int64 tensor"),
    (dict(num_pairs=lambda n: n.new_zeros(2)), "num_pairs must be a one-element int64 tensor"),
    (dict(atomic_numbers=lambda z: z.float()), "atomic_numbers must be a 1-D int64 tensor"),
    (dict(cutoff=lambda c: 0.0), "cutoff must be finite and > 0"),
    (dict(weights=replace_item(4, lambda w: w[:-1])), "weights[4] (interactions.0.in2f.weight) must have shape"),
    (dict(activations=lambda a: a[:-1]), "activations must name 4 activations"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("changes, message", BAD)
def test_all_pairs_bad_input(device, changes, message):
    assert_error(lambda d: _call(d, **changes), device, "mirage::schnet_energy_all_pairs: " + message)


def test_all_pairs_refuses_more_pairs_than_its_kernels_index():
    # "odd": message width 6, 2 interactions: 13,377 atoms make 178,930,752 pairs, 12 x that < 2^31;
    # 13,378 make 178,957,506, past it.
    # On the Meta device: the checks alone, no memory.
    def call(atoms):
        return _call("meta", atomic_numbers=lambda z: z.new_zeros(atoms), positions=lambda r: r.new_zeros(atoms, 3))

    assert call(13377)[1].shape == (13377, 3)
    assert_error(lambda d: call(13378), "meta", "pairs x message width x interactions must stay below 2^31")


def test_all_pairs_refuses_atom_counts_whose_pair_count_would_wrap():
    # N (N - 1) x width x interactions was once computed in int64 and wrapped past the bound.
    def call(atoms):
        return _call("meta", atomic_numbers=lambda z: z.new_zeros(atoms), positions=lambda r: r.new_zeros(atoms, 3))

    assert_error(lambda d: call(2**30 + 1), "meta", "atomic_numbers must have at most 46,341 atoms")


@pytest.mark.parametrize("alias", ["atomic_numbers", "positions"])
def test_all_pairs_refuses_a_count_that_shares_memory_with_an_input(alias):
    args = dict(zip(["atomic_numbers", "embedding", "positions", "cutoff", "num_rbf", "weights", "activations"],
                    make_all_pairs_inputs("odd", "cpu", torch.float64)))
    original = args[alias].clone()
    count = args[alias].view(-1)[:1] if alias == "atomic_numbers" else args[alias].view(torch.int64).view(-1)[:1]
    with pytest.raises(RuntimeError, match=f"mirage::schnet_energy_all_pairs: num_pairs \\(updated in place\\) "
                                           f"must not share memory with {alias}"):
        mirage.ops.schnet_energy_all_pairs(**args, num_pairs=count)
    assert torch.equal(args[alias], original)


def test_all_pairs_cpu_checks_atomic_numbers():
    assert_error(lambda d: _call(d, atomic_numbers=lambda z: z.clone().fill_(99)), "cpu",
                 "mirage::schnet_energy_all_pairs: atomic_numbers[0] = 99 is out of range")


@pytest.mark.cuda
def test_all_pairs_cuda_bad_atomic_numbers_give_nan_and_no_count():
    num_pairs = torch.zeros(1, dtype=torch.int64, device="cuda")
    energy, grad = _call("cuda", atomic_numbers=lambda z: z.clone().fill_(99), num_pairs=lambda n: num_pairs)
    assert torch.isnan(energy) and torch.isnan(grad).all() and int(num_pairs) == -1


@pytest.mark.cuda
def test_all_pairs_cuda_device_mismatch():
    assert_error(lambda d: _call(d, positions=lambda r: r.cpu()), "cuda", "positions must be on embedding's device")
    assert_error(lambda d: _call(d, num_pairs=lambda n: n.cpu()), "cuda", "num_pairs must be a one-element int64 "
                 "tensor on cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_all_pairs_compiles(device):
    """Under torch.compile(fullgraph=True) with its count, and through autograd: the energy, the
    op's gradient output and autograd's gradient in the positions of eager calls."""
    dtype = torch.float32 if device == "cuda" else torch.float64
    atomic_numbers, embedding, positions, *rest = make_all_pairs_inputs("odd", device, dtype)
    count = torch.zeros(1, dtype=torch.int64, device=device)

    def energy_and_gradients(r):
        leaf = r.detach().requires_grad_(True)
        energy, grad = mirage.ops.schnet_energy_all_pairs(atomic_numbers, embedding, leaf, *rest, num_pairs=count)
        (autograd,) = torch.autograd.grad(2.0 * energy, leaf)
        return energy.detach(), grad, autograd

    got = torch.compile(energy_and_gradients, fullgraph=False)(positions)
    compiled_count = int(count)
    count.zero_()
    want = energy_and_gradients(positions)
    assert compiled_count == int(count) == within_cutoff(positions, rest[0])
    torch.testing.assert_close(want[2], 2.0 * want[1])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * max(b.abs().max().item(), 1.0))
    forward = torch.compile(lambda r: mirage.ops.schnet_energy_all_pairs(atomic_numbers, embedding, r, *rest,
                                                                         num_pairs=count), fullgraph=True)
    count.zero_()
    torch.testing.assert_close(forward(positions)[1], want[1], rtol=1e-6, atol=1e-6 * max(want[1].abs().max().item(), 1.0))
    assert int(count) == compiled_count
