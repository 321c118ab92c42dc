"""mirage::sender_order, and the `sender_order` argument of the ops whose backward scatters onto
the senders (pair_vectors, vector_message_passing, cfconv, radial_cfconv)."""

import math

import pytest
import torch

import mirage
from common import DEVICES, assert_error, opcheck, randn

MIN_PAIRS = 8192  # cuda/sender_order.h's kSenderOrderMinPairs (the Catch2 case pins it)


def receiver_sorted_pairs(atoms, count, device="cpu", senders=None):
    """A pair list as neighbor_list gives it: receivers sorted, senders random."""
    receivers = torch.sort(torch.randint(0, atoms, (count,))).values
    senders = torch.randint(0, senders or atoms, (count,))
    return torch.stack([receivers, senders]).to(device)


def assert_sender_order(order, pairs, nodes):
    """order is a permutation of the pairs with non-decreasing keys (the sender, or `nodes` for
    one out of range)."""
    order, senders = order.cpu().long(), pairs[1].cpu()
    assert order.dtype == torch.long and torch.equal(torch.sort(order).values, torch.arange(pairs.shape[1]))
    keys = torch.where((senders >= 0) & (senders < nodes), senders, nodes)[order]
    assert (keys[1:] >= keys[:-1]).all()


# ---- the op ----------------------------------------------------------------------------------

def test_cpu_order_is_stable_with_bad_senders_last():
    atoms, count = 50, MIN_PAIRS + 11
    pairs = receiver_sorted_pairs(atoms, count)
    pairs[1, [3, 700, count - 1]] = torch.tensor([-2, atoms, 10**12])
    order = mirage.ops.sender_order(pairs, atoms)
    assert order.dtype == torch.int32 and order.shape == (count,)
    keys = torch.where((pairs[1] >= 0) & (pairs[1] < atoms), pairs[1], atoms)
    assert torch.equal(order.long(), torch.sort(keys, stable=True).indices)
    assert set(order[-3:].tolist()) == {3, 700, count - 1}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count", [0, 1, MIN_PAIRS - 1])
def test_short_lists_get_no_order(device, count):
    order = mirage.ops.sender_order(receiver_sorted_pairs(10, count, device), 10)
    assert order.dtype == torch.int32 and order.shape == (0,) and order.device.type == device


@pytest.mark.parametrize("count", [5, MIN_PAIRS])
def test_meta_shape(count):
    pairs = torch.empty(2, count, dtype=torch.long, device="meta")
    order = torch.ops.mirage.sender_order(pairs, 7)
    assert order.shape == ((count,) if count >= MIN_PAIRS else (0,)) and order.dtype == torch.int32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count", [3, MIN_PAIRS + 1])
def test_opcheck(device, count):
    # On CUDA the order within a sender's run is the atomics' (it differs from call to call), so
    # eager and AOT outputs are compared only where it is deterministic: the CPU and short lists.
    deterministic = device == "cpu" or count < MIN_PAIRS
    utils = ("test_schema", "test_autograd_registration", "test_faketensor") + (
        ("test_aot_dispatch_dynamic",) if deterministic else ())
    pairs = receiver_sorted_pairs(9, count, device)
    for num_pairs in (None, torch.tensor([count - 2], device=device)):
        torch.library.opcheck(torch.ops.mirage.sender_order.default, (pairs, 9, num_pairs), test_utils=utils)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    pairs = receiver_sorted_pairs(4, 6, device)
    op = torch.ops.mirage.sender_order
    assert_error(lambda d: op(pairs.int(), 4), device, "mirage::sender_order: pairs must be int64, got Int")
    assert_error(lambda d: op(pairs[:1], 4), device, "mirage::sender_order: pairs must be [2, P], got [1, 6]")
    assert_error(lambda d: op(pairs, -1), device, "mirage::sender_order: num_nodes must be >= 0, got -1")


