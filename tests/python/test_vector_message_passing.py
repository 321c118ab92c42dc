import pytest
import torch

import mirage
from common import DEVICES, DTYPES, OpCounter, assert_close_to, assert_error, capture_graph, opcheck, randn, strided
from tolerances import tolerance

OP = torch.ops.mirage.vector_message_passing
BACKWARD_OP = torch.ops.mirage.vector_message_passing_backward
# From this many pairs on, the CUDA backward walks the pairs in sender order (cuda/pair_order.cuh,
# kSenderOrderMinPairs; the Catch2 test of the ordering fails when that constant changes alone).
SENDER_ORDER_MIN_PAIRS = 8192


def composite(x, filter, vectors, directions, pairs):
    """PaiNNMessage of examples/forcefield/models.py (without its residual adds) in plain torch."""
    features = vectors.shape[-1]
    i, j = pairs
    m = x[j] * filter  # [P, 3F]
    m_s, m_vv, m_vs = torch.split(m, features, dim=-1)
    dv = vectors[j] * m_vv[:, None, :] + m_vs[:, None, :] * directions[:, :, None]  # [P, 3, F]
    scalar = torch.zeros(x.shape[0], features, dtype=x.dtype, device=x.device).index_add(0, i, m_s)
    vector = torch.zeros_like(vectors).index_add(0, i, dv)
    return scalar, vector


def make_pairs(nodes, count, device="cpu", order="random"):
    """[2, P] int64: random receivers and senders (repeats and i == j included); "sorted" groups
    them by receiver as neighbor_list does."""
    pairs = torch.randint(0, max(nodes, 1), (2, count))
    if order == "sorted":
        pairs = pairs[:, torch.argsort(pairs[0], stable=True)]
    return pairs.to(device)


def make_inputs(nodes, features, count, dtype=torch.float32, device="cpu", order="random"):
    x = randn(nodes, 3 * features, dtype=dtype, device=device)
    filter = randn(count, 3 * features, dtype=dtype, device=device)
    vectors = randn(nodes, 3, features, dtype=dtype, device=device)
    d = torch.randn(count, 3, dtype=torch.float64)
    directions = (d / d.norm(dim=-1, keepdim=True)).to(dtype=dtype, device=device)
    return x, filter, vectors, directions, make_pairs(nodes, count, device, order)


def reference(inputs):
    """composite in float64 on the CPU, from the same (rounded) values."""
    *floats, pairs = inputs
    return composite(*[t.detach().double().cpu() for t in floats], pairs.cpu())


def assert_forward_matches(inputs, dtype):
    scalar, vector = mirage.ops.vector_message_passing(*inputs)
    want_scalar, want_vector = reference(inputs)
    # The outputs are sums of products, so the same sums over absolute values bound their terms.
    *floats, pairs = inputs
    magnitudes = reference([t.abs() for t in floats] + [pairs])
    assert_close_to(scalar, want_scalar, dtype, magnitudes[0])
    assert_close_to(vector, want_vector, dtype, magnitudes[1])
    return scalar, vector


def gradients(fn, inputs, grad_scalar, grad_vector):
    """d(<grad_scalar, scalar> + <grad_vector, vector>) / d(each floating input): inputs are the
    floating inputs, then pairs."""
    *floats, pairs = inputs
    leaves = [t.detach().requires_grad_() for t in floats]
    scalar, vector = fn(*leaves, pairs)
    return torch.autograd.grad((scalar, vector), leaves, (grad_scalar, grad_vector))


def assert_backward_matches(inputs, dtype):
    x, vectors = inputs[0], inputs[2]
    grad_scalar = randn(x.shape[0], vectors.shape[-1], dtype=dtype, device=x.device)
    grad_vector = randn(*vectors.shape, dtype=dtype, device=x.device)
    got = gradients(mirage.ops.vector_message_passing, inputs, grad_scalar, grad_vector)
    want = gradients(composite, [t.detach().double().cpu() for t in inputs[:4]] + [inputs[4].cpu()],
                     grad_scalar.double().cpu(), grad_vector.double().cpu())
    # Every gradient is a sum of products, so the same sums over absolute values bound its terms.
    magnitudes = gradients(composite, [t.detach().double().cpu().abs() for t in inputs[:4]] + [inputs[4].cpu()],
                           grad_scalar.double().cpu().abs(), grad_vector.double().cpu().abs())
    for name, g, w, m in zip(["x", "filter", "vectors", "directions"], got, want, magnitudes):
        try:
            assert_close_to(g, w, dtype, m)
        except AssertionError as error:
            raise AssertionError(f"gradient of {name}: {error}") from None


# ---- forward and backward against the PaiNN composite -------------------------------------

