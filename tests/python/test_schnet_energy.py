import copy
import math
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mirage
import mirage.ff
from common import (DEVICES, FF_ACTIVATIONS, OpCounter, ZERO_FILLS, assert_energy_op_cpu_index_errors,
                    assert_energy_op_cuda_index_nans, assert_energy_op_matches_composite,
                    assert_energy_op_pairs_beyond_the_cutoff_add_nothing, assert_energy_op_replays_new_vectors,
                    assert_energy_op_takes_unaligned_weights, assert_error, assert_first_order_only, capture_graph,
                    energy_forces_and_ops, energy_op_opcheck, onto_atoms, replace_item,
                    skip_unless_whole_model_clusters)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

# name: (N, P, F, R, H, M, K, Kr, activations (filter, per interaction, readout), biases).
# benzene: the benchmark's sizes, every pair. odd: widths that are no multiple of 4 (the kernel's
# scalar paths), mixed activations, absent biases. many_atoms: more atoms than a cluster has
# blocks. lonely: one atom, no pairs.
CONFIGS = {
    "benzene": (12, 132, 128, 20, 128, 128, 128, 64, ["shifted_softplus"] * 5, True),
    "odd": (7, 41, 7, 3, 5, 6, 9, 3, ["silu", "tanh", "gelu", "softplus"], False),
    "many_atoms": (40, 600, 32, 8, 32, 32, 32, 16, ["relu", "silu", "shifted_softplus"], True),
    "lonely": (1, 0, 16, 4, 8, 8, 8, 4, ["shifted_softplus"] * 3, True),
    # Widths past 128 (a second pass over inputs and outputs in the CUDA products) and a few rows
    # a block (the row tiles' remainders).
    "wide": (30, 300, 133, 5, 260, 131, 129, 130, ["shifted_softplus", "silu", "tanh"], True),
    # Two atoms receiving ~165 pairs within the cutoff each: a block's products run through many
    # row tiles (the filters' 330 rows).
    "crowded": (2, 480, 16, 6, 128, 16, 16, 8, ["shifted_softplus", "silu", "shifted_softplus"], True),
    # A wide basis and ~2 pairs an atom: the filters' first product splits its sums over k (R >= 64
    # and few rows); 300 features: the backward's products run 96 threads along the outputs, which
    # do not divide the block (idle threads).
    "split_sums": (20, 60, 300, 64, 16, 16, 16, 8, ["shifted_softplus", "silu", "shifted_softplus"], True),
    # A filter network 1,030 wide: the filters kernel's rows need more shared memory than the
    # default 48 KB (its opt-in), and the padded widths are not multiples of 4.
    "wide_filter": (6, 30, 16, 20, 1030, 16, 16, 8, ["shifted_softplus", "silu", "shifted_softplus"], True),
    # A filter width of 8 (tables can take it) and atom-wise matrices whose sizes are no multiple
    # of 4 (the prepared layout's padding between them).
    "padded": (9, 60, 7, 5, 12, 8, 9, 3, ["silu", "tanh", "gelu", "softplus"], False),
}
CUTOFF = 4.0


