import pytest
import torch
import torch.nn.functional as F

import mirage
from common import DEVICES, DTYPES, assert_error, assert_matches, opcheck, randn, strided

SHAPES = [(1, 1), (3, 7), (5, 769), (2, 4, 320), (2, 16, 1280), (3, 2, 3000)]


def composite(x, weight, bias, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_composite(total, weight, bias, eps):
    # `total` is x + residual rounded to the dtype: the sum the fused op normalizes and returns.
    return composite(total, weight, bias, eps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("is_strided", [False, True])
def test_matches_composite(device, dtype, shape, is_strided):
    x = randn(*shape, dtype=dtype, device=device)
    if is_strided:
        x = strided(x)
    weight = randn(shape[-1], device=device, mean=1.0, std=0.5)
    bias = randn(shape[-1], device=device, mean=0.0, std=0.5)
    y = mirage.ops.layer_norm(x, weight, bias, 1e-5)
    assert_matches(y, composite, (x, weight, bias, 1e-5), dtype, reduction=True)
    opcheck(torch.ops.mirage.layer_norm.default, (x, weight, bias, 1e-5))
    assert mirage.ops.layer_norm(x).shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_residual_matches_composite(device, dtype, shape):
    x = randn(*shape, dtype=dtype, device=device)
    residual = strided(randn(*shape, dtype=dtype, device=device))
    weight = randn(shape[-1], dtype=dtype, device=device)
    out, total = mirage.ops.layer_norm(x, weight, None, 1e-6, residual=residual)
    torch.testing.assert_close(total, x + residual, atol=0, rtol=0)
    assert_matches(out, add_composite, (x + residual, weight, None, 1e-6), dtype, reduction=True)
    opcheck(torch.ops.mirage.add_layer_norm.default, (x, residual, weight, None, 1e-6))


# The transformer rows (fp16/bf16: 320, 640, 1280 values take the team kernel with no idle slot;
# 128, 256, 384, 512 and 768 take its other team sizes and vectors a lane; 72 and 1000 leave some
# lanes' last slot idle), rows past what registers hold in one team, and an odd length (the scalar
# kernel). The parameters in x's dtype, or in float32 as autocast leaves them (fewer vectors a lane).
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 4096, 320), (2, 1024, 640), (2, 256, 1280), (5, 72), (7, 96), (9, 128),
                                   (11, 256), (13, 384), (6, 512), (33, 768), (37, 1000), (4, 16384), (3, 12289)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("float32_params", [False, True])
def test_cuda_transformer_shapes(dtype, shape, with_residual, float32_params):
    x = randn(*shape, dtype=dtype, device="cuda")
    param_dtype = torch.float32 if float32_params else dtype
    w = randn(shape[-1], dtype=param_dtype, device="cuda")
    b = randn(shape[-1], dtype=param_dtype, device="cuda")
    if not with_residual:
        assert_matches(mirage.ops.layer_norm(x, w, b), composite, (x, w, b, 1e-5), dtype, reduction=True)
        return
    r = randn(*shape, dtype=dtype, device="cuda")
    out, total = mirage.ops.layer_norm(x, w, b, 1e-5, residual=r)
    torch.testing.assert_close(total, x + r, atol=0, rtol=0)
    assert_matches(out, add_composite, (x + r, w, b, 1e-5), dtype, reduction=True)


@pytest.mark.cuda
def test_cuda_rejects_rows_longer_than_registers_hold():
    with pytest.raises(RuntimeError, match="mirage::layer_norm: x's last dimension must be at most 16384 on CUDA"):
        mirage.ops.layer_norm(torch.randn(2, 16385, device="cuda"))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_nan(device):
    assert mirage.ops.layer_norm(torch.empty(0, 5, device=device)).shape == (0, 5)
    assert mirage.ops.layer_norm(torch.empty(3, 0, device=device)).shape == (3, 0)
    # No rows: empty whatever the row length, which CUDA would otherwise refuse past 16384.
    assert mirage.ops.layer_norm(torch.empty(0, 20000, device=device)).shape == (0, 20000)
    out, total = mirage.ops.layer_norm(torch.empty(0, 20000, device=device), residual=torch.empty(0, 20000, device=device))
    assert out.shape == total.shape == (0, 20000)
    x = randn(4, 9, device=device)
    x[2, 3] = float("nan")
    y = mirage.ops.layer_norm(x)
    assert torch.isnan(y[2]).all()
    assert torch.isfinite(y[[0, 1, 3]]).all()


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda d: mirage.ops.layer_norm(torch.tensor(1.0, device=d)),
         "mirage::layer_norm: x must have at least one dimension, got a scalar"),
        (lambda d: mirage.ops.layer_norm(torch.randn(2, 8, device=d), torch.ones(7, device=d)),
         "mirage::layer_norm: weight must have shape [8], got [7]"),
        (lambda d: mirage.ops.layer_norm(torch.ones(2, 8, dtype=torch.int64, device=d)),
         "mirage::layer_norm: x must be float32, float16 or bfloat16"),
        (lambda d: mirage.ops.layer_norm(torch.randn(2, 8, device=d), torch.ones(8, device=d),
                                         torch.ones(8, device=d, dtype=torch.float64)),
         "mirage::layer_norm: bias must have x's dtype (Float) or float32, got Double"),
        (lambda d: mirage.ops.layer_norm(torch.randn(2, 8, device=d), residual=torch.randn(2, 7, device=d)),
         "mirage::add_layer_norm: residual must have x's shape [2, 8], got [2, 7]"),
        (lambda d: mirage.ops.layer_norm(torch.randn(2, 8, device=d),
                                         residual=torch.randn(2, 8, device=d, dtype=torch.half)),
         "mirage::add_layer_norm: residual must have x's dtype (Float), got Half"),
        (lambda d: mirage.ops.layer_norm(torch.randn(2, 8, device=d), eps=float("inf")),
         "mirage::layer_norm: eps must be finite and >= 0 as a float32, got inf"),
        (lambda d: mirage.ops.layer_norm(torch.randn(2, 8, device=d), eps=1e39),  # inf in the kernels' float32
         "mirage::layer_norm: eps must be finite and >= 0 as a float32, got 1e+39"),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(call, message, device):
    assert_error(call, device, message)