@pytest.mark.cuda
@pytest.mark.parametrize("atoms", [37, 3000, 20000])  # the counting sort (to 12,286 nodes), then the radix sort
def test_cuda_order_groups_by_sender_bad_ones_last(atoms):
    count = 3 * MIN_PAIRS + 5
    pairs = receiver_sorted_pairs(atoms, count, "cuda")
    pairs[:, -500:] = 0  # neighbor_list's padding: pair (0, 0)
    pairs[1, [0, 5, 9000]] = torch.tensor([-3, atoms, atoms + 7], device="cuda")
    order = mirage.ops.sender_order(pairs, atoms)
    assert order.dtype == torch.int32 and order.shape == (count,) and order.is_cuda
    assert_sender_order(order, pairs, atoms)
    assert set(order[-3:].tolist()) == {0, 5, 9000}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count", [MIN_PAIRS + 3, -1, 10**9])  # a count, then neighbor_list's NaN and overflow cases
def test_padding_past_num_pairs_comes_last(device, count):
    atoms, total = 60, MIN_PAIRS + 1003
    pairs = receiver_sorted_pairs(atoms, total, device)
    pairs[:, MIN_PAIRS + 3:] = 0  # neighbor_list's padding: pair (0, 0)
    pairs[1, 17] = atoms  # a bad sender before the count: walked, so before the padding
    order = mirage.ops.sender_order(pairs, atoms, torch.tensor([count], device=device)).long().cpu()
    walked = count if 0 <= count < total else total
    assert torch.equal(torch.sort(order).values, torch.arange(total))
    assert (order[walked:] >= walked).all() and (order[:walked] < walked).all()
    keys = torch.where(pairs[1].cpu() < atoms, pairs[1].cpu(), atoms)[order[:walked]]
    assert (keys[1:] >= keys[:-1]).all() and order[walked - 1] == 17
    if device == "cpu":  # stable
        assert torch.equal(order[walked:], torch.arange(walked, total))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_num_pairs(device):
    pairs = receiver_sorted_pairs(4, 6, device)
    for count, message in ((torch.tensor([3], dtype=torch.int32, device=device), "got Int of shape [1]"),
                           (torch.tensor([3, 4], device=device), "got Long of shape [2]")):
        assert_error(lambda d: mirage.ops.sender_order(pairs, 4, count), device,
                     "mirage::sender_order: num_pairs must be one int64 (neighbor_list's count), " + message)


# ---- the argument: one problem per op, run(order) -> (outputs, gradients) ----------------------

def pair_vectors_problem(atoms, pairs, dtype):
    device, count = pairs.device, pairs.shape[1]
    positions = randn(atoms, 3, dtype=dtype, device=device, std=3.0)
    shifts = randn(count, 3, dtype=dtype, device=device)
    grads = randn(count, 3, dtype=dtype, device=device), randn(count, dtype=dtype, device=device)

    def run(order):
        leaf = positions.detach().requires_grad_()
        outputs = mirage.ops.pair_vectors(leaf, pairs, shifts, sender_order=order)
        return outputs, torch.autograd.grad(outputs, leaf, grads)
    return run


def vector_message_passing_problem(atoms, pairs, dtype):
    device, count, features = pairs.device, pairs.shape[1], 8
    inputs = [randn(*shape, dtype=dtype, device=device)
              for shape in ((atoms, 3 * features), (count, 3 * features), (atoms, 3, features), (count, 3))]
    grads = randn(atoms, features, dtype=dtype, device=device), randn(atoms, 3, features, dtype=dtype, device=device)

    def run(order):
        leaves = [t.detach().requires_grad_() for t in inputs]
        outputs = mirage.ops.vector_message_passing(*leaves, pairs, sender_order=order)
        return outputs, torch.autograd.grad(outputs, leaves, grads)
    return run


def filter_network_problem(op, inputs, atoms, pairs, dtype):
    """cfconv's and radial_cfconv's: op(*inputs, pairs, a filter network 20 -> 128 -> 128)."""
    device = pairs.device
    w1 = randn(128, 20, dtype=dtype, device=device) * (2 / math.sqrt(20))
    w2 = randn(128, 128, dtype=dtype, device=device) / math.sqrt(128)
    b1, b2 = randn(128, dtype=dtype, device=device), randn(128, dtype=dtype, device=device)
    grad = randn(atoms, 128, dtype=dtype, device=device)

    def run(order):
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = op(*leaves, pairs, w1, b1, w2, b2, "shifted_softplus", sender_order=order)
        return [out], torch.autograd.grad(out, leaves, grad)
    return run


