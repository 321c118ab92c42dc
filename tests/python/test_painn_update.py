"""mirage::painn_update_input and mirage::painn_update (and their backward ops) against PaiNN's
update block written in PyTorch (PaiNNUpdate of examples/forcefield/models.py)."""

import pytest
import torch

import mirage
from common import DEVICES, DTYPES, OpCounter, assert_close_to, assert_error, capture_graph, opcheck, randn, strided
from tolerances import tolerance

# Larger than PaiNN's 1e-8, so that a kernel which dropped it would fail.
EPS = 0.25


def input_composite(s, vv, eps=EPS):
    return (torch.cat([s, torch.sqrt(vv.square().sum(dim=1) + eps)], dim=-1),)


def update_composite(s, v, uv, vv, a):
    a_vv, a_sv, a_ss = a.chunk(3, dim=-1)
    return s + a_ss + a_sv * (uv * vv).sum(dim=1), v + a_vv.unsqueeze(1) * uv


def mirage_input(s, vv, eps=EPS):
    return (mirage.ops.painn_update_input(s, vv, eps),)


# name -> (mirage's op as a function returning a tuple, the composite, the inputs' shapes in (N, F))
OPS = {
    "painn_update_input": (mirage_input, input_composite, lambda n, f: [(n, f), (n, 3, f)]),
    "painn_update": (mirage.ops.painn_update, update_composite,
                     lambda n, f: [(n, f), (n, 3, f), (n, 3, f), (n, 3, f), (n, 3 * f)]),
}
BACKWARD_OPS = {"painn_update_input": torch.ops.mirage.painn_update_input_backward,
                "painn_update": torch.ops.mirage.painn_update_backward}


def make_inputs(name, nodes, features, dtype=torch.float32, device="cpu"):
    return [randn(*shape, dtype=dtype, device=device) for shape in OPS[name][2](nodes, features)]


def gradients(fn, inputs, grad_outputs):
    leaves = [t.detach().requires_grad_() for t in inputs]
    return torch.autograd.grad(fn(*leaves), leaves, grad_outputs)


def as_double(tensors):
    return [t.detach().double().cpu() for t in tensors]


def assert_matches_composite(name, inputs, dtype):
    """Outputs and gradients against the composite in float64 from the same rounded values; the
    composite over absolute values bounds each result's terms (float32 sums of cancelling terms)."""
    fn, composite, _ = OPS[name]
    got = fn(*inputs)
    want = composite(*as_double(inputs))
    magnitude = composite(*[t.abs() for t in as_double(inputs)])
    for g, w, m in zip(got, want, magnitude):
        assert_close_to(g, w, dtype, m)
    grad_outputs = [randn(*w.shape, dtype=dtype, device=inputs[0].device) for w in want]
    got = gradients(fn, inputs, grad_outputs)
    want = gradients(composite, as_double(inputs), as_double(grad_outputs))
    magnitude = gradients(composite, [t.abs() for t in as_double(inputs)], [g.abs() for g in as_double(grad_outputs)])
    for k, (g, w, m) in enumerate(zip(got, want, magnitude)):
        try:
            assert_close_to(g, w, dtype, m)
        except AssertionError as error:
            raise AssertionError(f"gradient of input {k}: {error}") from None


# ---- against the composite -------------------------------------------------------------------

