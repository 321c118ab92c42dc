import math

import pytest
import torch
import torch.autograd.forward_ad as forward_ad

import mirage
from common import (CUTOFF_RULE, DEVICES, DTYPES, OpCounter, assert_error, assert_matches, capture_graph, opcheck,
                    strided)
from tolerances import tolerance

KINDS = ["gaussian", "bessel", "none"]
CUTOFF_FNS = ["cosine", "polynomial", "none"]
CUTOFF = 5.0
BACKWARD_OP = torch.ops.mirage.radial_basis_backward


def sinc(x):
    """sin(x) / x, as its Taylor series below |x| = 0.1 (as the kernels do): the same values in
    float64, and derivatives that stay finite at x = 0."""
    small = x.abs() < 0.1
    safe = torch.where(small, torch.ones_like(x), x)
    x2 = x * x
    series = 1 - x2 / 6 * (1 - x2 / 20 * (1 - x2 / 42 * (1 - x2 / 72)))
    return torch.where(small, series, torch.sin(safe) / safe)


def composite(d, kind, num, cutoff, cutoff_fn):
    """The formulas of docs/ops.md in plain torch (float64 in the tests)."""
    d = d.unsqueeze(-1)
    if kind == "gaussian":
        delta = cutoff / (num - 1) if num > 1 else cutoff
        mu = torch.arange(num, dtype=d.dtype, device=d.device) * delta
        basis = torch.exp(-((d - mu) ** 2) / (2 * delta**2))
    elif kind == "none":  # cos(0 d): 1, and NaN in value and slope at NaN and infinite d
        basis = torch.cos(0 * d).expand(*d.shape[:-1], num)
    else:
        frequency = torch.arange(1, num + 1, dtype=d.dtype, device=d.device) * math.pi / cutoff
        basis = math.sqrt(2 / cutoff) * frequency * sinc(frequency * d)  # sin(n pi d / c) / d
    x = d / cutoff
    if cutoff_fn == "cosine":
        basis = basis * torch.where(d < cutoff, 0.5 * (torch.cos(math.pi * x) + 1), 0.0)
    elif cutoff_fn == "polynomial":
        basis = basis * torch.where(d < cutoff, 1 - 28 * x**6 + 48 * x**7 - 21 * x**8, 0.0)
    return basis


def distances(*shape, dtype=torch.float32, device="cpu"):
    """Uniform over [0, 1.2 cutoff): inside and beyond the cutoff, with 0 and the cutoff itself
    where there are more than two (one element alone at 0 would test only where the slopes vanish)."""
    d = torch.rand(*shape, dtype=torch.float64) * 1.2 * CUTOFF
    flat = d.view(-1)
    if flat.numel() > 2:
        flat[0], flat[-1] = 0.0, CUTOFF
    return d.to(dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (769,), (3, 5)])
@pytest.mark.parametrize("num", [1, 3, 20])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cutoff_fn", CUTOFF_FNS)
def test_matches_composite(device, dtype, shape, num, kind, cutoff_fn):
    d = distances(*shape, dtype=dtype, device=device)
    y = mirage.ops.radial_basis(d, kind, num, CUTOFF, cutoff_fn)
    assert y.shape == (*shape, num)
    assert_matches(y, composite, (d, kind, num, CUTOFF, cutoff_fn), dtype)
    opcheck(torch.ops.mirage.radial_basis.default, (d, kind, num, CUTOFF, cutoff_fn))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cutoff_fn", CUTOFF_FNS)