def cfconv_problem(atoms, pairs, dtype):
    # 128 wide: Hopper's kernels where there are (sm_90a), the portable ones elsewhere.
    device, count = pairs.device, pairs.shape[1]
    inputs = [randn(atoms, 128, dtype=dtype, device=device), torch.rand(count, 20, dtype=dtype, device=device),
              torch.rand(count, dtype=dtype, device=device)]
    return filter_network_problem(mirage.ops.cfconv, inputs, atoms, pairs, dtype)


def radial_cfconv_problem(atoms, pairs, dtype):
    device, count = pairs.device, pairs.shape[1]
    inputs = [randn(atoms, 128, dtype=dtype, device=device), torch.rand(count, dtype=dtype, device=device) * 4.5 + 0.3]
    return filter_network_problem(mirage.ops.radial_cfconv, inputs, atoms, pairs, dtype)


PROBLEMS = {"pair_vectors": pair_vectors_problem, "vector_message_passing": vector_message_passing_problem,
            "cfconv": cfconv_problem, "radial_cfconv": radial_cfconv_problem}
ATOMS, COUNT = 700, MIN_PAIRS + 808  # long enough for the CUDA backwards to walk in sender order


def problem(name, device, dtype=torch.float32, count=COUNT):
    if name == "cfconv" and device == "cuda" and not mirage.ops.cfconv_supported(20, 128, 128, "cuda"):
        pytest.skip("cfconv at width 128 needs more shared memory a block than this GPU has (an sm_86/sm_89 GPU)")
    pairs = receiver_sorted_pairs(ATOMS, count, device)
    return pairs, PROBLEMS[name](ATOMS, pairs, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", PROBLEMS)
def test_given_orders_give_the_results_of_none(device, name):
    # mirage::sender_order's order, any other permutation (slower on CUDA, still correct), and the
    # empty order of a short list (the same as None).
    pairs, run = problem(name, device)
    want = [t for ts in run(None) for t in ts]
    for order in (mirage.ops.sender_order(pairs, ATOMS), torch.randperm(COUNT, device=device).int(),
                  torch.empty(0, dtype=torch.int32, device=device)):
        for got, expected in zip([t for ts in run(order) for t in ts], want):
            # The CPU references do not read the order; CUDA sums in float32 atomics' order.
            torch.testing.assert_close(got, expected, **({} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-4}))


@pytest.mark.parametrize("name", PROBLEMS)
def test_cpu_raises_for_an_order_that_is_no_permutation(name):
    pairs, run = problem(name, "cpu")
    order = mirage.ops.sender_order(pairs, ATOMS)
    order[10] = order[11]
    with pytest.raises(RuntimeError, match=rf"mirage::{name}: sender_order must be a permutation of \[0, P\), "
                                           rf"but sender_order\[11\] = {order[11].item()} appears twice"):
        run(order)
    order[10] = COUNT
    with pytest.raises(RuntimeError, match=rf"sender_order\[10\] = {COUNT} is out of range"):
        run(order)


def counted_call(name, pairs):
    """The op `name` (cfconv or vector_message_passing) on the CPU over `pairs`, as a function of
    (sender_order, num_pairs)."""
    P, f64 = pairs.shape[1], dict(dtype=torch.float64)
    if name == "cfconv":
        x, basis, envelope = randn(ATOMS, 64, **f64), torch.rand(P, 8, **f64), torch.rand(P, **f64)
        w1, w2 = randn(64, 8, **f64), randn(64, 64, **f64) / 8
        return lambda order, count: mirage.ops.cfconv(x, basis, envelope, pairs, w1, None, w2, None,
                                                      sender_order=order, num_pairs=count)
    x, filter = randn(ATOMS, 6, **f64), randn(P, 6, **f64)
    vectors, directions = randn(ATOMS, 3, 2, **f64), randn(P, 3, **f64)
    return lambda order, count: mirage.ops.vector_message_passing(x, filter, vectors, directions, pairs,
                                                                  sender_order=order, num_pairs=count)


