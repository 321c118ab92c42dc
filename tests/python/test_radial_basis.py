import math

import pytest
import torch

import mirage
from common import DEVICES, DTYPES, assert_error, assert_matches, strided

KINDS = ["gaussian", "bessel"]
CUTOFF_FNS = ["cosine", "polynomial", "none"]
CUTOFF = 5.0


def composite(d, kind, num, cutoff, cutoff_fn):
    """The formulas of docs/ops.md in plain torch (float64 in the tests)."""
    d = d.unsqueeze(-1)
    if kind == "gaussian":
        delta = cutoff / (num - 1) if num > 1 else cutoff
        mu = torch.arange(num, dtype=d.dtype, device=d.device) * delta
        basis = torch.exp(-((d - mu) ** 2) / (2 * delta**2))
    else:
        n = torch.arange(1, num + 1, dtype=d.dtype, device=d.device)
        limit = n * math.pi / cutoff
        basis = math.sqrt(2 / cutoff) * torch.where(d == 0, limit, torch.sin(n * math.pi * d / cutoff) / d)
    x = d / cutoff
    if cutoff_fn == "cosine":
        basis = basis * torch.where(d < cutoff, 0.5 * (torch.cos(math.pi * x) + 1), 0.0)
    elif cutoff_fn == "polynomial":
        basis = basis * torch.where(d < cutoff, 1 - 28 * x**6 + 48 * x**7 - 21 * x**8, 0.0)
    return basis


def distances(*shape, dtype=torch.float32, device="cpu"):
    """Uniform over [0, 1.2 cutoff): inside and beyond the cutoff, with 0 and the cutoff itself."""
    d = torch.rand(*shape, dtype=torch.float64) * 1.2 * CUTOFF
    flat = d.view(-1)
    flat[0] = 0.0
    if flat.numel() > 1:
        flat[-1] = CUTOFF
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
         "mirage::radial_basis: kind must be \"gaussian\" or \"bessel\", got \"sine\""),
        (lambda d: mirage.ops.radial_basis(torch.rand(4, device=d), "bessel", 0, 5.0, "cosine"),
         "mirage::radial_basis: num must be positive, got 0"),
        (lambda d: mirage.ops.radial_basis(torch.rand(4, device=d), "bessel", 4, -1.0, "cosine"),
         "mirage::radial_basis: cutoff must be finite and > 0, got -1"),
        (lambda d: mirage.ops.radial_basis(torch.rand(4, device=d), "bessel", 4, float("inf"), "cosine"),
         "mirage::radial_basis: cutoff must be finite and > 0, got inf"),
        (lambda d: mirage.ops.radial_basis(torch.rand(4, device=d), "bessel", 4, 5.0, "smooth"),
         "mirage::radial_basis: cutoff_fn must be \"cosine\", \"polynomial\" or \"none\", got \"smooth\""),
        (lambda d: mirage.ops.radial_basis(torch.ones(4, dtype=torch.int64, device=d), "bessel", 4, 5.0, "none"),
         "mirage::radial_basis: distances must be float32, float16 or bfloat16"),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(call, message, device):
    assert_error(call, device, message)


@pytest.mark.cuda
def test_cuda_rejects_float64():
    with pytest.raises(RuntimeError, match="mirage::radial_basis: distances must be float32, float16 or bfloat16"):
        mirage.ops.radial_basis(torch.rand(4, device="cuda", dtype=torch.float64), "bessel", 4, 5.0, "none")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("kind,num,cutoff_fn", [("gaussian", 5, "cosine"), ("bessel", 3, "polynomial"),
                                                ("bessel", 1, "none")])
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