@pytest.mark.cuda
def test_cuda_rejects_mixed_devices():
    with pytest.raises(RuntimeError, match="mirage::add_layer_norm: residual must be on the same device as x"):
        mirage.ops.layer_norm(torch.randn(2, 8, device="cuda"), residual=torch.randn(2, 8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_opcheck(device, requires_grad, affine):
    x = randn(3, 5, 6, device=device).requires_grad_(requires_grad)
    r = randn(3, 5, 6, device=device).requires_grad_(requires_grad)
    w = randn(6, device=device).requires_grad_(requires_grad) if affine else None
    b = randn(6, device=device).requires_grad_(requires_grad) if affine else None
    torch.library.opcheck(torch.ops.mirage.layer_norm.default, (x, w, b, 1e-5))
    torch.library.opcheck(torch.ops.mirage.add_layer_norm.default, (x, r, w, b, 1e-5))


def test_gradcheck():
    x = randn(3, 7, dtype=torch.float64).requires_grad_()
    r = randn(3, 7, dtype=torch.float64).requires_grad_()
    w = randn(7, dtype=torch.float64).requires_grad_()
    b = randn(7, dtype=torch.float64).requires_grad_()
    norm = lambda x, w, b: mirage.ops.layer_norm(x, w, b)  # noqa: E731
    add_norm = lambda x, r, w, b: mirage.ops.layer_norm(x, w, b, residual=r)  # noqa: E731
    assert torch.autograd.gradcheck(norm, (x, w, b))
    assert torch.autograd.gradgradcheck(norm, (x, w, b))
    assert torch.autograd.gradcheck(add_norm, (x, r, w, b))
    assert torch.autograd.gradgradcheck(add_norm, (x, r, w, b))


def test_autocast_runs_in_the_autocast_dtype():
    x, r, w = randn(4, 10), randn(4, 10), randn(10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, total = mirage.ops.layer_norm(x, w, None, residual=r)
    assert out.dtype == total.dtype == torch.bfloat16
    expected_total = x.bfloat16() + r.bfloat16()
    torch.testing.assert_close(total, expected_total, atol=0, rtol=0)
    assert_matches(out, add_composite, (expected_total, w, None, 1e-5), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_float32_params_gradients_are_summed_in_float32(device, dtype, with_residual):
    # Sums over 70,000 rows: in float16 the bias's gradient overflowed, in bfloat16 it stopped
    # growing at 512, when the parameters joined x's dtype.
    x, residual = (randn(70_000, 8, dtype=dtype, device=device).requires_grad_() for _ in range(2))
    w, b = randn(8, device=device).requires_grad_(), randn(8, device=device).requires_grad_()
    out = mirage.ops.layer_norm(x, w, b, 1e-5, residual if with_residual else None)
    (out[0] if with_residual else out).float().sum().backward()
    # The op rounds the sum to x's dtype before the norm (docs/ops.md): so does the reference.
    summed = (x.detach() + residual.detach() if with_residual else x.detach()).float()
    reference = [t.detach().clone().requires_grad_() for t in (w, b)]
    F.layer_norm(summed, (8,), reference[0], reference[1], 1e-5).sum().backward()
    torch.testing.assert_close(b.grad, reference[1].grad)
    torch.testing.assert_close(w.grad, reference[0].grad, rtol=1e-3, atol=1.0)


def test_autocast_reads_parameters_of_a_third_dtype_in_float32():
    x, r, w, b = randn(4, 10).half(), randn(4, 10).half(), randn(10).half(), randn(10).half()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mirage.ops.layer_norm(x, w, b)
        out, total = mirage.ops.layer_norm(x, w, b, residual=r)
    assert y.dtype == out.dtype == torch.bfloat16
    assert_matches(y, add_composite, (x.bfloat16(), w.float(), b.float(), 1e-5), torch.bfloat16)
    assert_matches(out, add_composite, (total, w.float(), b.float(), 1e-5), torch.bfloat16)


def test_autocast_leaves_float64_in_float64():
    x, r, w, b = randn(4, 10, dtype=torch.float64), randn(4, 10, dtype=torch.float64), \
        randn(10, dtype=torch.float64), randn(10, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mirage.ops.layer_norm(x, w, b)
        out, total = mirage.ops.layer_norm(x, w, b, residual=r)
    assert y.dtype == out.dtype == torch.float64
    assert_matches(y, add_composite, (x, w, b, 1e-5), torch.float64)
    assert_matches(out, add_composite, (x + r, w, b, 1e-5), torch.float64)