SHAPES = [(1, 1), (3, 7), (12, 128), (5, 129), (4, 0), (0, 3)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nodes,features", SHAPES)
@pytest.mark.parametrize("name", OPS)
def test_matches_composite(device, dtype, nodes, features, name):
    assert_matches_composite(name, make_inputs(name, nodes, features, dtype, device), dtype)


@pytest.mark.parametrize("name", OPS)
def test_float64_on_cpu(name):
    inputs = make_inputs(name, 6, 5, torch.float64)
    for got, want in zip(OPS[name][0](*inputs), OPS[name][1](*inputs)):
        torch.testing.assert_close(got, want, **tolerance(torch.float64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_strided_inputs(device, name):
    inputs = make_inputs(name, 7, 9, torch.float32, device)
    fn = OPS[name][0]
    for got, want in zip(fn(*[strided(t) for t in inputs]), fn(*inputs)):
        assert got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_vanishing_vectors_keep_a_finite_gradient(device):
    # PaiNN's first update sees V v = 0 (every v starts at zero): the norm is sqrt(eps) and its
    # gradient 0, where sqrt(sum of squares) alone would divide 0 by 0.
    s = randn(4, 6, device=device)
    vv = torch.zeros(4, 3, 6, device=device, requires_grad=True)
    out = mirage.ops.painn_update_input(s, vv, 1e-8)
    torch.testing.assert_close(out[:, 6:], torch.full((4, 6), 1e-4, device=device))
    (grad,) = torch.autograd.grad(out.sum(), vv)
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_nan_stays_in_its_atom(device, name):
    inputs = make_inputs(name, 5, 4, torch.float32, device)
    inputs[1 if name == "painn_update_input" else 2][2, 1, 3] = float("nan")  # atom 2's vv or uv
    for out in OPS[name][0](*inputs):
        assert torch.isnan(out[2]).any()
        assert torch.isfinite(out[[0, 1, 3, 4]]).all()


# ---- autograd, opcheck, compile, autocast -----------------------------------------------------

@pytest.mark.parametrize("name", OPS)
def test_gradcheck_and_gradgradcheck(name):
    leaves = [t.requires_grad_() for t in make_inputs(name, 3, 4, torch.float64)]
    assert torch.autograd.gradcheck(OPS[name][0], leaves)
    assert torch.autograd.gradgradcheck(OPS[name][0], leaves)


def test_backward_ops_gradcheck():
    # The fused backward ops are differentiable in all their floating inputs (incoming gradients
    # included): double backward for force training.
    grad, vv = randn(3, 8, dtype=torch.float64), randn(3, 3, 4, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (grad, vv)]
    assert torch.autograd.gradcheck(lambda *a: BACKWARD_OPS["painn_update_input"](*a, EPS), leaves)
    s, v, uv, vv, a = make_inputs("painn_update", 3, 4, torch.float64)
    leaves = [t.requires_grad_() for t in (s, v, uv, vv, a)]  # s, v stand in for grad_s, grad_v
    assert torch.autograd.gradcheck(BACKWARD_OPS["painn_update"], leaves)


def test_only_one_output_used():
    # PaiNN's last update: v_out feeds nothing, autograd hands an undefined gradient (zeros here).
    inputs = make_inputs("painn_update", 5, 4, torch.float64)
    leaves = [t.requires_grad_() for t in inputs]
    got = torch.autograd.grad(mirage.ops.painn_update(*leaves)[0].sum(), leaves)
    want = torch.autograd.grad(update_composite(*leaves)[0].sum(), leaves, allow_unused=True)
    assert want[1] is None  # s_out does not read v
    for g, w, leaf in zip(got, want, leaves):
        torch.testing.assert_close(g, torch.zeros_like(leaf) if w is None else w)


@pytest.mark.parametrize("name", OPS)
def test_backward_uses_the_fused_op(name):
    leaves = [t.requires_grad_() for t in make_inputs(name, 5, 4)]
    outputs = OPS[name][0](*leaves)
    with OpCounter() as counter:
        torch.autograd.grad(sum(o.sum() for o in outputs), leaves)
    assert f"mirage.{name}_backward" in counter.calls
    assert not {"aten.mul", "aten.div", "aten.sqrt"} & set(counter.calls)  # no composite recompute


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nodes,features", [(5, 3), (0, 4), (2, 1)])
def test_opcheck(device, nodes, features):
    s, vv = make_inputs("painn_update_input", nodes, features, torch.float32, device)
    opcheck(torch.ops.mirage.painn_update_input.default, (s, vv, EPS))
    opcheck(torch.ops.mirage.painn_update_input_backward.default,
            (randn(nodes, 2 * features, device=device), vv, EPS))
    inputs = make_inputs("painn_update", nodes, features, torch.float32, device)
    opcheck(torch.ops.mirage.painn_update.default, tuple(inputs))
    opcheck(torch.ops.mirage.painn_update_backward.default, tuple(inputs))  # s, v as the gradients


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()

    def step(s, v, uv, vv, a):
        s_out, v_out = mirage.ops.painn_update(s, v, uv, vv, a)
        return mirage.ops.painn_update_input(s_out, v_out, EPS) * 2

    compiled = torch.compile(step, fullgraph=True)
    for nodes in [6, 6, 11]:
        inputs = make_inputs("painn_update", nodes, 8, torch.float32, device)
        torch.testing.assert_close(compiled(*inputs), step(*inputs))


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_runs_in_the_widest_input_dtype(device):
    # Under autocast PaiNN's s and v stay float32 while the Linears give bfloat16 uv, vv and a:
    # the ops promote as PyTorch's elementwise ops would, so nothing is rounded to bfloat16.
    s, v, uv, vv, a = make_inputs("painn_update", 6, 5, torch.float32, device)
    uv, vv, a = uv.bfloat16(), vv.bfloat16(), a.bfloat16()
    with torch.autocast(device, dtype=torch.bfloat16):
        s_out, v_out = mirage.ops.painn_update(s, v, uv, vv, a)
        inputs = mirage.ops.painn_update_input(s, vv, EPS)
    assert s_out.dtype == v_out.dtype == inputs.dtype == torch.float32
    want = update_composite(*as_double([s, v, uv, vv, a]))
    torch.testing.assert_close(s_out.double().cpu(), want[0], **tolerance(torch.float32))
    torch.testing.assert_close(v_out.double().cpu(), want[1], **tolerance(torch.float32))
    torch.testing.assert_close(inputs.double().cpu(), input_composite(*as_double([s, vv]))[0],
                               **tolerance(torch.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_low_precision_gradients_flow(device, name):
    leaves = [t.requires_grad_() for t in make_inputs(name, 5, 4, torch.float16, device)]
    sum(o.sum() for o in OPS[name][0](*leaves)).backward()
    assert all(t.grad.dtype == torch.float16 and torch.isfinite(t.grad).all() for t in leaves)


# ---- bad input --------------------------------------------------------------------------------

def _call(name, device, edit=None, eps=EPS, backward=False):
    inputs = make_inputs(name, 4, 3, torch.float32, device)
    if backward:  # the incoming gradients take the place of the inputs that need none
        inputs[0] = randn(4, 6 if name == "painn_update_input" else 3, device=device)
    if edit is not None:
        index, fn = edit
        inputs[index] = fn(inputs[index])
    op = (BACKWARD_OPS if backward else {k: getattr(torch.ops.mirage, k) for k in OPS})[name]
    return op(*inputs, eps) if name == "painn_update_input" else op(*inputs)


BAD_INPUTS = [
    ("painn_update_input", (0, lambda t: t.int()), "mirage::painn_update_input: s must be float32, float16 or bfloat16"),
    ("painn_update_input", (0, lambda t: t[0]), "mirage::painn_update_input: s must be [N, F], got [3]"),
    ("painn_update_input", (1, lambda t: t[:, :2]), "mirage::painn_update_input: vv must have shape [N, 3, F] = [4, 3, 3], got [4, 2, 3]"),
    ("painn_update_input", (1, lambda t: t.half()), "mirage::painn_update_input: vv must have s's dtype (Float), got Half"),
    ("painn_update", (1, lambda t: t[:3]), "mirage::painn_update: v must have shape [N, 3, F] = [4, 3, 3], got [3, 3, 3]"),
    ("painn_update", (2, lambda t: t.double()), "mirage::painn_update: uv must have s's dtype (Float), got Double"),
    ("painn_update", (3, lambda t: t[..., :2]), "mirage::painn_update: vv must have shape [N, 3, F] = [4, 3, 3], got [4, 3, 2]"),
    ("painn_update", (4, lambda t: t[:, :6]), "mirage::painn_update: a must have shape [N, 3F] = [4, 9], got [4, 6]"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,edit,message", BAD_INPUTS)
def test_bad_input(device, name, edit, message):
    assert_error(lambda d: _call(name, d, edit), device, message)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eps, shown", [(-1e-3, "-0.001"), (-1e-8, "-1e-08"), (float("nan"), "nan"),
                                        (float("inf"), "inf"), (1e-300, "1e-300"), (1e39, "1e+39")])
def test_bad_eps(device, eps, shown):
    # The value as given (six fixed decimals once wrote -1e-8 as "-0.000000" and 1e-300 as 0).
    for backward in (False, True):
        op = "painn_update_input_backward" if backward else "painn_update_input"
        assert_error(lambda d: _call("painn_update_input", d, eps=eps, backward=backward), device,
                     f"mirage::{op}: eps must be 0 or a normal float32 in [1.2e-38, 3.4e+38] (finite, >= 0), "
                     f"got {shown}")


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_backward(device):
    assert_error(lambda d: _call("painn_update_input", d, (0, lambda t: t[:, :5]), backward=True), device,
                 "mirage::painn_update_input_backward: grad must be [N, 2F], got [4, 5]")
    assert_error(lambda d: _call("painn_update", d, (1, lambda t: t[:, :1]), backward=True), device,
                 "mirage::painn_update_backward: grad_v must have shape [N, 3, F] = [4, 3, 3], got [4, 1, 3]")
    assert_error(lambda d: _call("painn_update", d, (4, lambda t: t.half()), backward=True), device,
                 "mirage::painn_update_backward: a must have grad_s's dtype (Float), got Half")


@pytest.mark.cuda
def test_wrong_device_and_float64_on_cuda():
    for index, arg in enumerate(["s", "v", "uv", "vv", "a"][1:], start=1):
        assert_error(lambda d: _call("painn_update", d, (index, lambda t: t.cpu())), "cuda",
                     f"mirage::painn_update: {arg} must be on s's device (cuda:0), got cpu")
    assert_error(lambda d: _call("painn_update_input", d, (1, lambda t: t.cpu())), "cuda",
                 "mirage::painn_update_input: vv must be on s's device (cuda:0), got cpu")
    assert_error(lambda d: _call("painn_update", d, (1, lambda t: t.cpu()), backward=True), "cuda",
                 "mirage::painn_update_backward: grad_v must be on grad_s's device (cuda:0), got cpu")
    assert_error(lambda d: _call("painn_update_input", d, (0, lambda t: t.double())), "cuda",
                 "mirage::painn_update_input: s must be float32, float16 or bfloat16 (float64 off the GPU)")


# ---- CUDA ----------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nodes,features", [(3000, 128), (100_000, 64)])
@pytest.mark.parametrize("name", OPS)
def test_cuda_large(dtype, nodes, features, name):
    assert_matches_composite(name, make_inputs(name, nodes, features, dtype, "cuda"), dtype)


@pytest.mark.cuda
def test_cuda_agrees_with_cpu_reference():
    for name in OPS:
        inputs = make_inputs(name, 9, 33)
        for got, want in zip(OPS[name][0](*[t.cuda() for t in inputs]), OPS[name][0](*inputs)):
            torch.testing.assert_close(got.cpu(), want, **tolerance(torch.float32))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_capture_and_replay_with_new_inputs(dtype):
    # The update as a force field captures it: forward and gradients, replayed on new values.
    nodes, features = 12, 128
    static = [t.requires_grad_() for t in make_inputs("painn_update", nodes, features, dtype, "cuda")]
    grad_s = randn(nodes, features, dtype=dtype, device="cuda")

    def step():
        inputs = mirage.ops.painn_update_input(static[0], static[3], EPS)
        s_out, v_out = mirage.ops.painn_update(*static)
        grads = torch.autograd.grad((s_out, inputs), static, (grad_s, inputs.detach()))
        return (s_out.detach(), v_out.detach(), *grads)

    graph, captured = capture_graph(step)
    for _ in range(3):
        with torch.no_grad():
            for t in static:
                t.copy_(randn(*t.shape, dtype=dtype, device="cuda"))
        grad_s.copy_(randn(nodes, features, dtype=dtype, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, step()):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