def make_inputs(name, device="cpu", dtype=torch.float64):
    """(atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights, activations)."""
    n, p, f, r, h, m, k, kr, activations, biases = CONFIGS[name]
    interactions = len(activations) - 2

    def linear(out_features, in_features, bias=True):
        weight = torch.randn(out_features, in_features, dtype=torch.float64) / math.sqrt(in_features)
        b = torch.randn(out_features, dtype=torch.float64) * 0.3 if bias else torch.empty(0, dtype=torch.float64)
        return [weight, b]

    weights = []
    for _ in range(interactions):
        weights += linear(h, r) + linear(m, h) + linear(m, f, biases) + linear(k, m) + linear(f, k, biases)
    weights += linear(kr, f) + linear(1, kr)
    embedding = torch.randn(10, f, dtype=torch.float64)
    atomic_numbers = torch.randint(0, 10, (n,))
    pairs = torch.randint(0, n, (2, p))
    # Lengths from 0.4 to 1.1 cutoff (some pairs outside it); the last fifth is the neighbor list's
    # padding: pair (0, 0), vector (cutoff, 0, 0).
    directions = F.normalize(torch.randn(p, 3, dtype=torch.float64), dim=1)
    vectors = directions * (0.4 * CUTOFF + 0.7 * CUTOFF * torch.rand(p, 1, dtype=torch.float64))
    pairs[:, p - p // 5:] = 0
    vectors[p - p // 5:] = torch.tensor([CUTOFF, 0.0, 0.0], dtype=torch.float64)

    def to(t):
        return t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
    return (to(atomic_numbers), to(embedding), to(pairs), to(vectors), CUTOFF, r, [to(w) for w in weights],
            activations)


def schnet_composite(atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights, activations):
    """docs/ops.md's definition in plain torch; the energy and autograd's d energy / d vectors."""
    vectors = vectors.detach().requires_grad_(True)
    act = [FF_ACTIVATIONS[name] for name in activations]

    def linear(x, index):
        bias = weights[index + 1]
        return F.linear(x, weights[index], bias if bias.numel() else None)

    d = vectors.norm(dim=1)
    spacing = cutoff / (num_rbf - 1) if num_rbf > 1 else cutoff
    basis = torch.exp(-0.5 * ((d[:, None] - torch.arange(num_rbf, dtype=d.dtype, device=d.device) * spacing)
                              / spacing) ** 2)
    fcut = torch.where(d < cutoff, torch.cos(d * math.pi / (2 * cutoff)) ** 2, 0.0)
    x = embedding[atomic_numbers]
    for t in range(len(activations) - 2):
        b = 10 * t
        w = linear(act[0](linear(basis, b)), b + 2) * fcut[:, None]
        messages = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device).index_add_(
            0, pairs[0], linear(x, b + 4)[pairs[1]] * w)
        x = x + linear(act[t + 1](linear(messages, b + 6)), b + 8)
    r0 = len(weights) - 4
    energy = linear(act[-1](linear(x, r0)), r0 + 2).sum()
    grad, = torch.autograd.grad(energy, vectors, allow_unused=True)
    return energy.detach(), torch.zeros_like(vectors) if grad is None else grad


# ---- equivalence ------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_schnet_energy_matches_composite(device, name):
    args = make_inputs(name, device, torch.float32 if device == "cuda" else torch.float64)
    assert_energy_op_matches_composite(mirage.ops.schnet_energy, schnet_composite, args, name)
    if device == "cpu":  # CUDA's float atomics add in any order: runs need not agree to the bit
        torch.library.opcheck(torch.ops.mirage.schnet_energy.default, (*args[:7], ",".join(args[7])))


def test_schnet_energy_takes_activations_as_names_or_one_string():
    args = make_inputs("benzene")
    as_names = mirage.ops.schnet_energy(*args)
    as_string = mirage.ops.schnet_energy(*args[:-1], ",".join(args[-1]))
    for a, b in zip(as_names, as_string):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_schnet_energy_gradcheck():
    atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights, activations = make_inputs("odd")
    vectors.requires_grad_(True)
    torch.autograd.gradcheck(
        lambda v: mirage.ops.schnet_energy(atomic_numbers, embedding, pairs, v, cutoff, num_rbf, weights,
                                           activations)[0], (vectors,))


@pytest.mark.parametrize("device", DEVICES)
def test_schnet_energy_backward_fills_no_zeros(device):
    # grad_vectors (the second output) has no gradient: no [P, 3] of zeros is written for it,
    # one kernel less in every MD step.
    dtype = torch.float32 if device == "cuda" else torch.float64
    args = list(make_inputs("odd", device, dtype))
    vectors = args[3].requires_grad_(True)
    energy = mirage.ops.schnet_energy(*args[:3], vectors, *args[4:])[0]
    with OpCounter() as ops:
        torch.autograd.grad(energy, vectors)
    assert not ZERO_FILLS & set(ops.calls), ops.calls


@pytest.mark.parametrize("device", DEVICES)
def test_schnet_energy_opcheck(device):
    energy_op_opcheck(torch.ops.mirage.schnet_energy.default,
                      make_inputs("odd", device, torch.float32 if device == "cuda" else torch.float64))


@pytest.mark.cuda
def test_schnet_energy_cuda_graph_replays_new_vectors():
    assert_energy_op_replays_new_vectors(mirage.ops.schnet_energy, make_inputs("benzene", "cuda", torch.float32),
                                         lambda want_grad: 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_schnet_energy_pairs_beyond_the_cutoff_add_nothing(device):
    assert_energy_op_pairs_beyond_the_cutoff_add_nothing(
        mirage.ops.schnet_energy, make_inputs("benzene", device, torch.float32 if device == "cuda" else torch.float64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prepared", [False, True], ids=["weights", "prepared"])
def test_schnet_energy_non_finite_vectors(device, prepared):
    """An Inf vector is outside the cutoff (the energy as with the pair just past it) but gives a
    NaN gradient (its Gaussians' slope is inf * 0), a NaN vector makes everything NaN: on CUDA as
    in the float64 reference, and from prepared tables on the CPU (their filters are 0 past the
    cutoff, at an infinite distance as well). CUDA's kernels read prepared tables there: a
    non-finite energy, as docs/ops.md says (held here, so that the page changes with it)."""
    name = "padded" if prepared else "odd"
    if prepared and not _preparable_on(device, name):
        pytest.skip("no tables for this filter network")
    dtype = torch.float32 if device == "cuda" else torch.float64
    args = list(make_inputs(name, device, dtype))
    table = _prepare(args) if prepared else None
    vectors = args[3].clone()
    vectors[2] = torch.tensor([0.0, 2.0 * args[4], 0.0], dtype=dtype)
    past = mirage.ops.schnet_energy(*args[:3], vectors, *args[4:], prepared=table)[0]
    vectors[2, 1] = float("inf")
    energy, grad, _ = mirage.ops.schnet_energy(*args[:3], vectors, *args[4:], prepared=table)
    if prepared and device == "cuda":
        assert not torch.isfinite(energy)
    else:
        assert torch.isfinite(energy) and torch.isnan(grad[2]).all() and torch.isfinite(grad[:2]).all()
        # (on CUDA the sums over a receiver's pairs run in the order the block lists them: not bitwise)
        torch.testing.assert_close(energy, past, rtol=1e-6 if device == "cuda" else 1e-12, atol=1e-6)
    vectors[5, 0] = float("nan")
    energy = mirage.ops.schnet_energy(*args[:3], vectors, *args[4:], prepared=table)[0]
    assert torch.isnan(energy)


@pytest.mark.cuda
def test_schnet_energy_cuda_unaligned_weights():
    """In the filters kernel and in the cluster's forward and backward products: the first
    interaction's filter weights, in2f.weight, f2out.2.weight."""
    assert_energy_op_takes_unaligned_weights(mirage.ops.schnet_energy, make_inputs("benzene", "cuda", torch.float32),
                                             (0, 2, 4, 8), lambda want_grad: 1e-6)


# ---- gradients it does not give ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_schnet_energy_refuses_parameter_gradients(device):
    dtype = torch.float32 if device == "cuda" else torch.float64
    atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights, activations = make_inputs("odd", device, dtype)
    weights[2].requires_grad_(True)
    vectors.requires_grad_(True)
    energy, _, _ = mirage.ops.schnet_energy(atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights,
                                         activations)
    # Forces alone are fine although a weight requires grad; its gradient, or a second order, is an error.
    assert_first_order_only(energy, vectors, "no gradient in the model's parameters")


# ---- bad input --------------------------------------------------------------------------------

def _call(device, **changes):
    dtype = torch.float32 if device == "cuda" else torch.float64
    names = ["atomic_numbers", "embedding", "pairs", "vectors", "cutoff", "num_rbf", "weights", "activations"]
    args = dict(zip(names, make_inputs("odd", device, dtype)))
    for key, change in changes.items():
        args[key] = change(args[key])
    return mirage.ops.schnet_energy(**args)


BAD = [
    (dict(weights=lambda w: w[:-1]), "weights must hold 10 tensors per interaction"),
    (dict(activations=lambda a: a[:-1]), "activations must name 4 activations"),
    (dict(activations=lambda a: ["swish"] + a[1:]), "activation \"swish\" in activations is not one of"),
    (dict(weights=replace_item(2, lambda w: w[:, :-1])), "weights[2] (interactions.0.filter.2.weight) must have shape"),
    # A width-giving weight of another rank: its own message, not "[0, H]" worked out from it.
    (dict(weights=replace_item(2, lambda w: w[:, 0])), "weights[2] (interactions.0.filter.2.weight) must be 2-D, got "
                                                       "shape ["),
    (dict(weights=replace_item(13, lambda w: w[:-1])), "weights[13] (interactions.1.filter.2.bias) must have shape"),
    (dict(weights=replace_item(20, lambda w: w.t())), "weights[20] (readout.0.weight) must have shape"),
    (dict(weights=replace_item(3, lambda w: w.to(torch.float16))),
     "weights[3] (interactions.0.filter.2.bias) must have embedding's dtype"),
    (dict(num_rbf=lambda r: r + 1), "num_rbf (4) must be in [1, 1024] (the prepared tables grow with it) and equal "
                                   "the filters' input width (3)"),
    (dict(cutoff=lambda c: -1.0), "cutoff must be finite and > 0"),
    (dict(cutoff=lambda c: float("nan")), "cutoff must be finite and > 0"),
    (dict(vectors=lambda v: v[:, :2]), "vectors must have shape [P, 3] = [41, 3]"),
    (dict(vectors=lambda v: v.to(torch.float16)), "vectors must have embedding's dtype"),
    (dict(pairs=lambda p: p.int()), "pairs must be an int64 tensor of shape [2, P]"),
    (dict(atomic_numbers=lambda z: z.float()), "atomic_numbers must be a 1-D int64 tensor"),
    (dict(atomic_numbers=lambda z: z[:0]), "atomic_numbers is empty (N=0) but pairs has 41 pairs"),
    (dict(embedding=lambda e: e.to(torch.int32)), "embedding must be float32"),
    (dict(embedding=lambda e: e[:, :0]), "embedding must have shape [Z, F] with Z, F >= 1, got [10, 0]"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("changes, message", BAD)
def test_schnet_energy_bad_input(device, changes, message):
    assert_error(lambda d: _call(d, **changes), device, "mirage::schnet_energy: " + message)


def test_schnet_energy_refuses_more_pairs_than_its_kernels_index():
    # "odd": message width 6, 2 interactions: 178,956,970 pairs x 12 < 2^31. On the Meta device:
    # the checks alone, no memory.
    def call(pairs):
        return _call("meta", pairs=lambda p: p.new_zeros(2, pairs), vectors=lambda v: v.new_zeros(pairs, 3))

    assert call(178956970)[1].shape == (178956970, 3)
    assert_error(lambda d: call(178956971), "meta", "pairs x message width x interactions must stay below 2^31")


def test_schnet_energy_cpu_checks_indices():
    assert_energy_op_cpu_index_errors(_call)


@pytest.mark.cuda
def test_schnet_energy_cuda_bad_indices_give_nan():
    assert_energy_op_cuda_index_nans(_call)


@pytest.mark.cuda
def test_schnet_energy_cuda_device_mismatch():
    assert_error(lambda d: _call(d, vectors=lambda v: v.cpu()), "cuda", "vectors must be on embedding's device")
    assert_error(lambda d: _call(d, weights=replace_item(4, lambda w: w.cpu())), "cuda",
                 "weights[4] (interactions.0.in2f.weight) must be on embedding's device")


# ---- the fused SchNet takes it in eval mode ---------------------------------------------------

@pytest.mark.cuda
def test_fused_schnet_eval_mode_runs_one_kernel_with_the_same_forces():
    skip_unless_whole_model_clusters()
    from forcefield.benzene import benzene
    from forcefield.models import SchNet

    torch.manual_seed(0)
    model = mirage.ff.optimize(SchNet().cuda())
    numbers, positions = benzene(torch.float32, "cuda")
    positions = positions.requires_grad_(True)

    layered_energy, layered_forces, layered_ops = energy_forces_and_ops(model, numbers, positions, True)
    # A molecule whose capacity holds every pair: the op that searches them itself.
    energy, forces, calls = energy_forces_and_ops(model, numbers, positions, False)
    assert "mirage.schnet_energy_all_pairs" in calls and "mirage.neighbor_list" not in calls
    assert "mirage.schnet_energy_all_pairs" not in layered_ops
    torch.testing.assert_close(energy, layered_energy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(forces, layered_forces, rtol=1e-4, atol=1e-5 * layered_forces.abs().max().item())
    assert int(model.num_pairs) == 132  # benzene's pairs within 5 A: all of them

    # The limit is on the capacity: at it the kernel runs, one pair above it the layers do.
    for capacity, one_kernel in ((model.whole_model_max_pairs, True), (model.whole_model_max_pairs + 1, False)):
        model.max_pairs = capacity
        _, _, calls = energy_forces_and_ops(model, numbers, positions, False)
        assert ("mirage.schnet_energy_all_pairs" in calls) == one_kernel, capacity


@pytest.mark.cuda
def test_fused_schnet_on_a_molecule_below_every_pair_takes_the_neighbor_list():
    """A molecule whose capacity is below its N (N - 1) pairs (yet holds those within the cutoff:
    114 of benzene's 132 within 4 A): the neighbor list and schnet_energy on its pairs, with the
    energy, forces and count of the all-pairs op."""
    skip_unless_whole_model_clusters()
    from forcefield.benzene import benzene
    from forcefield.models import SchNet

    torch.manual_seed(0)
    model = mirage.ff.optimize(SchNet(cutoff=4.0).cuda()).eval()
    numbers, positions = benzene(torch.float32, "cuda")
    results = {}
    for capacity in (None, 131):  # None: the first call sizes it, every pair
        model.max_pairs = capacity
        leaf = positions.clone().requires_grad_(True)
        energy, forces, calls = energy_forces_and_ops(model, numbers, leaf, False)
        ops = [name for name in calls if name.startswith(("mirage.schnet_energy", "mirage.neighbor_list"))]
        results[capacity] = energy, forces, int(model.num_pairs), ops
    assert results[None][3] == ["mirage.schnet_energy_all_pairs"] and model.max_pairs == 131
    assert results[131][3] == ["mirage.neighbor_list", "mirage.schnet_energy"]
    assert results[None][2] == results[131][2] == 114
    torch.testing.assert_close(results[131][0], results[None][0], rtol=1e-6, atol=1e-6)
    scale = results[None][1].abs().max().item()
    torch.testing.assert_close(results[131][1], results[None][1], rtol=0, atol=1e-5 * scale)


# ---- prepared weights (schnet_energy_prepare) ---------------------------------------------------

# The configs whose filter networks a table takes: a smooth filter activation, M a multiple of 4.
PREPARABLE = sorted(name for name, config in CONFIGS.items() if config[8][0] != "relu" and config[5] % 4 == 0)


def _prepare(args):
    atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights, activations = args
    return mirage.ops.schnet_energy_prepare(embedding, cutoff, num_rbf, weights, activations)


def _preparable_on(device, name):
    _, _, _, r, h, m, *_ = CONFIGS[name]
    return mirage.ops.radial_cfconv_supported(r, h, m, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", PREPARABLE)
def test_schnet_energy_prepared_matches_composite(device, name):
    if not _preparable_on(device, name):
        pytest.skip("the table kernel does not take these sizes on this GPU")
    args = make_inputs(name, device, torch.float32 if device == "cuda" else torch.float64)
    prepared = _prepare(args)
    assert prepared.dim() == 1 and prepared.dtype == args[1].dtype and prepared.device == args[1].device

    def op(*a):
        return mirage.ops.schnet_energy(*a, prepared=prepared)

    if device == "cuda":
        assert_energy_op_matches_composite(op, schnet_composite, args, name)
        return
    # float64: the tables interpolate these filter networks to ~1e-11 of their largest values.
    energy, grad, grad_positions = op(*args)
    want_energy, want_grad = schnet_composite(*args)
    torch.testing.assert_close(energy, want_energy, rtol=1e-9, atol=1e-9)
    scale = want_grad.abs().max().item() if want_grad.numel() else 0.0
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-9 * max(scale, 1.0))
    torch.testing.assert_close(grad_positions, onto_atoms(want_grad, args[2], args[0].shape[0]), rtol=0,
                               atol=1e-8 * max(scale, 1.0))
    torch.library.opcheck(torch.ops.mirage.schnet_energy.default, (*args[:7], ",".join(args[7]), prepared))
    torch.library.opcheck(torch.ops.mirage.schnet_energy_prepare.default,
                          (args[1], args[4], args[5], args[6], ",".join(args[7])))


def test_schnet_energy_prepared_tables_are_radial_cfconvs():
    # The first part of the prepared tensor: each interaction's filter network as radial_cfconv
    # tabulates it (another op's reference, built from the same network definition).
    atomic_numbers, embedding, pairs, vectors, cutoff, num_rbf, weights, activations = args = make_inputs("benzene")
    prepared = _prepare(args)
    distances = vectors.norm(dim=1)
    x = torch.randn(12, 128, dtype=torch.float64)
    size = None
    for t in range(3):
        w = weights[10 * t:10 * t + 4]
        _, table = torch.ops.mirage.radial_cfconv(x, distances, pairs, w[0], w[1], w[2], w[3], activations[0],
                                                  "gaussian", cutoff, "cosine")
        size = table.numel()
        torch.testing.assert_close(prepared[t * size:(t + 1) * size], table.reshape(-1), rtol=0, atol=0)
    # Then the atom-wise weights transposed as cuda/float_arena.h lays them out (benzene's sizes
    # need no padding): readout.0, f2out.2 and f2out.0 of each interaction, in2f of each but the
    # first (the backward never reaches it); last the first in2f of every embedding row.
    first_h = F.linear(embedding, weights[4], weights[5])
    rest, last = prepared[3 * size:-first_h.numel()], prepared[-first_h.numel():]
    transposed = ([weights[30]] + [weights[10 * t + 8] for t in range(3)] + [weights[10 * t + 6] for t in range(3)]
                  + [weights[10 * t + 4] for t in (1, 2)])
    torch.testing.assert_close(rest, torch.cat([w.t().reshape(-1) for w in transposed]), rtol=0, atol=0)
    torch.testing.assert_close(last, first_h.reshape(-1), rtol=1e-14, atol=1e-14)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["benzene", "padded"])
def test_schnet_energy_prepared_on_the_cpu_runs_on_cuda(name):
    # The CPU builds the same layout as the CUDA kernels (their tables to float32 rounding, the
    # transposed weights and the zeros between them exactly), so a tensor prepared there runs on
    # CUDA with the same results.
    args = make_inputs(name, "cuda", torch.float32)
    on_cuda = _prepare(args)
    on_cpu = _prepare([a.cpu() if isinstance(a, torch.Tensor) else [w.cpu() for w in a] if isinstance(a, list)
                       and a and isinstance(a[0], torch.Tensor) else a for a in args]).cuda()
    torch.testing.assert_close(on_cpu, on_cuda, rtol=1e-6, atol=1e-6 * on_cuda.abs().max().item())
    for a, b in zip(mirage.ops.schnet_energy(*args, prepared=on_cpu), mirage.ops.schnet_energy(*args, prepared=on_cuda)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.mark.cuda
def test_schnet_energy_prepared_cuda_graph_replays_new_vectors():
    args = make_inputs("benzene", "cuda", torch.float32)
    prepared = _prepare(args)
    assert_energy_op_replays_new_vectors(lambda *a: mirage.ops.schnet_energy(*a, prepared=prepared), args,
                                         lambda want_grad: 1e-6)


PREPARED_BAD = [
    (lambda p: p[:-1], "prepared must be schnet_energy_prepare's output for this embedding and these weights, a 1-D"),
    (lambda p: p.reshape(2, -1), "prepared must be schnet_energy_prepare's output"),
    (lambda p: p.to(torch.float16), "prepared must be schnet_energy_prepare's output"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change, message", PREPARED_BAD)
def test_schnet_energy_bad_prepared(device, change, message):
    args = make_inputs("benzene", device, torch.float32 if device == "cuda" else torch.float64)
    prepared = change(_prepare(args))
    assert_error(lambda d: mirage.ops.schnet_energy(*args, prepared=prepared), device,
                 "mirage::schnet_energy: " + message)


@pytest.mark.parametrize("device", DEVICES)
def test_schnet_energy_refuses_what_another_embedding_prepared(device):
    # The prepared tensor holds a row per species: one made for an embedding of fewer rows is refused.
    args = list(make_inputs("benzene", device, torch.float32 if device == "cuda" else torch.float64))
    prepared = mirage.ops.schnet_energy_prepare(args[1][:-1], *args[4:])
    assert_error(lambda d: mirage.ops.schnet_energy(*args, prepared=prepared), device,
                 "mirage::schnet_energy: prepared must be schnet_energy_prepare's output for this embedding")


@pytest.mark.parametrize("device", DEVICES)
def test_schnet_energy_prepare_refuses_what_a_table_cannot_hold(device):
    dtype = torch.float32 if device == "cuda" else torch.float64
    relu = make_inputs("many_atoms", device, dtype)  # a relu filter activation
    assert_error(lambda d: _prepare(relu), device,
                 "mirage::schnet_energy_prepare: the filter activation \"relu\" is not smooth")
    odd = make_inputs("odd", device, dtype)  # a filter width of 6
    assert_error(lambda d: _prepare(odd), device, "mirage::schnet_energy_prepare: the prepared tables need a "
                 "message width (filter.2's outputs) that is a multiple of 4, got 6")
    # A prepared tensor of the right length with a relu filter activation: refused by the op too.
    args = list(make_inputs("benzene", device, dtype))
    prepared = _prepare(args)
    args[7] = ["relu"] + args[7][1:]
    assert_error(lambda d: mirage.ops.schnet_energy(*args, prepared=prepared), device,
                 "mirage::schnet_energy: the filter activation \"relu\" is not smooth")
    args = list(make_inputs("benzene", device, dtype))
    args[6] = args[6][:-1]
    assert_error(lambda d: _prepare(args), device,
                 "mirage::schnet_energy_prepare: weights must hold 10 tensors per interaction")
    # The tables' pieces grow with num_rbf: a count past 2^58 once made their doubling loop run for ever.
    args = list(make_inputs("benzene", device, dtype))
    args[5], args[6][0] = 2**50, args[6][0][:, :1].expand(-1, 2**50)
    assert_error(lambda d: _prepare(args), device,
                 "mirage::schnet_energy_prepare: num_rbf (1125899906842624) must be in [1, 1024]")


@pytest.mark.cuda
def test_schnet_energy_prepared_device_mismatch():
    args = make_inputs("benzene", "cuda", torch.float32)
    prepared = _prepare(args).cpu()
    assert_error(lambda d: mirage.ops.schnet_energy(*args, prepared=prepared), "cuda",
                 "mirage::schnet_energy: prepared must be schnet_energy_prepare's output")


def _benzene_schnet(device):
    from forcefield.benzene import benzene
    from forcefield.models import SchNet

    torch.manual_seed(0)
    model = mirage.ff.optimize(SchNet().to(device)).eval()
    numbers, positions = benzene(torch.float32, device)
    return model, numbers, positions


def test_fused_schnet_prepared_weights_off_cuda_prepare_nothing():
    model, numbers, positions = _benzene_schnet("cpu")
    want = model(numbers, positions)
    with OpCounter() as ops, model.prepared_weights():
        energy = model(numbers, positions)
    assert "mirage.schnet_energy_prepare" not in ops.calls
    torch.testing.assert_close(energy, want, rtol=0, atol=0)


@pytest.mark.cuda
def test_fused_schnet_prepared_weights():
    skip_unless_whole_model_clusters()
    model, numbers, positions = _benzene_schnet("cuda")
    plain = model.energy_and_gradient(numbers, positions)
    with OpCounter() as ops, model.prepared_weights():
        prepared = model.energy_and_gradient(numbers, positions)
    assert ops.calls.count("mirage.schnet_energy_prepare") == 1
    scale = plain[1].abs().max().item()
    torch.testing.assert_close(prepared[0], plain[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prepared[1], plain[1], rtol=1e-4, atol=1e-5 * scale)

    # Unchanged weights: nothing made again. A weight changed between entries, even through .data
    # (which keeps its version counter), is seen at the next entry, which makes the tensor again in
    # the same memory: a graph captured inside an earlier entry replays with the latest weights.
    with OpCounter() as ops, model.prepared_weights():
        graph, (energy, grad) = capture_graph(lambda: model.energy_and_gradient(numbers, positions))
        with pytest.raises(RuntimeError, match="entered during a CUDA-graph capture"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()), model.prepared_weights():
                pass
    assert "mirage.schnet_energy_prepare" not in ops.calls
    bias = model.interactions[0].filter[2].bias
    bias.data.add_(0.5)
    changed = model.energy_and_gradient(numbers, positions)
    assert abs(changed[0].item() - plain[0].item()) > 1e-3
    with OpCounter() as ops, model.prepared_weights():
        graph.replay()
    assert ops.calls.count("mirage.schnet_energy_prepare") == 1
    torch.testing.assert_close(energy, changed[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, changed[1], rtol=1e-4, atol=1e-5 * scale)

    # Made under inference mode, the tensor is still made again outside it; copies and pickles
    # do not carry it (10 MiB of derived state).
    with torch.inference_mode():
        bias.data.sub_(0.5)
        with model.prepared_weights():
            pass
    bias.data.add_(0.5)
    with model.prepared_weights():
        graph.replay()
    torch.testing.assert_close(energy, changed[0], rtol=1e-5, atol=1e-5)

    # The embedding is among what the tensor was made from (it holds the first in2f of its rows).
    model.embedding.weight.data[6].mul_(1.5)
    changed = model.energy_and_gradient(numbers, positions)
    with OpCounter() as ops, model.prepared_weights():
        graph.replay()
    assert ops.calls.count("mirage.schnet_energy_prepare") == 1
    torch.testing.assert_close(energy, changed[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, changed[1], rtol=1e-4, atol=1e-5 * scale)
    assert len(pickle.dumps(model)) < 4 * 2**20
    assert copy.deepcopy(model)._prepared_weights is None


@pytest.mark.cuda
def test_schnet_energy_prepared_unaligned_view():
    args = make_inputs("benzene", "cuda", torch.float32)
    prepared = _prepare(args)
    shifted = torch.empty(prepared.numel() + 1, device="cuda")[1:].copy_(prepared)
    assert shifted.data_ptr() % 16 != 0
    for a, b in zip(mirage.ops.schnet_energy(*args, prepared=shifted), mirage.ops.schnet_energy(*args, prepared=prepared)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_schnet_energy_prepare_is_not_differentiable():
    args = make_inputs("benzene")
    args[6][2].requires_grad_(True)
    with pytest.raises(RuntimeError, match="schnet_energy_prepare"):
        _prepare(args).sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_schnet_energy_reads_the_first_h_from_prepared(device):
    # prepared made from another first in2f: the op's first h is that one's, looked up by species
    # (as documented); the embedding itself still enters the residual from `embedding`.
    dtype = torch.float32 if device == "cuda" else torch.float64
    args = list(make_inputs("benzene", device, dtype))
    other = [w.clone() for w in args[6]]
    other[4], other[5] = other[4] * 1.3 + 0.05, other[5] - 0.2
    prepared = mirage.ops.schnet_energy_prepare(args[1], args[4], args[5], other, args[7])
    energy, grad, _ = mirage.ops.schnet_energy(*args, prepared=prepared)
    want_energy, want_grad = schnet_composite(*args[:6], other, args[7])
    # The other first in2f moves the gradient by at least 9.6% of its largest value over 300 seeds,
    # far past the bound below (the energy, for some inputs, by less than 1%).
    _, plain_grad = schnet_composite(*args)
    assert (want_grad - plain_grad).abs().max().item() > 0.02 * plain_grad.abs().max().item()
    rtol = 1e-9 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(energy.double(), want_energy.double(), rtol=rtol, atol=rtol)
    torch.testing.assert_close(grad.double(), want_grad.double(), rtol=0, atol=rtol * want_grad.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_schnet_energy_reads_the_filters_from_prepared(device):
    # prepared made from other filter networks: the op computes with those (as documented), the
    # rest of the model from `weights`.
    dtype = torch.float32 if device == "cuda" else torch.float64
    args = list(make_inputs("benzene", device, dtype))
    other = [w.clone() for w in args[6]]
    for t in range(3):
        for k in range(4):  # filter.0 and filter.2, weights and biases
            other[10 * t + k] = other[10 * t + k] * 1.3 + 0.05
    prepared = mirage.ops.schnet_energy_prepare(args[1], args[4], args[5], other, args[7])
    energy, grad, _ = mirage.ops.schnet_energy(*args, prepared=prepared)
    mixed = list(args)
    mixed[6] = [other[i] if i < 30 and i % 10 < 4 else w for i, w in enumerate(args[6])]
    want_energy, want_grad = schnet_composite(*mixed)
    plain_energy, _ = schnet_composite(*args)
    assert abs(want_energy.item() - plain_energy.item()) > 1e-2 * max(abs(plain_energy.item()), 1.0)
    rtol = 1e-9 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(energy.double(), want_energy.double(), rtol=rtol, atol=rtol)
    torch.testing.assert_close(grad.double(), want_grad.double(), rtol=0, atol=rtol * want_grad.abs().max().item())