SHAPES = [(1, 1, 1), (1, 3, 4), (5, 7, 23), (12, 128, 132), (9, 129, 60), (4, 3, 0)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nodes,features,count", SHAPES)
@pytest.mark.parametrize("order", ["random", "sorted"])
def test_matches_composite(device, dtype, nodes, features, count, order):
    inputs = make_inputs(nodes, features, count, dtype, device, order)
    scalar, vector = assert_forward_matches(inputs, dtype)
    assert scalar.shape == (nodes, features) and vector.shape == (nodes, 3, features)
    if device == "cpu":  # CUDA's float atomics add in any order: runs need not agree to the bit
        opcheck(torch.ops.mirage.vector_message_passing.default, inputs)
    if count == 0:
        assert (scalar == 0).all() and (vector == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nodes,features,count", SHAPES)
def test_backward_matches_composite(device, dtype, nodes, features, count):
    assert_backward_matches(make_inputs(nodes, features, count, dtype, device, "sorted"), dtype)


def test_float64_on_cpu():
    inputs = make_inputs(6, 5, 31, torch.float64)
    assert_forward_matches(inputs, torch.float64)
    assert_backward_matches(inputs, torch.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs(device):
    x, filter, vectors, directions, pairs = make_inputs(7, 6, 40, torch.float32, device)
    wide = torch.stack([pairs, torch.zeros_like(pairs)], dim=-1).reshape(2, -1)  # [2, 2P]
    strided_pairs = wide[:, ::2]
    assert not strided_pairs.is_contiguous() and torch.equal(strided_pairs, pairs)
    inputs = (strided(x), strided(filter), strided(vectors), strided(directions), strided_pairs)
    assert all(not t.is_contiguous() for t in inputs)
    assert_forward_matches(inputs, torch.float32)
    assert_backward_matches(inputs, torch.float32)
    # pairs as the transpose of a [P, 2] tensor.
    transposed = pairs.t().contiguous().t()
    assert not transposed.is_contiguous()
    assert_forward_matches((x, filter, vectors, directions, transposed), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_pairs_add_up(device):
    # The same pair listed k times contributes k times (the kernels must not merge it away).
    x, filter, vectors, directions, _ = make_inputs(3, 4, 1, torch.float32, device)
    once = mirage.ops.vector_message_passing(x, filter, vectors, directions,
                                             torch.tensor([[2], [0]], device=device))
    thrice = mirage.ops.vector_message_passing(x, filter.expand(3, -1), vectors, directions.expand(3, -1),
                                               torch.tensor([[2, 2, 2], [0, 0, 0]], device=device))
    for a, b in zip(once, thrice):
        torch.testing.assert_close(b, 3 * a)
        assert (a[:2] == 0).all() and (a[2] != 0).any()


@pytest.mark.parametrize("device", DEVICES)
def test_nan_propagates_to_the_receivers(device):
    x, filter, vectors, directions, _ = make_inputs(4, 5, 3, torch.float32, device)
    pairs = torch.tensor([[0, 1, 2], [3, 2, 1]], device=device)  # 1 -> 2, 3 -> 0, 2 -> 1
    x[3, 0] = float("nan")        # scalar part, feature 0 of sender 3 (receiver 0)
    vectors[2, 1, 4] = float("nan")  # vector feature 4 of sender 2 (receiver 1)
    scalar, vector = mirage.ops.vector_message_passing(x, filter, vectors, directions, pairs)
    assert torch.isnan(scalar[0, 0]) and torch.isfinite(scalar[0, 1:]).all()
    assert torch.isnan(vector[1, :, 4]).any() and torch.isfinite(vector[1, :, :4]).all()
    assert torch.isfinite(scalar[1:]).all() and torch.isfinite(vector[[0, 2, 3]]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    for nodes, count in [(0, 0), (3, 0)]:
        inputs = make_inputs(nodes, 4, count, torch.float32, device)
        scalar, vector = mirage.ops.vector_message_passing(*inputs)
        assert scalar.shape == (nodes, 4) and vector.shape == (nodes, 3, 4)
        assert (scalar == 0).all() and (vector == 0).all()
        grads = gradients(mirage.ops.vector_message_passing, inputs, torch.ones_like(scalar),
                          torch.ones_like(vector))
        assert [tuple(g.shape) for g in grads] == [(nodes, 12), (0, 12), (nodes, 3, 4), (0, 3)]
        assert all((g == 0).all() for g in grads)


# ---- autograd, opcheck, compile, autocast -------------------------------------------------

def test_gradcheck_and_gradgradcheck():
    x, filter, vectors, directions, _ = make_inputs(5, 3, 1, torch.float64)
    # Unsorted, repeated and self pairs; node 4 sends and receives nothing.
    pairs = torch.tensor([[1, 0, 3, 1, 1, 2, 0], [0, 3, 3, 2, 2, 1, 1]])
    count = pairs.shape[1]
    filter = randn(count, 9, dtype=torch.float64)
    directions = torch.nn.functional.normalize(torch.randn(count, 3, dtype=torch.float64), dim=-1)
    leaves = [t.requires_grad_() for t in (x, filter, vectors, directions)]

    def fn(*args):
        return mirage.ops.vector_message_passing(*args, pairs)

    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradgradcheck(fn, leaves)


def test_backward_op_gradcheck():
    # The fused backward op is differentiable in all its floating inputs (grad outputs included).
    x, filter, vectors, directions, pairs = make_inputs(4, 2, 9, torch.float64)
    grad_scalar, grad_vector = randn(4, 2, dtype=torch.float64), randn(4, 3, 2, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (grad_scalar, grad_vector, x, filter, vectors, directions)]
    assert torch.autograd.gradcheck(lambda *a: BACKWARD_OP(*a, pairs), leaves)


def test_only_one_output_used():
    # Autograd hands an undefined gradient for the unused output; the backward sees zeros.
    inputs = make_inputs(5, 4, 17, torch.float64)
    x = inputs[0].requires_grad_()
    scalar, _ = mirage.ops.vector_message_passing(x, *inputs[1:])
    (got,) = torch.autograd.grad(scalar.sum(), x)
    (want,) = torch.autograd.grad(composite(x, *inputs[1:])[0].sum(), x)
    torch.testing.assert_close(got, want)


def test_backward_uses_the_fused_op():
    inputs = make_inputs(5, 4, 17, torch.float32)
    leaves = [t.requires_grad_() for t in inputs[:4]]
    scalar, vector = mirage.ops.vector_message_passing(*leaves, inputs[4])
    with OpCounter() as counter:
        torch.autograd.grad((scalar.sum() + vector.sum()), leaves)
    assert "mirage.vector_message_passing_backward" in counter.calls
    assert "aten.index_add" not in counter.calls  # no composite recompute in first order


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("nodes,features,count", [(5, 3, 11), (3, 8, 0), (1, 1, 2)])
def test_opcheck(device, requires_grad, nodes, features, count):
    x, filter, vectors, directions, pairs = make_inputs(nodes, features, count, torch.float32, device)
    floats = [t.requires_grad_(requires_grad) for t in (x, filter, vectors, directions)]
    torch.library.opcheck(OP.default, (*floats, pairs))
    grads = (randn(nodes, features, device=device).requires_grad_(requires_grad),
             randn(nodes, 3, features, device=device).requires_grad_(requires_grad))
    torch.library.opcheck(BACKWARD_OP.default, (*grads, *floats, pairs))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()

    def step(x, filter, vectors, directions, pairs):
        scalar, vector = mirage.ops.vector_message_passing(x, filter, vectors, directions, pairs)
        return scalar + 1, (vector * vector).sum(1)

    compiled = torch.compile(step, fullgraph=True)
    for count in [40, 40, 57]:
        inputs = make_inputs(9, 8, count, torch.float32, device)
        got = compiled(*inputs)
        want = step(*inputs)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
            assert not torch.equal(a, torch.zeros_like(a))


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_runs_in_the_autocast_dtype(device):
    inputs = make_inputs(6, 5, 30, torch.float32, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        scalar, vector = mirage.ops.vector_message_passing(*inputs)
    assert scalar.dtype == vector.dtype == torch.bfloat16
    cast = [t.bfloat16() for t in inputs[:4]] + [inputs[4]]
    want_scalar, want_vector = reference(cast)
    assert_close_to(scalar, want_scalar, torch.bfloat16)
    assert_close_to(vector, want_vector, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_low_precision_gradients_flow(device):
    inputs = make_inputs(5, 4, 12, torch.float16, device)
    leaves = [t.requires_grad_() for t in inputs[:4]]
    scalar, vector = mirage.ops.vector_message_passing(*leaves, inputs[4])
    (scalar.sum() + vector.sum()).backward()
    assert all(t.grad.dtype == torch.float16 and torch.isfinite(t.grad).all() for t in leaves)


def test_double_backward_in_low_precision():
    # Force training in bfloat16: the second-order terms come from the composite in float32.
    inputs64 = make_inputs(5, 4, 12, torch.float64)
    rounded = [t.to(torch.bfloat16).double() for t in inputs64[:4]]  # what the bfloat16 run sees

    def second_order(floats, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in floats]
        scalar, vector = mirage.ops.vector_message_passing(*leaves, inputs64[4])
        (g_dir,) = torch.autograd.grad(scalar.sum() + vector.sum(), leaves[3], create_graph=True)
        (g_x,) = torch.autograd.grad((g_dir * g_dir).sum(), leaves[0])
        return g_x

    got = second_order(rounded, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    want = second_order(rounded, torch.float64)
    # Sums of products: the same sums over absolute values bound their terms; bfloat16 rounds the
    # first gradient (and the result) to 8 significant bits: a few of its eps (2^-7) of that bound
    # (the worst of 40 random draws used a fifth of this allowance).
    magnitude = second_order([t.abs() for t in rounded], torch.float64)
    allowed = 1e-2 + 4 * torch.finfo(torch.bfloat16).eps * magnitude
    assert ((got.double() - want).abs() <= allowed).all(), ((got.double() - want).abs() - allowed).max()


# ---- bad input ----------------------------------------------------------------------------

def _call(device, nodes=4, features=3, count=5, edit=None, op=None):
    args = dict(zip(["x", "filter", "vectors", "directions", "pairs"],
                    make_inputs(nodes, features, count, torch.float32, device)))
    if edit is not None:
        edit(args)
    if op == "backward":
        return BACKWARD_OP(torch.rand(nodes, features, device=device),
                           torch.rand(nodes, 3, features, device=device), *args.values())
    return mirage.ops.vector_message_passing(*args.values())


def _set(name, fn):
    def edit(args):
        args[name] = fn(args[name])
    return edit


NAME = "mirage::vector_message_passing: "
BAD_INPUTS = [
    (_set("x", lambda t: t[:, :8]), NAME + "x must be [N, 3F] (a last dimension divisible by 3), got [4, 8]"),
    (_set("x", lambda t: t[0]), NAME + "x must be [N, 3F] (a last dimension divisible by 3), got [9]"),
    (_set("x", lambda t: t.long()), NAME + "x must be float32, float16 or bfloat16 (float64 off the GPU), got Long"),
    (_set("vectors", lambda t: t[:, :, :2]),
     NAME + "vectors must have shape [N, 3, F] = [4, 3, 3], got [4, 3, 2]"),
    (_set("vectors", lambda t: t[:3]), NAME + "vectors must have shape [N, 3, F] = [4, 3, 3], got [3, 3, 3]"),
    (_set("vectors", lambda t: t.reshape(4, 9)), NAME + "vectors must have shape [N, 3, F] = [4, 3, 3], got [4, 9]"),
    (_set("vectors", lambda t: t.half()), NAME + "vectors must have x's dtype (Float), got Half"),
    (_set("filter", lambda t: t[:4]), NAME + "filter must have shape [P, 3F] = [5, 9], got [4, 9]"),
    (_set("filter", lambda t: t[:, :6]), NAME + "filter must have shape [P, 3F] = [5, 9], got [5, 6]"),
    (_set("filter", lambda t: t.int()), NAME + "filter must have x's dtype (Float), got Int"),
    (_set("directions", lambda t: t[:, :2]), NAME + "directions must have shape [P, 3] = [5, 3], got [5, 2]"),
    (_set("directions", lambda t: t.bfloat16()), NAME + "directions must have x's dtype (Float), got BFloat16"),
    (_set("pairs", lambda t: t.int()), NAME + "pairs must be int64, got Int"),
    (_set("pairs", lambda t: t.float()), NAME + "pairs must be int64, got Float"),
    (_set("pairs", lambda t: t[0]), NAME + "pairs must be [2, P], got [5]"),
    (_set("pairs", lambda t: t.repeat(2, 1)), NAME + "pairs must be [2, P], got [4, 5]"),
]


@pytest.mark.parametrize("edit,message", BAD_INPUTS)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(edit, message, device):
    assert_error(lambda d: _call(d, edit=edit), device, message)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_backward(device):
    assert_error(lambda d: _call(d, edit=_set("x", lambda t: t[:, :8]), op="backward"), device,
                 "mirage::vector_message_passing_backward: x must be [N, 3F]")
    with pytest.raises(RuntimeError, match="vector_message_passing_backward: grad_scalar must have shape "
                                           r"\[N, F\] = \[4, 3\], got \[4, 2\]"):
        BACKWARD_OP(torch.rand(4, 2, device=device), torch.rand(4, 3, 3, device=device),
                    *make_inputs(4, 3, 5, torch.float32, device))
    with pytest.raises(RuntimeError, match="vector_message_passing_backward: grad_vector must have x's dtype"):
        BACKWARD_OP(torch.rand(4, 3, device=device), torch.rand(4, 3, 3, device=device).half(),
                    *make_inputs(4, 3, 5, torch.float32, device))


def test_out_of_range_pairs_raise_on_cpu():
    for bad, where in [((0, 2), -1), ((1, 3), 4)]:
        inputs = list(make_inputs(4, 3, 5))
        inputs[4][bad] = where
        with pytest.raises(RuntimeError, match=rf"mirage::vector_message_passing: pairs must index nodes in "
                                               rf"\[0, N\) \(N=4\), got pairs\[{bad[0]}, {bad[1]}\] = {where}"):
            mirage.ops.vector_message_passing(*inputs)
        with pytest.raises(RuntimeError, match="vector_message_passing_backward: pairs must index nodes"):
            BACKWARD_OP(torch.rand(4, 3), torch.rand(4, 3, 3), *inputs)


@pytest.mark.cuda
def test_wrong_device_and_float64_on_cuda():
    inputs = list(make_inputs(4, 3, 5, torch.float32, "cuda"))
    for k, name in enumerate(["filter", "vectors", "directions", "pairs"], start=1):
        moved = list(inputs)
        moved[k] = moved[k].cpu()
        with pytest.raises(RuntimeError, match=f"mirage::vector_message_passing: {name} must be on the same "
                                               "device as x"):
            mirage.ops.vector_message_passing(*moved)
    with pytest.raises(RuntimeError, match="x must be float32, float16 or bfloat16 .float64 off the GPU., "
                                           "got Double on cuda"):
        mirage.ops.vector_message_passing(*[t.double() for t in inputs[:4]], inputs[4])


# ---- CUDA ---------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nodes,features,count", [(12, 128, 132), (3000, 128, 130_000), (700, 129, 9000),
                                                  (300, 7, 5000), (500, 256, 9000)])
@pytest.mark.parametrize("order", ["sorted", "random"])
def test_cuda_large(dtype, nodes, features, count, order):
    inputs = make_inputs(nodes, features, count, dtype, "cuda", order)
    assert_forward_matches(inputs, dtype)
    assert_backward_matches(inputs, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_misaligned_inputs_take_the_scalar_path(dtype):
    # Contiguous views one element into their storage: 16-byte loads would be misaligned.
    x, filter, vectors, directions, pairs = make_inputs(20, 8, 300, dtype, "cuda")

    def shifted(t):
        flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = flat[1:].view(t.shape)
        view.copy_(t)
        return view

    inputs = (shifted(x), shifted(filter), shifted(vectors), directions, pairs)
    assert_forward_matches(inputs, dtype)
    assert_backward_matches(inputs, dtype)


@pytest.mark.cuda
def test_cuda_agrees_with_cpu_reference():
    inputs = make_inputs(40, 32, 900, torch.float32, "cpu", "sorted")
    cpu = mirage.ops.vector_message_passing(*inputs)
    gpu = mirage.ops.vector_message_passing(*[t.cuda() for t in inputs])
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a.cpu(), b, atol=2e-5, rtol=2e-5)
    grads = (randn(40, 32), randn(40, 3, 32))
    cpu = BACKWARD_OP(*grads, *inputs)
    gpu = BACKWARD_OP(*[t.cuda() for t in grads], *[t.cuda() for t in inputs])
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a.cpu(), b, atol=1e-4, rtol=2e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [-1, 7, 2**40])
@pytest.mark.parametrize("count", [50, SENDER_ORDER_MIN_PAIRS])
def test_cuda_out_of_range_pairs_give_nan(dtype, bad, count):
    inputs = list(make_inputs(7, 8, count, dtype, "cuda", "sorted"))
    good = inputs[4].clone()
    inputs[4][1, 31] = bad  # a sender
    outputs = mirage.ops.vector_message_passing(*inputs)
    grads = BACKWARD_OP(randn(7, 8, dtype=dtype, device="cuda"), randn(7, 3, 8, dtype=dtype, device="cuda"),
                        *inputs)
    torch.cuda.synchronize()  # no launch or memory error
    assert all(torch.isnan(t).all() for t in (*outputs, *grads))
    inputs[4] = good.clone()
    inputs[4][0, 3] = bad  # a receiver
    assert all(torch.isnan(t).all() for t in mirage.ops.vector_message_passing(*inputs))
    inputs[4] = good  # the flag does not stick to the next call
    assert_forward_matches(inputs, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nodes,count", [(50, 600), (300, SENDER_ORDER_MIN_PAIRS)])
def test_cuda_graph_capture_and_replay_with_new_inputs(dtype, nodes, count):
    # What a force field captures: messages and their gradient (forces), replayed on new values.
    features = 16
    static = [t.requires_grad_(k < 4) for k, t in enumerate(make_inputs(nodes, features, count, dtype, "cuda"))]
    grad_scalar = randn(nodes, features, dtype=dtype, device="cuda")
    grad_vector = randn(nodes, 3, features, dtype=dtype, device="cuda")

    def step():
        scalar, vector = mirage.ops.vector_message_passing(*static)
        grads = torch.autograd.grad((scalar, vector), static[:4], (grad_scalar, grad_vector))
        return (scalar.detach(), vector.detach(), *grads)

    graph, captured = capture_graph(step)
    for order in ["random", "sorted", "random"]:
        fresh = make_inputs(nodes, features, count, dtype, "cuda", order)
        with torch.no_grad():
            for s, f in zip(static, fresh):
                s.copy_(f)
        grad_scalar.copy_(randn(nodes, features, dtype=dtype, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want_scalar, want_vector = reference(fresh)
        assert_close_to(captured[0], want_scalar, dtype)
        assert_close_to(captured[1], want_vector, dtype)
        eager = step()
        for a, b in zip(captured[2:], eager[2:]):
            # Two runs of float32 atomics, each summing in its own order: they agree to the
            # tolerance of the gradient's scale, not of each (possibly cancelled) element.
            tol = tolerance(dtype)
            scale = max(b.abs().max().item(), 1.0)
            torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * scale)


# ---- the filter formed from a basis (filter_weight) -----------------------------------------

def formed(x, basis, vectors, directions, weight, pairs):
    """The op with filter_weight, in plain torch: the filter is basis @ weight^T. The floating
    inputs first, as `gradients` takes them."""
    return composite(x, basis @ weight.T, vectors, directions, pairs)


def mirage_formed(x, basis, vectors, directions, weight, pairs, order=None):
    return mirage.ops.vector_message_passing(x, basis, vectors, directions, pairs, weight, sender_order=order)


def make_formed_inputs(nodes, features, count, width, dtype=torch.float32, device="cpu", order="sorted"):
    """(x, basis, vectors, directions, pairs, filter_weight) with a [P, K] basis and [3F, K] weight."""
    x, _, vectors, directions, pairs = make_inputs(nodes, features, count, dtype, device, order)
    basis = randn(count, width, dtype=dtype, device=device)
    weight = randn(3 * features, width, dtype=dtype, device=device) / width**0.5
    return x, basis, vectors, directions, pairs, weight


def assert_formed_matches(inputs, dtype, order=None):
    """Forward and every gradient against `formed` in float64 (bounds as assert_forward_matches);
    order: the sender order handed to the op (None: its own)."""
    x, basis, vectors, directions, pairs, weight = inputs
    ordered = (x, basis, vectors, directions, weight, pairs)
    as64 = lambda t: t.detach().double().cpu()  # noqa: E731
    exact = [as64(t) for t in ordered[:5]] + [pairs.cpu()]
    bound = [as64(t).abs() for t in ordered[:5]] + [pairs.cpu()]
    got = mirage.ops.vector_message_passing(*inputs, sender_order=order)
    for g, w, m in zip(got, formed(*exact), formed(*bound)):
        assert_close_to(g, w, dtype, m)
    grad_scalar = randn(x.shape[0], vectors.shape[-1], dtype=dtype, device=x.device)
    grad_vector = randn(*vectors.shape, dtype=dtype, device=x.device)
    got = gradients(lambda *a: mirage_formed(*a, order), ordered, grad_scalar, grad_vector)
    want = gradients(formed, exact, as64(grad_scalar), as64(grad_vector))
    magnitudes = gradients(formed, bound, as64(grad_scalar).abs(), as64(grad_vector).abs())
    for name, g, w, m in zip(["x", "basis", "vectors", "directions", "filter_weight"], got, want, magnitudes):
        try:
            assert_close_to(g, w, dtype, m)
        except AssertionError as error:
            raise AssertionError(f"gradient of {name}: {error}") from None
    # The weight a constant (forces): the backward op then returns the basis' gradient itself (on
    # CUDA, on tensor cores where it can), not the path above through the formed filter's.
    constant = weight.detach()
    got = gradients(lambda *a: mirage_formed(*a[:4], constant, a[4], order), (x, basis, vectors, directions, pairs),
                    grad_scalar, grad_vector)
    for name, g, w, m in zip(["x", "basis", "vectors", "directions"], got, want, magnitudes):
        try:
            assert_close_to(g, w, dtype, m)
        except AssertionError as error:
            raise AssertionError(f"gradient of {name} (a constant weight): {error}") from None


# (nodes, F, P, K): F % 4 == 0 and K <= 32 are formed inside the CUDA kernels, the others by a
# GEMM first; sizes past one tile of 128 features, runs not a multiple of 4 pairs, no pairs. The
# last three have the sizes whose basis' gradient the CUDA backward forms on tensor cores (one
# chunk of 16 features, K = 1 and 24, more chunks (12) than a column of lanes (8)), but under
# 8,192 pairs they take the former kernel and linear's product: test_cuda_formed_filter_large and
# test_formed_filter_runs_of_every_length take them on tensor cores.
FORMED_SHAPES = [(1, 1, 1, 1), (5, 7, 23, 3), (12, 128, 133, 21), (9, 8, 61, 32), (9, 8, 61, 33),
                 (30, 256, 1000, 21), (4, 4, 0, 5), (7, 16, 50, 1), (11, 48, 301, 24), (5, 192, 77, 9)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nodes,features,count,width", FORMED_SHAPES)
def test_formed_filter_matches_composite(device, dtype, nodes, features, count, width):
    assert_formed_matches(make_formed_inputs(nodes, features, count, width, dtype, device), dtype)


def basis_gradient_on_tensor_cores(features, width, count):
    """Whether the CUDA backward forms the basis' gradient on tensor cores (docs/ops.md): the
    fused filter, sender order, F % 16 == 0, K <= 24, 1152 F bytes of shared memory a block."""
    shared = torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin
    return (mirage.ops.fused_filter_supported(features, width, "cuda") and count >= SENDER_ORDER_MIN_PAIRS
            and features % 16 == 0 and width <= 24 and 1152 * features <= shared)


@pytest.mark.cuda
@pytest.mark.parametrize("order", ["sorted", "random"])
# The backward walks sender order from 8,192 pairs (there, on tensor cores, F % 16 == 0 and K <= 24:
# one chunk of 16 features, K = 1 and 24, more chunks (12) than a column of lanes (8) where shared
# memory allows; else the former kernel and linear's product, which from 131,072 rows is its narrow
# kernel).
@pytest.mark.parametrize("count,features,width", [(9000, 128, 21), (140_000, 128, 21), (9000, 16, 24),
                                                  (9000, 48, 1), (9000, 192, 9), (9000, 8, 5)])
def test_cuda_formed_filter_large(order, count, features, width):
    assert_formed_matches(make_formed_inputs(3000, features, count, width, torch.float32, "cuda", order),
                          torch.float32)


def runs_of_every_length(features, width, device):
    """make_formed_inputs' tensors over a list whose senders have runs of chosen lengths (in
    sender order): 1, under, at and over a tile of 16, several tiles, past a segment of 1,024
    places (walked by several warps), starting at many places of a window of 16; over 8,192 pairs
    (sender order on CUDA), in shuffled list order."""
    lengths = [1, 15, 16, 17, 32, 33, 100, 3, 300, 2, 47, 16, 31, 14, 64, 5, 2500]
    senders = []
    while len(senders) < SENDER_ORDER_MIN_PAIRS + 500:
        for n in lengths:
            senders += [senders[-1] + 1 if senders else 0] * n
    count, nodes = len(senders), senders[-1] + 1
    j = torch.tensor(senders)
    pairs = torch.stack([torch.randint(0, nodes, (count,)), j])[:, torch.randperm(count)].to(device)
    x, basis, vectors, directions, _, weight = make_formed_inputs(nodes, features, count, width, device=device)
    return x, basis, vectors, directions, pairs, weight


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("given_order", [False, True])
def test_formed_filter_runs_of_every_length(device, given_order):
    """On CUDA the backward with a constant weight forms the basis' gradient on tensor cores in
    tiles of 16 pairs from each run's start (docs/ops.md): runs of every length against the
    float64 reference, in the op's own sender order and in a handed-in scattered one (a valid
    permutation; its runs are mostly single pairs)."""
    inputs = runs_of_every_length(128, 21, device)
    if device == "cuda":
        assert basis_gradient_on_tensor_cores(128, 21, inputs[1].shape[0])
    count = inputs[1].shape[0]
    order = torch.randperm(count, dtype=torch.int32).to(device) if given_order else None
    assert_formed_matches(inputs, torch.float32, order)


def test_formed_filter_gradcheck_and_gradgradcheck():
    x, basis, vectors, directions, pairs, weight = make_formed_inputs(5, 3, 7, 4, torch.float64, order="random")
    leaves = [t.requires_grad_() for t in (x, basis, vectors, directions, weight)]

    def fn(x, basis, vectors, directions, weight):
        return mirage.ops.vector_message_passing(x, basis, vectors, directions, pairs, weight)

    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradgradcheck(fn, leaves)
    grads = [randn(5, 3, dtype=torch.float64).requires_grad_(), randn(5, 3, 3, dtype=torch.float64).requires_grad_()]
    assert torch.autograd.gradcheck(lambda *a: BACKWARD_OP(*a[:6], pairs, a[6]), [*grads, *leaves])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nodes,features,count,width", [(5, 4, 11, 3), (3, 8, 0, 2)])
def test_formed_filter_opcheck(device, nodes, features, count, width):
    x, basis, vectors, directions, pairs, weight = make_formed_inputs(nodes, features, count, width, device=device)
    floats = [t.requires_grad_() for t in (x, basis, vectors, directions, weight)]
    torch.library.opcheck(OP.default, (*floats[:4], pairs, floats[4]))
    grads = (randn(nodes, features, device=device), randn(nodes, 3, features, device=device))
    torch.library.opcheck(BACKWARD_OP.default, (*grads, *floats[:4], pairs, floats[4]))


@pytest.mark.parametrize("device", DEVICES)
def test_formed_filter_bad_input(device):
    x, basis, vectors, directions, pairs, weight = make_formed_inputs(4, 3, 5, 2, device=device)
    cases = [(weight[:8], r"filter_weight must be \[3F, K\] = \[9, K\] with K >= 1, got \[8, 2\]"),
             (weight[:, :0], r"filter_weight must be \[3F, K\] = \[9, K\] with K >= 1, got \[9, 0\]"),
             (weight[0], r"filter_weight must be \[3F, K\] = \[9, K\] with K >= 1, got \[2\]"),
             (weight.double(), r"filter_weight must have x's dtype \(Float\), got Double"),
             (weight[:, :1], r"filter \(the basis, with filter_weight\) must have shape \[P, K\] = \[5, 1\], "
                             r"got \[5, 2\]")]
    for bad, message in cases:
        with pytest.raises(RuntimeError, match="mirage::vector_message_passing: " + message):
            mirage.ops.vector_message_passing(x, basis, vectors, directions, pairs, bad)
    with pytest.raises(RuntimeError, match="mirage::vector_message_passing_backward: filter_weight must be"):
        BACKWARD_OP(randn(4, 3, device=device), randn(4, 3, 3, device=device), x, basis, vectors, directions,
                    pairs, weight[:8])


def test_fused_filter_supported_is_false_off_cuda():
    assert not mirage.ops.fused_filter_supported(128, 21, "cpu")
    if not torch.cuda.is_available():  # "cuda" is the current GPU: it raised "Found no NVIDIA driver"
        assert not mirage.ops.fused_filter_supported(128, 21, "cuda")
        assert not mirage.ops.cfconv_supported(20, 64, 64, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("features,width,count,fused", [(128, 21, 9000, True), (16, 24, 9000, True),
                                                        (128, 21, 900, True), (4, 32, 9000, True),
                                                        (128, 33, 900, False), (7, 21, 900, False)])
def test_cuda_formed_filter_kernel_choice(features, width, count, fused):
    """The kernels form the filter themselves where fused_filter_supported says so (no GEMM then);
    otherwise a GEMM forms it first. The backward then forms the basis' gradient on tensor cores
    where basis_gradient_on_tensor_cores says so (one kernel, no GEMM at all), else a product of
    the formed filter's gradient follows its kernel."""
    assert mirage.ops.fused_filter_supported(features, width, "cuda") == fused
    on_tensor_cores = basis_gradient_on_tensor_cores(features, width, count)
    inputs = make_formed_inputs(300, features, count, width, torch.float32, "cuda")
    x, basis, vectors, directions, pairs, weight = inputs
    leaves = [t.requires_grad_() for t in (x, basis, vectors, directions)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        scalar, vector = mirage.ops.vector_message_passing(x, basis, vectors, directions, pairs, weight)
        torch.autograd.grad((scalar.sum() + vector.sum()), leaves)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    forward = [n for n in names if "forward_kernel<float, 4, true" in n]
    backward = [n for n in names if "backward_kernel<float, 4, true" in n]
    basis_kernel = [n for n in names if "basis_backward_kernel" in n]
    gemms = [n for n in names if "gemm" in n.lower() or "xmma" in n or "nvjet" in n]
    if on_tensor_cores:
        assert len(forward) == len(basis_kernel) == 1 and not backward and not gemms, names
    elif fused:
        assert len(forward) == len(backward) == 1 and not basis_kernel, names
    else:
        assert not forward and not backward and not basis_kernel and gemms, names


@pytest.mark.cuda
@pytest.mark.parametrize("bad", [-1, 7, 2**40])
@pytest.mark.parametrize("row", [0, 1])  # a receiver, a sender
@pytest.mark.parametrize("count", [50, SENDER_ORDER_MIN_PAIRS])  # the former kernel, on tensor cores
def test_cuda_basis_gradient_out_of_range_pairs_give_nan(bad, row, count):
    """The backward that returns the basis' gradient flags an index out of range as the other
    kernels do: every output NaN, the next call unaffected."""
    x, basis, vectors, directions, pairs, weight = make_formed_inputs(7, 16, count, 5, torch.float32, "cuda")
    assert basis_gradient_on_tensor_cores(16, 5, count) == (count >= SENDER_ORDER_MIN_PAIRS)
    grad_scalar, grad_vector = randn(7, 16, device="cuda"), randn(7, 3, 16, device="cuda")
    good = pairs.clone()
    pairs[row, 31] = bad
    grads = BACKWARD_OP(grad_scalar, grad_vector, x, basis, vectors, directions, pairs, weight)
    torch.cuda.synchronize()
    assert grads[1].shape == basis.shape and all(torch.isnan(t).all() for t in grads)
    after = BACKWARD_OP(grad_scalar, grad_vector, x, basis, vectors, directions, good, weight)
    # Against the float64 CPU reference: a call that skipped pairs (say a stale count of windows
    # handed out) would still be finite. Float32 sums of about a thousand pairs per atom agree to
    # the tolerance of the gradient's scale, not of each (possibly cancelled) element.
    want = BACKWARD_OP(*[t.double().cpu() for t in (grad_scalar, grad_vector, x, basis, vectors, directions)],
                       good.cpu(), weight.double().cpu())
    for g, w in zip(after, want):
        torch.testing.assert_close(g.double().cpu(), w, rtol=1e-4, atol=1e-4 * max(w.abs().max().item(), 1.0))


@pytest.mark.cuda
def test_cuda_formed_filter_misaligned_rows_take_the_gemm():
    # x one element into its storage: the fused kernels need 16-byte rows; the GEMM path is exact too.
    inputs = list(make_formed_inputs(20, 8, 300, 5, torch.float32, "cuda"))
    flat = torch.empty(inputs[0].numel() + 1, device="cuda")
    shifted = flat[1:].view(inputs[0].shape)
    shifted.copy_(inputs[0])
    inputs[0] = shifted
    assert_formed_matches(inputs, torch.float32)


@pytest.mark.cuda
def test_cuda_formed_filter_graph_replay():
    nodes, features, count, width = 300, 128, 9000, 21
    static = list(make_formed_inputs(nodes, features, count, width, torch.float32, "cuda", "random"))
    leaves = [static[k].requires_grad_() for k in (0, 1, 2, 3)]
    grad_scalar, grad_vector = randn(nodes, features, device="cuda"), randn(nodes, 3, features, device="cuda")

    def step():
        scalar, vector = mirage.ops.vector_message_passing(*static)
        return (scalar.detach(), vector.detach(),
                *torch.autograd.grad((scalar, vector), leaves, (grad_scalar, grad_vector)))

    graph, captured = capture_graph(step)
    for _ in range(2):
        fresh = make_formed_inputs(nodes, features, count, width, torch.float32, "cuda", "random")
        with torch.no_grad():
            for target, value in zip(static, fresh):
                target.copy_(value)
        graph.replay()
        want = step()
        for got, w in zip(captured, want):
            torch.testing.assert_close(got, w, atol=1e-4, rtol=1e-4)


# ---- num_pairs: neighbor_list's padding skipped ------------------------------------------------

def messages_with_count(inputs, count, order=None, weight=None):
    """Outputs and gradients of the op over the pairs before `count` (None: every pair)."""
    *floats, pairs = inputs
    leaves = [t.detach().requires_grad_() for t in floats]
    num_pairs = None if count is None else torch.tensor([count], device=pairs.device)
    outputs = mirage.ops.vector_message_passing(*leaves, pairs, weight, sender_order=order, num_pairs=num_pairs)
    grad_outputs = [torch.linspace(-1, 1, t.numel(), device=t.device, dtype=t.dtype).view_as(t) for t in outputs]
    return [*(t.detach() for t in outputs), *torch.autograd.grad(outputs, leaves, grad_outputs)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count", [600, SENDER_ORDER_MIN_PAIRS + 500])  # list order; sender order on CUDA
@pytest.mark.parametrize("formed_filter", [False, True])
def test_num_pairs_skips_the_padding(device, count, formed_filter):
    """With num_pairs the pairs from it on are skipped: the outputs and node gradients those of
    the list cut there, the skipped pairs' filter and direction gradients 0; a negative count or
    one past P walks every pair."""
    nodes, features, padding = 300, 8, 137
    total = count + padding
    if formed_filter:  # F = 16: on CUDA the basis' gradient on tensor cores
        *inputs, weight = make_formed_inputs(nodes, 2 * features, total, 16, device=device)
    else:
        inputs, weight = list(make_inputs(nodes, features, total, device=device, order="sorted")), None
    order = mirage.ops.sender_order(inputs[4], nodes, torch.tensor([count], device=device))
    got = messages_with_count(inputs, count, order, weight)
    cut = [inputs[0], inputs[1][:count], inputs[2], inputs[3][:count], inputs[4][:, :count]]
    want = messages_with_count(cut, None, None, weight)
    close = {} if device == "cpu" else dict(rtol=1e-4, atol=1e-4)  # float atomics' order on CUDA
    per_pair = (3, 5)  # the gradients of filter (or basis) and directions
    for k, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g[:count] if k in per_pair else g, w, **close, msg=f"output {k}")
        if k in per_pair:
            assert torch.equal(g[count:], torch.zeros_like(g[count:])), f"output {k}"
    full = messages_with_count(inputs, None, None, weight)
    for every_pair in (-1, total + 3):
        for k, (g, w) in enumerate(zip(messages_with_count(inputs, every_pair, None, weight), full)):
            torch.testing.assert_close(g, w, **close, msg=f"output {k} with num_pairs={every_pair}")


def test_num_pairs_gradcheck_and_gradgradcheck():
    # The double backward (force training) zeroes the padding's per-pair inputs on the device.
    x, filter, vectors, directions, _ = make_inputs(5, 2, 9, torch.float64)
    pairs = torch.tensor([[1, 0, 3, 1, 1, 2, 0, 4, 4], [0, 3, 3, 2, 2, 1, 1, 0, 2]])
    num_pairs = torch.tensor([6])
    leaves = [t.requires_grad_() for t in (x, filter, vectors, directions)]

    def fn(*args):
        return mirage.ops.vector_message_passing(*args, pairs, num_pairs=num_pairs)

    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradgradcheck(fn, leaves)


def test_num_pairs_padding_of_any_content_adds_nothing_to_second_order():
    # Padding with NaN directions and filters and an index out of range: skipped in every order,
    # the double backward's gradients those of the list cut at the count.
    x, filter, vectors, directions, pairs = make_inputs(6, 3, 14, torch.float64, order="sorted")
    count = 10
    filter[count:] = float("nan")
    directions[count + 1] = float("nan")
    pairs[1, count + 2] = 99

    def second_order(filter, directions, pairs, num_pairs):
        leaves = [t.detach().clone().requires_grad_() for t in (x, filter, vectors, directions)]
        outputs = mirage.ops.vector_message_passing(*leaves, pairs, num_pairs=num_pairs)
        grads = torch.autograd.grad([o.square().sum() for o in outputs], leaves, create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads), leaves)

    got = second_order(filter, directions, pairs, torch.tensor([count]))
    want = second_order(filter[:count], directions[:count], pairs[:, :count], None)
    for k in (0, 2):  # x and vectors
        torch.testing.assert_close(got[k], want[k])
    for k in (1, 3):  # the per-pair inputs: the cut list's, then zeros
        torch.testing.assert_close(got[k][:count], want[k])
        assert torch.equal(got[k][count:], torch.zeros_like(got[k][count:]))


def test_num_pairs_padding_basis_of_any_content_adds_nothing_to_the_weight_gradient():
    # With filter_weight, NaN in the padding's basis rows made the weight's whole gradient NaN (0 *
    # NaN in its product with the filter's gradient), in the first order and the second.
    x, _, vectors, directions, pairs = make_inputs(6, 3, 14, torch.float64, order="sorted")
    count = 10
    basis, weight = randn(14, 4, dtype=torch.float64), randn(9, 4, dtype=torch.float64)
    basis[count:] = float("nan")

    def gradients(basis, directions, pairs, num_pairs, create_graph):
        leaves = [t.detach().clone().requires_grad_() for t in (x, basis, vectors, directions, weight)]
        outputs = mirage.ops.vector_message_passing(*leaves[:4], pairs, leaves[4], num_pairs=num_pairs)
        first = torch.autograd.grad([o.square().sum() for o in outputs], leaves, create_graph=create_graph)
        return torch.autograd.grad(sum(g.square().sum() for g in first), leaves) if create_graph else first

    for create_graph in (False, True):
        got = gradients(basis, directions, pairs, torch.tensor([count]), create_graph)
        want = gradients(basis[:count], directions[:count], pairs[:, :count], None, create_graph)
        for k in (0, 2, 4):  # x, vectors and the weight
            torch.testing.assert_close(got[k], want[k])
        for k in (1, 3):  # the per-pair inputs: the cut list's, then zeros
            torch.testing.assert_close(got[k][:count], want[k])
            assert torch.equal(got[k][count:], torch.zeros_like(got[k][count:]))


@pytest.mark.parametrize("device", DEVICES)
def test_num_pairs_opcheck_and_bad_counts(device):
    inputs = make_inputs(6, 4, 20, device=device, order="sorted")
    if device == "cpu":  # CUDA's float atomics add in any order: runs need not agree to the bit
        opcheck(OP.default, (*inputs, None, None, torch.tensor([13])))
    assert_error(lambda d: OP(*inputs, None, None, torch.tensor([3, 4], device=d)), device,
                 NAME + "num_pairs must be one int64 (neighbor_list's count), got Long of shape [2]")
