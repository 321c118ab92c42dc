"""mirage::pair_vectors (and its backward) against the pair geometry written in PyTorch."""

import pytest
import torch

import mirage
from common import (DEVICES, ZERO_FILLS, OpCounter, assert_close_to, assert_error, capture_graph, opcheck, randn,
                    strided)
from tolerances import tolerance

BACKWARD_OP = torch.ops.mirage.pair_vectors_backward


def composite(positions, pairs, shifts=None):
    """What mirage.ff's models did before: gather both ends, subtract, add the shift, norm."""
    vectors = positions[pairs[1]] - positions[pairs[0]]
    if shifts is not None:
        vectors = vectors + shifts
    return vectors, torch.linalg.vector_norm(vectors, dim=-1)


def make_inputs(atoms, count, dtype=torch.float32, device="cpu", with_shifts=True):
    positions = randn(atoms, 3, dtype=dtype, device=device, std=3.0)
    pairs = torch.randint(0, max(atoms, 1), (2, count), device=device)
    shifts = randn(count, 3, dtype=dtype, device=device) if with_shifts else None
    return positions, pairs, shifts


def as_double(t):
    return None if t is None else t.detach().double().cpu()


def gradients(fn, positions, pairs, shifts, grad_vectors, grad_distances):
    leaves = [positions.detach().requires_grad_()] + ([] if shifts is None else [shifts.detach().requires_grad_()])
    vectors, distances = fn(leaves[0], pairs, leaves[1] if shifts is not None else None)
    return torch.autograd.grad((vectors, distances), leaves, (grad_vectors, grad_distances))


def assert_matches(positions, pairs, shifts, dtype):
    vectors, distances = mirage.ops.pair_vectors(positions, pairs, shifts)
    want = composite(as_double(positions), pairs.cpu(), as_double(shifts))
    # Sums of coordinates: the sums of their magnitudes bound float32's rounding.
    ends = as_double(positions).abs()
    magnitude = ends[pairs[0].cpu()] + ends[pairs[1].cpu()] + (0 if shifts is None else as_double(shifts).abs())
    assert_close_to(vectors, want[0], dtype, magnitude)
    assert_close_to(distances, want[1], dtype, torch.linalg.vector_norm(magnitude, dim=-1))
    grad_vectors = randn(*vectors.shape, dtype=dtype, device=positions.device)
    grad_distances = randn(*distances.shape, dtype=dtype, device=positions.device)
    got = gradients(mirage.ops.pair_vectors, positions, pairs, shifts, grad_vectors, grad_distances)
    want = gradients(composite, as_double(positions), pairs.cpu(), as_double(shifts), as_double(grad_vectors),
                     as_double(grad_distances))
    # Each atom's gradient sums its pairs' terms, each bounded by |grad_vectors| + |grad_distances|.
    per_pair = grad_vectors.abs().double().cpu() + grad_distances.abs().double().cpu().unsqueeze(-1)
    magnitude = torch.zeros_like(want[0]).index_add(0, pairs[0].cpu(), per_pair).index_add(0, pairs[1].cpu(), per_pair)
    assert_close_to(got[0], want[0], dtype, magnitude)
    if shifts is not None:
        assert_close_to(got[1], want[1], dtype, per_pair)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("atoms,count", [(1, 1), (7, 40), (12, 132), (50, 0), (300, 5000)])
@pytest.mark.parametrize("with_shifts", [False, True])
def test_matches_composite(device, atoms, count, with_shifts):
    assert_matches(*make_inputs(atoms, count, torch.float32, device, with_shifts), torch.float32)