def test_float64_and_strided_on_cpu(kind, cutoff_fn):
    d = strided(distances(6, 9, dtype=torch.float64))
    assert_matches(mirage.ops.radial_basis(d, kind, 8, CUTOFF, cutoff_fn), composite,
                   (d, kind, 8, CUTOFF, cutoff_fn), torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_zero_at_and_beyond_the_cutoff_and_bessel_limit_at_zero(device, kind):
    d = torch.tensor([0.0, CUTOFF, CUTOFF * 1.5], device=device)
    for cutoff_fn in ["cosine", "polynomial"]:
        y = mirage.ops.radial_basis(d, kind, 6, CUTOFF, cutoff_fn)
        assert torch.isfinite(y).all()
        assert (y[1:] == 0).all()  # neighbor_list's padding (distance == cutoff) weighs nothing
    y = mirage.ops.radial_basis(d[:1], "bessel", 6, CUTOFF, "none")
    limit = math.sqrt(2 / CUTOFF) * torch.arange(1, 7, dtype=torch.float64) * math.pi / CUTOFF
    torch.testing.assert_close(y[0].double().cpu(), limit, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_nan(device):
    assert mirage.ops.radial_basis(torch.empty(0, device=device), "bessel", 4, CUTOFF, "cosine").shape == (0, 4)
    d = distances(5, device=device)
    d[2] = float("nan")
    for kind in KINDS:
        for cutoff_fn in CUTOFF_FNS:
            y = mirage.ops.radial_basis(d, kind, 4, CUTOFF, cutoff_fn)
            assert torch.isnan(y[2]).all(), (kind, cutoff_fn)  # NaN propagates through the envelope
            assert torch.isfinite(y[[0, 1, 3, 4]]).all()


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda d: mirage.ops.radial_basis(torch.rand(4, device=d), "sine", 4, 5.0, "cosine"),
         "mirage::radial_basis: kind must be \"gaussian\", \"bessel\" or \"none\", got \"sine\""),
        (lambda d: mirage.ops.radial_basis(torch.rand(4, device=d), "bessel", 0, 5.0, "cosine"),
         "mirage::radial_basis: num must be positive, got 0"),
        (lambda d: mirage.ops.radial_basis(torch.rand(4, device=d), "bessel", 4, -1.0, "cosine"),
         f"mirage::radial_basis: {CUTOFF_RULE}, got -1"),
        (lambda d: mirage.ops.radial_basis(torch.rand(4, device=d), "bessel", 4, float("inf"), "cosine"),
         f"mirage::radial_basis: {CUTOFF_RULE}, got inf"),
        # Finite, but past what the kernels' float32 holds (radial_cfconv's tables were NaN there).
        (lambda d: mirage.ops.radial_basis(torch.rand(4, device=d), "bessel", 4, 1e200, "cosine"),
         f"mirage::radial_basis: {CUTOFF_RULE}, got 1e+200"),
        (lambda d: mirage.ops.radial_basis(torch.rand(4, device=d), "bessel", 4, 1e-200, "cosine"),
         f"mirage::radial_basis: {CUTOFF_RULE}, got 1e-200"),
        (lambda d: mirage.ops.radial_basis(torch.rand(4, device=d), "bessel", 4, 5.0, "smooth"),
         "mirage::radial_basis: cutoff_fn must be \"cosine\", \"polynomial\" or \"none\", got \"smooth\""),
        (lambda d: mirage.ops.radial_basis(torch.ones(4, dtype=torch.int64, device=d), "bessel", 4, 5.0, "none"),
         "mirage::radial_basis: distances must be float32, float16 or bfloat16"),
        # Past what a tensor can hold: the allocator's message named neither op nor argument.
        (lambda d: mirage.ops.radial_basis(torch.rand(5, device=d), "gaussian", 2**62, 5.0, "cosine"),
         "mirage::radial_basis: cannot allocate the outputs for num = 4611686018427387904"),
    ],
)
@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_bad_input(call, message, device):
    assert_error(call, device, message)


@pytest.mark.cuda
def test_cuda_rejects_float64():
    with pytest.raises(RuntimeError, match="mirage::radial_basis: distances must be float32, float16 or bfloat16"):
        mirage.ops.radial_basis(torch.rand(4, device="cuda", dtype=torch.float64), "bessel", 4, 5.0, "none")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("kind,num,cutoff_fn", [("gaussian", 5, "cosine"), ("bessel", 3, "polynomial"),
                                                ("bessel", 1, "none"), ("none", 1, "cosine")])
def test_opcheck(device, requires_grad, kind, num, cutoff_fn):
    d = distances(2, 7, device=device).requires_grad_(requires_grad)
    torch.library.opcheck(torch.ops.mirage.radial_basis.default, (d, kind, num, CUTOFF, cutoff_fn))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cutoff_fn", CUTOFF_FNS)