@pytest.mark.parametrize("name", ["cfconv", "vector_message_passing"])
def test_cpu_raises_for_an_order_that_mixes_padding_into_the_counted_pairs(name):
    # With num_pairs the walk stops at the count: an order formed without it fails there.
    pairs = receiver_sorted_pairs(ATOMS, COUNT)
    count = torch.tensor([COUNT - 300])
    call = counted_call(name, pairs)
    with pytest.raises(RuntimeError, match=rf"mirage::{name}: sender_order must keep the {COUNT - 300} counted "
                                           r"pairs \(num_pairs\) before the padding"):
        call(mirage.ops.sender_order(pairs, ATOMS), count)
    call(mirage.ops.sender_order(pairs, ATOMS, count), count)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", PROBLEMS)
def test_bad_order_arguments(device, name):
    pairs, run = problem(name, device, count=40)
    assert_error(lambda d: run(torch.arange(40, device=d)), device,
                 f"mirage::{name}: sender_order must be int32 (mirage::sender_order's), got Long")
    assert_error(lambda d: run(torch.arange(39, device=d, dtype=torch.int32)), device,
                 f"mirage::{name}: sender_order must have shape [P] = [40] or [0]")
    assert_error(lambda d: run(torch.zeros(2, 40, device=d, dtype=torch.int32)), device,
                 f"mirage::{name}: sender_order must have shape [P] = [40] or [0]")


@pytest.mark.cuda
@pytest.mark.parametrize("name", PROBLEMS)
def test_cuda_order_on_another_device(name):
    pairs, run = problem(name, "cuda", count=40)
    assert_error(lambda d: run(torch.arange(40, dtype=torch.int32)), "cuda",
                 f"mirage::{name}: sender_order must be on pairs' device (cuda:0), got cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("name", PROBLEMS)
@pytest.mark.parametrize("bad", ["repeat", "negative", "past the end", "swap of a repeat"])
def test_cuda_an_order_that_is_no_permutation_turns_the_gradients_nan(name, bad):
    # Checked on the device, without a sync: every gradient NaN, as for an out-of-range index
    # (the forward does not read the order). A later call with a good order is unaffected.
    pairs, run = problem(name, "cuda")
    order = mirage.ops.sender_order(pairs, ATOMS)
    if bad == "repeat":
        order[100] = order[5000]
    elif bad == "negative":
        order[7] = -1
    elif bad == "past the end":
        order[COUNT - 1] = COUNT
    else:  # two entries that swap places keep the multiset; one repeated too does not
        order[[1, 2, 3]] = order[[2, 1, 1]]
    outputs, gradients = run(order)
    assert all(torch.isfinite(t).all() for t in outputs)
    assert all(torch.isnan(t).all() for t in gradients)
    outputs, gradients = run(mirage.ops.sender_order(pairs, ATOMS))
    assert all(torch.isfinite(t).all() for t in gradients)


@pytest.mark.parametrize("name", ["pair_vectors", "vector_message_passing"])
def test_gradcheck_and_gradgradcheck_with_an_order(name):
    # The order passes through the autograd Functions as one more input (no gradient).
    pairs = receiver_sorted_pairs(5, 12)
    order = torch.randperm(12).int()
    if name == "pair_vectors":
        positions = randn(5, 3, dtype=torch.float64).requires_grad_()

        def fn(positions):
            return mirage.ops.pair_vectors(positions, pairs, sender_order=order)
        leaves = [positions]
    else:
        leaves = [randn(*shape, dtype=torch.float64).requires_grad_() for shape in ((5, 6), (5, 3, 2))]
        filter, directions = randn(12, 6, dtype=torch.float64), randn(12, 3, dtype=torch.float64)

        def fn(x, vectors):
            return mirage.ops.vector_message_passing(x, filter, vectors, directions, pairs, sender_order=order)
    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradgradcheck(fn, leaves)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_an_order(device):
    # Many atoms: a few pairs each, so that float32 atomics in another order stay within
    # opcheck's tolerance.
    pairs = receiver_sorted_pairs(3000, MIN_PAIRS + 3, device)
    order = mirage.ops.sender_order(pairs, 3000)
    positions = randn(3000, 3, device=device)
    opcheck(torch.ops.mirage.pair_vectors.default, (positions, pairs, None, order))
    count = pairs.shape[1]
    grads = (randn(count, 3, device=device), randn(count, device=device))
    opcheck(torch.ops.mirage.pair_vectors_backward.default, (*grads, positions, pairs, None, order))