def test_float64_on_cpu():
    positions, pairs, shifts = make_inputs(9, 30, torch.float64)
    for got, want in zip(mirage.ops.pair_vectors(positions, pairs, shifts), composite(positions, pairs, shifts)):
        torch.testing.assert_close(got, want, **tolerance(torch.float64))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs(device):
    positions, pairs, shifts = make_inputs(8, 25, torch.float32, device)
    got = mirage.ops.pair_vectors(strided(positions), pairs.t().contiguous().t(), strided(shifts))
    for a, b in zip(got, mirage.ops.pair_vectors(positions, pairs, shifts)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_coincident_atoms_give_a_zero_distance_gradient(device):
    # Two atoms on one spot: distance 0, whose gradient PyTorch's norm takes as 0; the vector's own
    # gradient still flows.
    positions = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], device=device, requires_grad=True)
    pairs = torch.tensor([[0], [1]], device=device)
    vectors, distances = mirage.ops.pair_vectors(positions, pairs)
    assert distances.item() == 0
    (grad,) = torch.autograd.grad(distances.sum() + vectors.sum(), positions)
    torch.testing.assert_close(grad, torch.tensor([[-1.0] * 3, [1.0] * 3], device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_and_inf_positions_propagate_as_in_pytorch(device, bad):
    # Only an exact zero distance has its gradient taken as 0; NaN and Inf pass on as in PyTorch.
    positions, pairs, shifts = make_inputs(6, 30, torch.float32, device)
    positions[2, 1] = bad
    pairs[0, :3] = 2  # atom 2 in some pairs for sure
    got = gradients(mirage.ops.pair_vectors, positions, pairs, shifts, torch.zeros(30, 3, device=device),
                    torch.ones(30, device=device))[0]
    want = gradients(composite, positions, pairs, shifts, torch.zeros(30, 3, device=device),
                     torch.ones(30, device=device))[0]
    assert torch.isnan(want).any()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("device", DEVICES)
def test_nan_positions_with_only_the_vectors_gradient_as_in_pytorch(device):
    # An energy of the vectors alone: PyTorch never differentiates the norm, so a NaN position
    # gives its pairs' gradients as they are (not NaN); the fused backward, handed no distances'
    # gradient, must too.
    positions, pairs, shifts = make_inputs(6, 30, torch.float32, device)
    positions[2, 1] = float("nan")
    pairs[0, :3] = 2
    weights = randn(30, 3, device=device)

    def gradient(fn, positions, pairs, shifts, weights):
        leaf = positions.detach().requires_grad_()
        vectors, _ = fn(leaf, pairs, shifts)
        return torch.autograd.grad((vectors * weights).sum(), leaf)[0]

    got = gradient(mirage.ops.pair_vectors, positions, pairs, shifts, weights)
    want = gradient(composite, as_double(positions), pairs.cpu(), as_double(shifts), as_double(weights))
    assert not want.isnan().any()
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


# ---- autograd, opcheck, compile, autocast -----------------------------------------------------

def test_gradcheck_and_gradgradcheck():
    positions, _, shifts = make_inputs(5, 7, torch.float64)
    pairs = torch.tensor([[1, 0, 3, 1, 1, 2, 0], [0, 3, 3, 2, 2, 1, 1]])  # repeats and a self pair
    leaves = [positions.requires_grad_(), shifts.requires_grad_()]

    def fn(positions, shifts):
        return mirage.ops.pair_vectors(positions, pairs, shifts)

    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradgradcheck(fn, leaves)


def test_backward_op_gradcheck():
    positions, pairs, shifts = make_inputs(4, 9, torch.float64)
    grad_vectors, grad_distances = randn(9, 3, dtype=torch.float64), randn(9, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (grad_vectors, grad_distances, positions, shifts)]
    assert torch.autograd.gradcheck(lambda g, h, p, s: BACKWARD_OP(g, h, p, pairs, s), leaves)
    # Either gradient missing (zero): the double backward's composite takes it so too.
    assert torch.autograd.gradcheck(lambda h, p, s: BACKWARD_OP(None, h, p, pairs, s), leaves[1:])
    assert torch.autograd.gradcheck(lambda g, p, s: BACKWARD_OP(g, None, p, pairs, s), [leaves[0], *leaves[2:]])


def test_backward_uses_the_fused_op_and_forms_no_shift_gradient():
    positions, pairs, shifts = make_inputs(6, 20)
    positions.requires_grad_()
    vectors, distances = mirage.ops.pair_vectors(positions, pairs, shifts)  # shifts need no gradient
    with OpCounter() as counter:
        torch.autograd.grad(vectors.sum() + distances.sum(), positions)
    assert counter.calls.count("mirage.pair_vectors_backward") == 1
    # No composite recompute, no shift gradient (aten.where would form it).
    assert not {"aten.index_add", "aten.index_select", "aten.linalg_vector_norm", "aten.where"} & set(counter.calls)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("atoms,count", [(5, 11), (3, 0), (1, 2)])
def test_opcheck(device, atoms, count):
    positions, pairs, shifts = make_inputs(atoms, count, torch.float32, device)
    opcheck(torch.ops.mirage.pair_vectors.default, (positions, pairs, shifts))
    opcheck(torch.ops.mirage.pair_vectors.default, (positions, pairs, None))
    grad_vectors, grad_distances = randn(count, 3, device=device), randn(count, device=device)
    for grads in [(grad_vectors, grad_distances), (None, grad_distances), (grad_vectors, None), (None, None)]:
        opcheck(BACKWARD_OP.default, (*grads, positions, pairs, shifts))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("atoms,count", [(12, 132), (300, 9000)])  # one block and a grid on CUDA
@pytest.mark.parametrize("given", ["vectors", "distances", "neither"])
def test_backward_op_takes_a_missing_gradient_as_zero(device, atoms, count, given):
    positions, pairs, shifts = make_inputs(atoms, count, torch.float32, device)
    grad_vectors, grad_distances = randn(count, 3, device=device), randn(count, device=device)
    zeros = torch.zeros_like(grad_vectors), torch.zeros_like(grad_distances)
    args = (grad_vectors if given == "vectors" else None, grad_distances if given == "distances" else None)
    dense = tuple(zero if g is None else g for g, zero in zip(args, zeros))
    got = BACKWARD_OP(*args, positions, pairs, shifts)
    want = gradients(composite, as_double(positions), pairs.cpu(), as_double(shifts), *map(as_double, dense))[0]
    per_pair = dense[0].abs().double().cpu() + dense[1].abs().double().cpu().unsqueeze(-1)
    magnitude = torch.zeros_like(want).index_add(0, pairs[0].cpu(), per_pair).index_add(0, pairs[1].cpu(), per_pair)
    assert_close_to(got, want, torch.float32, magnitude)
    if given == "neither":
        assert not got.any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("used", ["vectors", "distances"])
def test_an_unused_output_fills_no_zeros_in_the_backward(device, used):
    # A model that reads only the vectors (the whole-model ops) or only the distances leaves the
    # other output's gradient undefined; the fused backward takes it as zero instead of autograd
    # filling a tensor of zeros for it.
    positions, pairs, shifts = make_inputs(9, 40, torch.float32, device)

    def gradient(fn, positions, pairs, shifts):
        leaf = positions.detach().requires_grad_()
        vectors, distances = fn(leaf, pairs, shifts)
        energy = (vectors * vectors).sum() if used == "vectors" else torch.exp(-distances).sum()
        return torch.autograd.grad(energy, leaf)[0]

    with OpCounter() as counter:
        got = gradient(mirage.ops.pair_vectors, positions, pairs, shifts)
    assert counter.calls.count("mirage.pair_vectors_backward") == 1
    assert not ZERO_FILLS & set(counter.calls)
    want = gradient(composite, as_double(positions), pairs.cpu(), as_double(shifts))
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()

    def energy(positions, pairs, shifts):
        vectors, distances = mirage.ops.pair_vectors(positions, pairs, shifts)
        return (torch.exp(-distances) * vectors[:, 0]).sum()

    compiled = torch.compile(energy, fullgraph=True)
    for count in [30, 30, 47]:
        positions, pairs, shifts = make_inputs(9, count, torch.float32, device)
        positions.requires_grad_()
        got, want = compiled(positions, pairs, shifts), energy(positions, pairs, shifts)
        torch.testing.assert_close(got, want)
        # The compiled backward (AOTAutograd's) against eager: the forces.
        torch.testing.assert_close(torch.autograd.grad(got, positions)[0], torch.autograd.grad(want, positions)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_runs_in_float32(device):
    positions, pairs, shifts = make_inputs(6, 15, torch.float32, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        vectors, distances = mirage.ops.pair_vectors(positions.bfloat16(), pairs, shifts)
    assert vectors.dtype == distances.dtype == torch.float32
    want = composite(positions.bfloat16().float(), pairs, shifts)
    torch.testing.assert_close(vectors, want[0])
    torch.testing.assert_close(distances, want[1])


# ---- bad input --------------------------------------------------------------------------------

def _call(device, edit=None, backward=False):
    positions, pairs, shifts = make_inputs(4, 6, torch.float32, device)
    args = {"positions": positions, "pairs": pairs, "shifts": shifts}
    if backward:
        args = {"grad_vectors": randn(6, 3, device=device), "grad_distances": randn(6, device=device), **args}
    if edit is not None:
        name, fn = edit
        args[name] = fn(args[name])
    return (BACKWARD_OP if backward else torch.ops.mirage.pair_vectors)(*args.values())


BAD_INPUTS = [
    (("positions", lambda t: t.half()), "mirage::pair_vectors: positions must be float32 (float64 off the GPU), got Half"),
    (("positions", lambda t: t[:, :2]), "mirage::pair_vectors: positions must be [N, 3], got [4, 2]"),
    (("pairs", lambda t: t.int()), "mirage::pair_vectors: pairs must be int64, got Int"),
    (("pairs", lambda t: t[:1]), "mirage::pair_vectors: pairs must be [2, P], got [1, 6]"),
    (("shifts", lambda t: t[:5]), "mirage::pair_vectors: shifts must have shape [P, 3] = [6, 3], got [5, 3]"),
    (("shifts", lambda t: t.double()), "mirage::pair_vectors: shifts must have positions' dtype (Float), got Double"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("edit,message", BAD_INPUTS)
def test_bad_input(device, edit, message):
    assert_error(lambda d: _call(d, edit), device, message)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_backward(device):
    assert_error(lambda d: _call(d, ("grad_vectors", lambda t: t[:, :2]), backward=True), device,
                 "mirage::pair_vectors_backward: grad_vectors must have shape [P, 3] = [6, 3], got [6, 2]")
    assert_error(lambda d: _call(d, ("grad_distances", lambda t: t[:4]), backward=True), device,
                 "mirage::pair_vectors_backward: grad_distances must have shape [P] = [6], got [4]")
    assert_error(lambda d: _call(d, ("positions", lambda t: t[:, :1]), backward=True), device,
                 "mirage::pair_vectors_backward: positions must be [N, 3], got [4, 1]")
    assert_error(lambda d: _call(d, ("grad_vectors", lambda t: t.double()), backward=True), device,
                 "mirage::pair_vectors_backward: grad_vectors must have positions' dtype (Float), got Double")
    assert_error(lambda d: _call(d, ("grad_distances", lambda t: t.half()), backward=True), device,
                 "mirage::pair_vectors_backward: grad_distances must have positions' dtype (Float), got Half")


@pytest.mark.parametrize("bad", [-1, 4])
def test_out_of_range_pairs_raise_on_cpu(bad):
    positions, pairs, _ = make_inputs(4, 6)
    pairs[1, 2] = bad
    with pytest.raises(RuntimeError, match=rf"mirage::pair_vectors: pairs\[1, 2\] = {bad} is out of range for N=4"):
        mirage.ops.pair_vectors(positions, pairs)


@pytest.mark.cuda
def test_wrong_device_and_float64_on_cuda():
    assert_error(lambda d: _call(d, ("pairs", lambda t: t.cpu())), "cuda",
                 "mirage::pair_vectors: pairs must be on positions' device (cuda:0), got cpu")
    assert_error(lambda d: _call(d, ("positions", lambda t: t.double())), "cuda",
                 "mirage::pair_vectors: positions must be float32 (float64 off the GPU), got Double")
    assert_error(lambda d: _call(d, ("shifts", lambda t: t.cpu())), "cuda",
                 "mirage::pair_vectors: shifts must be on positions' device (cuda:0), got cpu")
    assert_error(lambda d: _call(d, ("grad_vectors", lambda t: t.cpu()), backward=True), "cuda",
                 "mirage::pair_vectors_backward: grad_vectors must be on positions' device (cuda:0), got cpu")


# ---- CUDA ----------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_cuda_large():
    # The 3,000-atom box's scale: 139k pairs.
    assert_matches(*make_inputs(3000, 139_000, torch.float32, "cuda"), torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("atoms,count", [(1024, 8192), (1025, 100), (100, 8193), (5, 0)])
def test_cuda_backward_in_one_block_and_in_a_grid(atoms, count):
    # Up to 1,024 atoms and 8,192 pairs the backward runs in one block, beyond either in a grid.
    assert_matches(*make_inputs(atoms, count, torch.float32, "cuda"), torch.float32)


@pytest.mark.cuda
def test_cuda_receiver_runs_within_and_across_warps():
    # The backward sums each run of equal receivers within a warp before its atomic: runs of 1,
    # 31, 32, 33 and 70 pairs (within a warp, a whole warp, across warps), in neighbor_list's
    # order (sorted by i), then the same pairs shuffled.
    runs = [1, 31, 32, 33, 70, 5, 1, 1, 64, 3]
    receivers = torch.cat([torch.full((n,), k, dtype=torch.int64) for k, n in enumerate(runs)])
    senders = torch.randint(0, len(runs), (len(receivers),))
    positions, _, shifts = make_inputs(len(runs), len(receivers), torch.float32, "cuda")
    for order in (torch.arange(len(receivers)), torch.randperm(len(receivers))):
        pairs = torch.stack([receivers, senders])[:, order].cuda()
        assert_matches(positions, pairs, shifts[order.cuda()], torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("bad", [None, 0, 1])
def test_cuda_sender_runs_in_sender_order(bad):
    # From 8,192 pairs on, the backward walks the senders in sender order and sums each run of
    # equal senders within a warp before its atomic: 40 senders, so runs span several warps;
    # receivers sorted as neighbor_list's. `bad`: an out-of-range receiver (0) or sender (1).
    atoms, count = 1100, 9000
    receivers = torch.sort(torch.randint(0, atoms, (count,))).values
    pairs = torch.stack([receivers, torch.randint(0, 40, (count,))]).cuda()
    positions, _, shifts = make_inputs(atoms, count, torch.float32, "cuda")
    if bad is None:
        assert_matches(positions, pairs, shifts, torch.float32)
        return
    pairs[bad, 4321] = atoms + 3
    positions.requires_grad_()
    (grad,) = torch.autograd.grad(mirage.ops.pair_vectors(positions, pairs, shifts)[1].nan_to_num().sum(), positions)
    assert torch.isnan(grad).all()


@pytest.mark.cuda
@pytest.mark.parametrize("atoms", [4, 1100])  # the backward in one block, and in a grid
def test_cuda_bad_index_inside_a_run(atoms):
    positions, _, shifts = make_inputs(atoms, 40, torch.float32, "cuda")
    pairs = torch.stack([torch.full((40,), 1), torch.randint(0, 4, (40,))]).cuda()
    pairs[1, 17] = atoms + 5
    positions.requires_grad_()
    vectors, distances = mirage.ops.pair_vectors(positions, pairs, shifts)
    (grad,) = torch.autograd.grad(distances.nan_to_num().sum(), positions)
    assert torch.isnan(grad).all()


@pytest.mark.cuda
@pytest.mark.parametrize("bad", [-1, 7, 2**40])
def test_cuda_out_of_range_pairs_give_nan(bad):
    positions, pairs, shifts = make_inputs(7, 20, torch.float32, "cuda")
    pairs[0, 3] = bad
    positions.requires_grad_()
    vectors, distances = mirage.ops.pair_vectors(positions, pairs, shifts)
    assert torch.isnan(vectors[3]).all() and torch.isnan(distances[3])
    rest = torch.arange(20, device="cuda") != 3
    assert torch.isfinite(vectors[rest]).all() and torch.isfinite(distances[rest]).all()
    (grad,) = torch.autograd.grad(vectors.nan_to_num().sum() + distances.nan_to_num().sum(), positions)
    assert torch.isnan(grad).all()
    pairs[0, 3] = 0  # a later call with valid pairs is unaffected
    (grad,) = torch.autograd.grad(mirage.ops.pair_vectors(positions, pairs, shifts)[1].sum(), positions)
    assert torch.isfinite(grad).all()


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay_with_new_inputs():
    atoms, count = 40, 500
    positions, pairs, shifts = make_inputs(atoms, count, torch.float32, "cuda")
    positions.requires_grad_()

    def step():
        vectors, distances = mirage.ops.pair_vectors(positions, pairs, shifts)
        energy = (torch.exp(-distances) + vectors[:, 1]).sum()
        return (distances.detach(), *torch.autograd.grad(energy, positions))

    graph, captured = capture_graph(step)
    for _ in range(3):
        fresh = make_inputs(atoms, count, torch.float32, "cuda")
        with torch.no_grad():
            positions.copy_(fresh[0])
        pairs.copy_(fresh[1])
        shifts.copy_(fresh[2])
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        torch.testing.assert_close(captured[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(captured[1], want[1], **tolerance(torch.float32))  # atomics' order