def test_gradcheck(kind, cutoff_fn):
    # Away from the cutoff (the cosine envelope's second derivative jumps there), 0 included:
    # the Bessel basis' derivatives of every order stay finite at d = 0.
    d = torch.cat([torch.zeros(1, dtype=torch.float64), torch.tensor([1e-3, 0.3]),
                   torch.rand(9, dtype=torch.float64) * 0.9 * CUTOFF, torch.tensor([1.1 * CUTOFF])])
    d = d.double().requires_grad_()
    fn = lambda d: mirage.ops.radial_basis(d, kind, 6, CUTOFF, cutoff_fn)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (d,))
    assert torch.autograd.gradgradcheck(fn, (d,))


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_is_zero_at_the_cutoff(device):
    d = torch.full((3,), CUTOFF, device=device, requires_grad=True)
    for cutoff_fn in ["cosine", "polynomial"]:
        (grad,) = torch.autograd.grad(mirage.ops.radial_basis(d, "bessel", 4, CUTOFF, cutoff_fn).sum(), d)
        assert (grad == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_low_precision_gradients_flow(device):
    d = distances(6, dtype=torch.bfloat16, device=device).requires_grad_()
    mirage.ops.radial_basis(d, "gaussian", 4, CUTOFF, "cosine").sum().backward()
    assert d.grad.dtype == torch.bfloat16 and torch.isfinite(d.grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_runs_in_float32(device):
    d = distances(10, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = mirage.ops.radial_basis(d.bfloat16(), "bessel", 4, CUTOFF, "cosine")
    assert y.dtype == torch.float32
    assert_matches(y, composite, (d.bfloat16().float(), "bessel", 4, CUTOFF, "cosine"), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()

    def expand(d):
        return mirage.ops.radial_basis(d, "bessel", 8, CUTOFF, "polynomial").sum(-1)

    compiled = torch.compile(expand, fullgraph=True)
    for _ in range(2):
        d = distances(33, device=device)
        got = compiled(d)
        torch.testing.assert_close(got, expand(d))
        assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_large(dtype):
    d = distances(130_000, dtype=dtype, device="cuda")
    for kind in KINDS:
        assert_matches(mirage.ops.radial_basis(d, kind, 20, CUTOFF, "cosine"), composite,
                       (d, kind, 20, CUTOFF, "cosine"), dtype)


@pytest.mark.cuda
def test_cuda_agrees_with_cpu_reference():
    d = distances(500)
    for kind in KINDS:
        for cutoff_fn in CUTOFF_FNS:
            cpu = mirage.ops.radial_basis(d, kind, 16, CUTOFF, cutoff_fn)
            gpu = mirage.ops.radial_basis(d.cuda(), kind, 16, CUTOFF, cutoff_fn)
            torch.testing.assert_close(gpu.cpu(), cpu, atol=2e-5, rtol=2e-5)


# mirage::radial_basis_backward: grad_distances[p] = sum_k grad[p, k] * d/dd (basis_k f)(d_p).


def backward_terms(grad, d, kind, num, cutoff, cutoff_fn):
    """grad[..., k] * d/dd out[..., k], by forward-mode autodiff of the float64 composite (out[..., k]
    depends on its own distance only, so a tangent of ones gives every k's derivative at once)."""
    d = d.detach().double()
    with forward_ad.dual_level():
        out = composite(forward_ad.make_dual(d, torch.ones_like(d)), kind, num, cutoff, cutoff_fn)
        derivative = forward_ad.unpack_dual(out).tangent
    return grad.double() * derivative


def assert_backward_matches(got, grad, d, kind, num, cutoff_fn, dtype):
    """got == the composite's gradient within the dtype's tolerance relative to the result (the
    output's one rounding), plus what the kernels' arithmetic may add, in float32 for float16 and
    bfloat16 inputs (CUDA's; the CPU's is float64) and in the dtype itself otherwise: for the
    sum's rounding, the arithmetic's tolerance times the sum of the terms' magnitudes; for each
    term, the rounding of its function's argument (the distance against the k-th center or
    frequency: a unit in the last place of the cutoff) times the slope of the term's derivative
    there, a worst case. Narrow functions make that slope large: 150 Gaussians over 5 Å are 0.034
    Å wide, and at d = 5 Å the kernel's float32 sum was off by 2.8e-4 where an atol of 2e-5 and
    the rtol bound allowed 1.5e-4 (H200, 2026-11-29; this term allows 2e-3 there). (Both terms in
    the half dtypes' own precision let a gradient missing a whole basis function pass: a review,
    2026-11-30.)"""
    d, grad = d.detach().cpu(), grad.detach().cpu()
    terms = backward_terms(grad, d, kind, num, CUTOFF, cutoff_fn)
    want = terms.sum(-1)
    assert got.dtype == dtype and got.shape == d.shape
    tol = tolerance(dtype)
    got = got.double().cpu()
    assert torch.equal(got.isnan(), want.isnan())
    error = (got - want).abs().nan_to_num(0.0)
    h = 1e-5  # the derivative's slope by a central difference of the float64 composite
    curvature = (backward_terms(grad, d.double() + h, kind, num, CUTOFF, cutoff_fn)
                 - backward_terms(grad, d.double() - h, kind, num, CUTOFF, cutoff_fn)) / (2 * h)
    arithmetic = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    # One unit in the last place of the largest argument (the distance or the farthest center).
    argument = torch.finfo(arithmetic).eps * max(CUTOFF, float(d.abs().max()) if d.numel() else 0.0)
    bound = (tol["atol"] + tol["rtol"] * want.abs() + tolerance(arithmetic)["rtol"] * terms.abs().sum(-1)
             + argument * curvature.abs().sum(-1)).nan_to_num(0.0)
    assert (error <= bound).all(), (error - bound).max().item()


def random_grad(d, num):
    return (torch.randn(*d.shape, num, dtype=torch.float64) * 1.7 + 0.3).to(d.dtype).to(d.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (769,), (3, 5)])
@pytest.mark.parametrize("num", [1, 3, 20, 37])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cutoff_fn", CUTOFF_FNS)
def test_backward_matches_composite(device, dtype, shape, num, kind, cutoff_fn):
    d = distances(*shape, dtype=dtype, device=device)  # 0, the cutoff and beyond it included
    grad = random_grad(d, num)
    got = BACKWARD_OP(grad, d, kind, num, CUTOFF, cutoff_fn)
    assert_backward_matches(got, grad, d, kind, num, cutoff_fn, dtype)
    opcheck(BACKWARD_OP.default, (grad, d, kind, num, CUTOFF, cutoff_fn))


@pytest.mark.cuda
@pytest.mark.parametrize("num", [32, 33, 64, 100, 150])  # the CUDA kernel's lane groups: 4, 8, 8, 16, 32 lanes
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cutoff_fn", CUTOFF_FNS)
def test_backward_of_wide_bases_on_cuda(num, kind, cutoff_fn):
    d = distances(769, dtype=torch.float32, device="cuda")
    grad = random_grad(d, num)
    assert_backward_matches(BACKWARD_OP(grad, d, kind, num, CUTOFF, cutoff_fn), grad, d, kind, num, cutoff_fn,
                            torch.float32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cutoff_fn", CUTOFF_FNS)
def test_backward_float64_and_strided_on_cpu(kind, cutoff_fn):
    d = strided(distances(6, 9, dtype=torch.float64))
    grad = strided(random_grad(d, 8))
    assert_backward_matches(BACKWARD_OP(grad, d, kind, 8, CUTOFF, cutoff_fn), grad, d, kind, 8,
                            cutoff_fn, torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cutoff_fn", CUTOFF_FNS)
def test_backward_of_radial_basis_is_the_op(device, kind, cutoff_fn):
    d = distances(50, device=device).requires_grad_()
    grad = random_grad(d, 12)
    (got,) = torch.autograd.grad(mirage.ops.radial_basis(d, kind, 12, CUTOFF, cutoff_fn), d, grad)
    torch.testing.assert_close(got, BACKWARD_OP(grad, d.detach(), kind, 12, CUTOFF, cutoff_fn),
                               atol=0, rtol=0)
    assert_backward_matches(got, grad, d, kind, 12, cutoff_fn, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_at_zero_cutoff_beyond_nan_and_inf(device):
    d = torch.tensor([0.0, 1e-4, CUTOFF, 1.5 * CUTOFF, float("nan"), float("inf"), 2.0], device=device)
    for kind in KINDS:
        for cutoff_fn in CUTOFF_FNS:
            grad = random_grad(d, 6)
            got = BACKWARD_OP(grad, d, kind, 6, CUTOFF, cutoff_fn)
            assert torch.isnan(got[4:6]).all(), (kind, cutoff_fn)  # as the composite's gradient
            assert torch.isfinite(got[[0, 1, 2, 3, 6]]).all(), (kind, cutoff_fn)
            if cutoff_fn != "none":
                assert (got[2:4] == 0).all()  # the envelope and its slope vanish from the cutoff on
            assert_backward_matches(got, grad, d, kind, 6, cutoff_fn, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_empty(device):
    d = torch.empty(0, 3, device=device)
    assert BACKWARD_OP(torch.empty(0, 3, 5, device=device), d, "bessel", 5, CUTOFF, "cosine").shape == (0, 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,cutoff_fn", [("gaussian", "cosine"), ("bessel", "polynomial")])
def test_first_order_backward_is_one_fused_op(device, kind, cutoff_fn):
    d = distances(40, device=device).requires_grad_()
    y = mirage.ops.radial_basis(d, kind, 20, CUTOFF, cutoff_fn)
    grad = random_grad(d, 20)
    with OpCounter() as counter:
        torch.autograd.grad(y, d, grad)
    assert counter.calls == ["mirage.radial_basis_backward"], counter.calls  # no composite recompute


def test_double_backward_goes_through_the_composite():
    d = distances(30, dtype=torch.float64).requires_grad_()
    grad = random_grad(d, 6)
    (first,) = torch.autograd.grad(mirage.ops.radial_basis(d, "bessel", 6, CUTOFF, "cosine"), d, grad,
                                   create_graph=True)
    assert first.requires_grad
    (second,) = torch.autograd.grad(first.sum(), d)
    repeated = d.detach().requires_grad_()
    (want_first,) = torch.autograd.grad(composite(repeated, "bessel", 6, CUTOFF, "cosine"), repeated, grad,
                                        create_graph=True)
    (want,) = torch.autograd.grad(want_first.sum(), repeated)
    torch.testing.assert_close(second, want, **tolerance(torch.float64))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cutoff_fn", CUTOFF_FNS)
def test_backward_gradcheck(kind, cutoff_fn):
    # As test_gradcheck: d = 0 included, the cutoff (where the cosine's second derivative jumps) left out.
    d = torch.cat([torch.zeros(1, dtype=torch.float64), torch.tensor([1e-3, 0.3], dtype=torch.float64),
                   torch.rand(7, dtype=torch.float64) * 0.9 * CUTOFF, torch.tensor([1.1 * CUTOFF])])
    d = d.requires_grad_()
    grad = random_grad(d, 5).requires_grad_()
    fn = lambda grad, d: BACKWARD_OP(grad, d, kind, 5, CUTOFF, cutoff_fn)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (grad, d))
    assert torch.autograd.gradgradcheck(fn, (grad, d))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("kind,num,cutoff_fn", [("gaussian", 5, "cosine"), ("bessel", 3, "polynomial"),
                                                ("bessel", 1, "none"), ("gaussian", 33, "none")])
def test_backward_opcheck(device, requires_grad, kind, num, cutoff_fn):
    d = distances(2, 7, device=device).requires_grad_(requires_grad)
    grad = random_grad(d, num).requires_grad_(requires_grad)
    torch.library.opcheck(BACKWARD_OP.default, (grad, d, kind, num, CUTOFF, cutoff_fn))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda d: BACKWARD_OP(torch.rand(4, 3, device=d), torch.rand(4, device=d), "sine", 3, 5.0, "cosine"),
         "mirage::radial_basis_backward: kind must be \"gaussian\", \"bessel\" or \"none\", got \"sine\""),
        (lambda d: BACKWARD_OP(torch.rand(4, 3, device=d), torch.rand(4, device=d), "bessel", 0, 5.0, "cosine"),
         "mirage::radial_basis_backward: num must be positive, got 0"),
        (lambda d: BACKWARD_OP(torch.rand(4, 3, device=d), torch.rand(4, device=d), "bessel", 3, 0.0, "cosine"),
         f"mirage::radial_basis_backward: {CUTOFF_RULE}, got 0"),
        (lambda d: BACKWARD_OP(torch.rand(4, 3, device=d), torch.rand(4, device=d), "bessel", 3, 5.0, "smooth"),
         "mirage::radial_basis_backward: cutoff_fn must be \"cosine\", \"polynomial\" or \"none\", got \"smooth\""),
        (lambda d: BACKWARD_OP(torch.ones(4, 3, dtype=torch.int64, device=d), torch.ones(4, dtype=torch.int64, device=d),
                               "bessel", 3, 5.0, "none"),
         "mirage::radial_basis_backward: distances must be float32, float16 or bfloat16"),
        (lambda d: BACKWARD_OP(torch.rand(4, 3, device=d).half(), torch.rand(4, device=d), "bessel", 3, 5.0, "none"),
         "mirage::radial_basis_backward: grad must have distances' dtype (Float), got Half"),
        (lambda d: BACKWARD_OP(torch.rand(4, 4, device=d), torch.rand(4, device=d), "bessel", 3, 5.0, "none"),
         "mirage::radial_basis_backward: grad must have shape distances' + [num] = [4, 3], got [4, 4]"),
        (lambda d: BACKWARD_OP(torch.rand(12, device=d), torch.rand(4, device=d), "bessel", 3, 5.0, "none"),
         "mirage::radial_basis_backward: grad must have shape distances' + [num] = [4, 3], got [12]"),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_backward_bad_input(call, message, device):
    assert_error(call, device, message)


@pytest.mark.cuda
def test_backward_cuda_rejects_float64_and_a_grad_on_another_device():
    with pytest.raises(RuntimeError, match="mirage::radial_basis_backward: distances must be float32, float16 or bfloat16"):
        BACKWARD_OP(torch.rand(4, 3, device="cuda", dtype=torch.float64),
                    torch.rand(4, device="cuda", dtype=torch.float64), "bessel", 3, 5.0, "none")
    with pytest.raises(RuntimeError, match="mirage::radial_basis_backward: grad must be on the same device as distances"):
        BACKWARD_OP(torch.rand(4, 3), torch.rand(4, device="cuda"), "bessel", 3, 5.0, "none")


@pytest.mark.parametrize("device", DEVICES)
def test_backward_autocast_runs_in_float32(device):
    d = distances(10, device=device)
    grad = random_grad(d, 4)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = BACKWARD_OP(grad.bfloat16(), d.bfloat16(), "bessel", 4, CUTOFF, "cosine")
        leaf = d.bfloat16().requires_grad_()
        y = mirage.ops.radial_basis(leaf, "gaussian", 4, CUTOFF, "cosine")
        (through_autograd,) = torch.autograd.grad(y, leaf, grad)
    assert got.dtype == torch.float32
    assert_backward_matches(got, grad.bfloat16().float(), d.bfloat16().float(), "bessel", 4, "cosine",
                            torch.float32)
    assert through_autograd.dtype == torch.bfloat16 and torch.isfinite(through_autograd).all()


@pytest.mark.parametrize("device", DEVICES)
def test_backward_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()

    def forces_like(d, grad):
        return BACKWARD_OP(grad, d, "bessel", 8, CUTOFF, "polynomial") * 2

    compiled = torch.compile(forces_like, fullgraph=True)
    for _ in range(2):
        d = distances(33, device=device)
        grad = random_grad(d, 8)
        got = compiled(d, grad)
        torch.testing.assert_close(got, forces_like(d, grad))
        assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_cuda_large(dtype):
    d = distances(130_000, dtype=dtype, device="cuda")
    for kind in KINDS:
        for num in [20, 50]:
            grad = random_grad(d, num)
            assert_backward_matches(BACKWARD_OP(grad, d, kind, num, CUTOFF, "cosine"), grad, d, kind, num,
                                    "cosine", dtype)


@pytest.mark.cuda
def test_backward_cuda_agrees_with_cpu_reference():
    d = distances(500)
    for kind in KINDS:
        for cutoff_fn in CUTOFF_FNS:
            for num in [2, 7, 16, 20]:
                grad = random_grad(d, num)
                cpu = BACKWARD_OP(grad, d, kind, num, CUTOFF, cutoff_fn)
                gpu = BACKWARD_OP(grad.cuda(), d.cuda(), kind, num, CUTOFF, cutoff_fn)
                scale = backward_terms(grad, d, kind, num, CUTOFF, cutoff_fn).abs().sum(-1).float()
                assert ((gpu.cpu() - cpu).abs() <= 2e-5 * (1 + scale)).all(), (kind, cutoff_fn, num)


@pytest.mark.cuda
def test_backward_cuda_graph_replay_with_new_inputs():
    d = distances(200, device="cuda")
    grad = random_grad(d, 20)
    graph, out = capture_graph(lambda: BACKWARD_OP(grad, d, "bessel", 20, CUTOFF, "cosine"))
    for _ in range(2):
        d.copy_(distances(200, device="cuda"))
        grad.copy_(random_grad(d, 20))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_backward_matches(out, grad, d, "bessel", 20, "cosine", torch.float32)
