import pytest
import torch
import torch.nn.functional as F

import mirage
from common import DEVICES, DTYPES, assert_error, assert_matches, opcheck, randn, strided

SHAPES = [(1, 2), (3, 14), (5, 1538), (2, 7, 2560), (2, 64, 10240)]


def composite(x, approximate):
    a, b = x.chunk(2, dim=-1)
    return a * F.gelu(b, approximate=approximate)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("is_strided", [False, True])
def test_matches_composite(device, dtype, shape, approximate, is_strided):
    x = randn(*shape, dtype=dtype, device=device)
    if is_strided:
        x = strided(x)
    assert_matches(mirage.ops.geglu(x, approximate), composite, (x, approximate), dtype)
    opcheck(torch.ops.mirage.geglu.default, (x, approximate))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 4096, 2560), (2, 1024, 5120), (2, 256, 10240)])
def test_cuda_transformer_shapes(dtype, shape):
    x = randn(*shape, dtype=dtype, device="cuda")
    assert_matches(mirage.ops.geglu(x), composite, (x, "none"), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_nan(device):
    assert mirage.ops.geglu(torch.empty(0, 6, device=device)).shape == (0, 3)
    assert mirage.ops.geglu(torch.empty(4, 0, device=device)).shape == (4, 0)
    x = randn(2, 6, device=device)
    x[1, 4] = float("nan")
    y = mirage.ops.geglu(x)
    assert torch.isnan(y[1, 1]) and torch.isfinite(y[0]).all()
    x[0, 3] = float("inf")  # gelu(inf) * a: finite a gives +-inf, never a crash
    assert torch.isinf(mirage.ops.geglu(x)[0, 0])


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda d: mirage.ops.geglu(torch.randn(2, 5, device=d)),
         "mirage::geglu: x's last dimension must be even, got 5"),
        (lambda d: mirage.ops.geglu(torch.tensor(2.0, device=d)),
         "mirage::geglu: x must have at least one dimension, got a scalar"),
        (lambda d: mirage.ops.geglu(torch.ones(2, 4, dtype=torch.int32, device=d)),
         "mirage::geglu: x must be float32, float16 or bfloat16"),
        (lambda d: mirage.ops.geglu(torch.randn(2, 4, device=d), "sigmoid"),
         "mirage::geglu: approximate must be \"none\" or \"tanh\", got \"sigmoid\""),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(call, message, device):
    assert_error(call, device, message)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_opcheck(device, requires_grad, approximate):
    x = randn(3, 4, 10, device=device).requires_grad_(requires_grad)
    torch.library.opcheck(torch.ops.mirage.geglu.default, (x, approximate))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gradcheck(approximate):
    x = randn(3, 8, dtype=torch.float64).requires_grad_()
    fn = lambda x: mirage.ops.geglu(x, approximate)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


def test_autocast_runs_in_the_autocast_dtype():
    x = randn(4, 10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mirage.ops.geglu(x)
    assert y.dtype == torch.bfloat16
    assert_matches(y, composite, (x.bfloat16(), "none"), torch.bfloat16)
