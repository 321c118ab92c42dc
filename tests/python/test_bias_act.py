import math

import pytest
import torch
import torch.nn.functional as F

import mirage
from common import (DEVICES, DTYPES, assert_backward_reads_no_value_of, assert_error, assert_matches, capture_graph,
                    opcheck, randn, strided)

ACTIVATIONS = {
    "none": lambda v: v,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"),
    "relu": F.relu,
}
# Odd channel counts and pixel counts (no 16-byte vectors), 2-D and 3-D x, U-Net-like sizes.
SHAPES = [(1, 3, 1, 1), (2, 5, 7, 3), (2, 24, 9, 11), (3, 16, 769), (4, 40)]
LAYOUTS = ["nchw", "channels_last", "strided"]


def composite(x, bias, residual, activation, scale):
    """What the op replaces: PyTorch's bias add, activation, residual add and scale."""
    v = x
    if bias is not None:
        shape = [1] * x.dim()
        shape[1] = x.shape[1]
        if bias.dim() == 2:
            shape[0] = x.shape[0]
        v = v + bias.to(x.dtype).reshape(shape)
    v = ACTIVATIONS[activation](v)
    if residual is not None:
        v = v + residual
    return v * scale


def arrange(x, layout):
    if layout == "channels_last" and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "strided":
        return strided(x)
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_composite(device, dtype, layout, shape):
    x = arrange(randn(*shape, dtype=dtype, device=device), layout)
    residual = arrange(randn(*shape, dtype=dtype, device=device), layout)
    bias = randn(shape[1], dtype=dtype, device=device)
    y = mirage.ops.bias_act(x, bias, residual, "silu", 0.5)
    assert_matches(y, composite, (x, bias, residual, "silu", 0.5), dtype)
    opcheck(torch.ops.mirage.bias_act.default, (x, bias, residual, "silu", 0.5))
    if layout == "channels_last" and x.dim() == 4:
        assert y.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("bias_kind", ["none", "channel", "sample", "channel_float32"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_every_epilogue(device, dtype, activation, bias_kind, with_residual):
    x = randn(2, 32, 6, 5, dtype=dtype, device=device).contiguous(memory_format=torch.channels_last)
    bias = {"none": None,
            "channel": randn(32, dtype=dtype, device=device),
            "sample": randn(2, 32, dtype=dtype, device=device),
            "channel_float32": randn(32, device=device)}[bias_kind]
    residual = randn(*x.shape, dtype=dtype, device=device) if with_residual else None
    y = mirage.ops.bias_act(x, bias, residual, activation)
    assert_matches(y, composite, (x, bias, residual, activation, 1.0), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_residual_in_another_layout(device):
    x = randn(2, 16, 5, 5, device=device).contiguous(memory_format=torch.channels_last)
    residual = randn(2, 16, 5, 5, device=device)  # NCHW
    bias = randn(16, device=device)
    y = mirage.ops.bias_act(x, bias, residual)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert_matches(y, composite, (x, bias, residual, "none", 1.0), torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("shape,per_sample", [((2, 320, 64, 64), False), ((2, 1280, 8, 8), True),
                                              ((2, 4, 64, 64), False)])
def test_cuda_unet_shapes(dtype, layout, shape, per_sample):
    x = arrange(randn(*shape, dtype=dtype, device="cuda"), layout)
    residual = arrange(randn(*shape, dtype=dtype, device="cuda"), layout)
    bias = randn(*((shape[0], shape[1]) if per_sample else (shape[1],)), dtype=dtype, device="cuda")
    assert_matches(mirage.ops.bias_act(x, bias, residual), composite, (x, bias, residual, "none", 1.0), dtype)


@pytest.mark.cuda
def test_cuda_agrees_with_cpu_reference():
    x = randn(2, 48, 9, 11).contiguous(memory_format=torch.channels_last)
    bias, residual = randn(2, 48), randn(2, 48, 9, 11)
    expected = mirage.ops.bias_act(x, bias, residual, "gelu", 0.25)
    got = mirage.ops.bias_act(x.cuda(), bias.cuda(), residual.cuda(), "gelu", 0.25)
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_nan(device):
    assert mirage.ops.bias_act(torch.empty(0, 4, 3, 3, device=device), torch.ones(4, device=device)).shape == (0, 4, 3, 3)
    assert mirage.ops.bias_act(torch.empty(2, 0, 3, device=device)).shape == (2, 0, 3)
    x = randn(2, 8, 3, 3, device=device)
    x[1, 2, 0, 0] = float("nan")
    x[0, 1, 1, 1] = float("inf")
    for activation in ACTIVATIONS:
        y = mirage.ops.bias_act(x, torch.ones(8, device=device), None, activation)
        assert torch.isnan(y[1, 2, 0, 0]), activation  # NaN propagates through every activation
        assert torch.isinf(y[0, 1, 1, 1]), activation
        finite = torch.ones_like(y, dtype=torch.bool)
        finite[1, 2, 0, 0] = finite[0, 1, 1, 1] = False
        assert torch.isfinite(y[finite]).all(), activation


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda d: mirage.ops.bias_act(torch.randn(5, device=d)),
         "mirage::bias_act: x must have shape (N, C, *), got 1 dimension(s) [5]"),
        (lambda d: mirage.ops.bias_act(torch.ones(2, 4, dtype=torch.int32, device=d)),
         "mirage::bias_act: x must be float32, float16 or bfloat16"),
        (lambda d: mirage.ops.bias_act(torch.randn(2, 4, 3, device=d), torch.randn(3, device=d)),
         "mirage::bias_act: bias must have shape [4] or [2, 4] for x of shape [2, 4, 3], got [3]"),
        (lambda d: mirage.ops.bias_act(torch.randn(2, 4, 3, device=d), torch.randn(4, 2, device=d)),
         "mirage::bias_act: bias must have shape [4] or [2, 4] for x of shape [2, 4, 3], got [4, 2]"),
        (lambda d: mirage.ops.bias_act(torch.randn(2, 4, 3, device=d, dtype=torch.float16),
                                       torch.randn(4, device=d, dtype=torch.bfloat16)),
         "mirage::bias_act: bias must have x's dtype (Half) or float32, got BFloat16"),
        (lambda d: mirage.ops.bias_act(torch.randn(2, 4, 3, device=d), None, torch.randn(2, 4, 2, device=d)),
         "mirage::bias_act: residual must have x's shape [2, 4, 3], got [2, 4, 2]"),
        (lambda d: mirage.ops.bias_act(torch.randn(2, 4, 3, device=d), None,
                                       torch.randn(2, 4, 3, device=d, dtype=torch.float16)),
         "mirage::bias_act: residual must have x's dtype (Float), got Half"),
        (lambda d: mirage.ops.bias_act(torch.randn(2, 4, 3, device=d), None, None, "tanh"),
         "mirage::bias_act: activation must be one of \"none\", \"silu\", \"gelu\", \"gelu_tanh\", \"relu\", got \"tanh\""),
        (lambda d: mirage.ops.bias_act(torch.randn(2, 4, 3, device=d), None, None, "none", math.inf),
         "mirage::bias_act: scale must be finite as a float32, got inf"),
        (lambda d: mirage.ops.bias_act(torch.randn(2, 4, 3, device=d), None, None, "none", 1e39),
         "mirage::bias_act: scale must be finite as a float32, got 1e+39"),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(call, message, device):
    assert_error(call, device, message)


@pytest.mark.cuda
def test_cuda_rejects_mixed_devices_and_float64():
    x = torch.randn(2, 4, 3, device="cuda")
    assert_error(lambda d: mirage.ops.bias_act(x, torch.randn(4)), "cuda",
                 "mirage::bias_act: bias must be on the same device as x (x on cuda:0, bias on cpu)")
    assert_error(lambda d: mirage.ops.bias_act(x, None, torch.randn(2, 4, 3)), "cuda",
                 "mirage::bias_act: residual must be on the same device as x (x on cuda:0, residual on cpu)")
    assert_error(lambda d: mirage.ops.bias_act(x.double()), "cuda",
                 "mirage::bias_act: x must be float32, float16 or bfloat16 (float64 off the GPU)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("bias_shape", [(6,), (2, 6)])
def test_opcheck(device, requires_grad, layout, bias_shape):
    x = arrange(randn(2, 6, 3, 5, device=device), layout).requires_grad_(requires_grad)
    bias = randn(*bias_shape, device=device).requires_grad_(requires_grad)
    residual = randn(2, 6, 3, 5, device=device).requires_grad_(requires_grad)
    torch.library.opcheck(torch.ops.mirage.bias_act.default, (x, bias, residual, "silu", 0.5))
    torch.library.opcheck(torch.ops.mirage.bias_act.default, (x, None, None, "none", 1.0))


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("bias_shape", [(4,), (2, 4)])
def test_gradcheck(activation, bias_shape):
    # Away from 0, where relu's derivative jumps and finite differences would straddle it.
    x = (randn(2, 4, 3, 3, dtype=torch.float64) + 0.05).contiguous(memory_format=torch.channels_last)
    x = torch.where(x.abs() < 0.1, x.sign() * 0.3 + 0.1, x).requires_grad_()
    bias = (0.01 * randn(*bias_shape, dtype=torch.float64)).requires_grad_()
    residual = randn(2, 4, 3, 3, dtype=torch.float64).requires_grad_()
    fn = lambda x, b, r: mirage.ops.bias_act(x, b, r, activation, 0.7)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, bias, residual))
    assert torch.autograd.gradgradcheck(fn, (x, bias, residual))


@pytest.mark.parametrize("device", DEVICES)
def test_float32_bias_gets_float32_grads(device):
    x = randn(2, 8, 4, 4, dtype=torch.bfloat16, device=device).requires_grad_()
    bias = randn(8, device=device).requires_grad_()
    mirage.ops.bias_act(x, bias, None, "silu").sum().backward()
    assert bias.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    reference_bias = bias.detach().clone().requires_grad_()
    composite(x.detach(), reference_bias, None, "silu", 1.0).sum().backward()
    torch.testing.assert_close(bias.grad, reference_bias.grad, atol=0.5, rtol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_float32_bias_gradient_is_summed_in_float32(device, dtype):
    # The sum over a 512 x 512 image: 131,072, past float16's largest value (65,504): inf when the
    # op summed a float32 bias's gradient in x's dtype.
    x = torch.zeros(1, 1, 512, 512, dtype=dtype, device=device, requires_grad=True)
    bias = torch.zeros(1, device=device, requires_grad=True)
    residual = torch.zeros_like(x, requires_grad=True)
    mirage.ops.bias_act(x, bias, residual, "none", 0.5).sum().backward()
    assert bias.grad.dtype == torch.float32 and bias.grad.item() == 0.5 * 512 * 512
    assert x.grad.dtype == residual.grad.dtype == dtype and bool((x.grad == 0.5).all())


def test_float64_x_with_a_float32_bias_keeps_float64_gradients():
    # The backward's recompute joins the two in the wider dtype (it once cast x to float32).
    x = randn(1, 2, 3, 3, dtype=torch.float64).requires_grad_()
    bias = randn(2).requires_grad_()
    mirage.ops.bias_act(x, bias, None, "silu").sum().backward()
    reference = x.detach().clone().requires_grad_()
    F.silu(reference + bias.detach().double()[:, None, None]).sum().backward()
    torch.testing.assert_close(x.grad, reference.grad, rtol=1e-12, atol=1e-14)


def test_autocast_runs_in_the_autocast_dtype():
    x, residual, bias = randn(2, 8, 4, 4), randn(2, 8, 4, 4), randn(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mirage.ops.bias_act(x, bias, residual, "silu")
    assert y.dtype == torch.bfloat16
    assert_matches(y, composite, (x.bfloat16(), bias, residual.bfloat16(), "silu", 1.0), torch.bfloat16)


@pytest.mark.cuda
def test_cuda_graph_replays_new_inputs():
    x = randn(2, 64, 16, 16, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    residual = torch.empty_like(x).copy_(randn(*x.shape, device="cuda"))
    bias = randn(2, 64, device="cuda")
    graph, y = capture_graph(lambda: mirage.ops.bias_act(x, bias, residual, "silu", 0.5))
    for _ in range(3):
        for buf in (x, residual, bias):
            buf.copy_(randn(*buf.shape, device="cuda", dtype=buf.dtype))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, mirage.ops.bias_act(x, bias, residual, "silu", 0.5), atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False).to(device)

    def block(x, bias, residual):
        return mirage.ops.bias_act(conv(x), bias, residual, "gelu", 0.5)

    compiled = torch.compile(block, fullgraph=True)
    for _ in range(2):  # new inputs each call: the compiled graph must not have baked them in
        x, residual, bias = randn(2, 8, 5, 5, device=device), randn(2, 8, 5, 5, device=device), randn(8, device=device)
        got = compiled(x, bias, residual)
        torch.testing.assert_close(got, block(x, bias, residual), atol=1e-5, rtol=1e-5)
        assert not torch.equal(got, torch.zeros_like(got))


def test_autocast_reads_a_bias_of_a_third_dtype_in_float32():
    x, bias = randn(2, 8, 4, 4), randn(8, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mirage.ops.bias_act(x, bias, None, "silu")
    assert y.dtype == torch.bfloat16
    assert_matches(y, composite, (x.bfloat16(), bias.float(), None, "silu", 1.0), torch.bfloat16)


def test_autocast_leaves_float64_in_float64():
    x, bias = randn(2, 8, 4, 4, dtype=torch.float64), randn(8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mirage.ops.bias_act(x, bias, None, "silu")
    assert y.dtype == torch.float64
    assert_matches(y, composite, (x, bias, None, "silu", 1.0), torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_backward_keeps_no_input_it_does_not_read(device, activation):
    # The op is linear in the residual, and without an activation in x and the bias too: the
    # backward keeps none of those (it kept all three: an image's memory held until the backward,
    # and "modified by an inplace operation" there where the composite goes through).
    inputs = (randn(2, 6, 5, 5, device=device), randn(6, device=device), randn(2, 6, 5, 5, device=device))
    assert_backward_reads_no_value_of(lambda *t: mirage.ops.bias_act(*t, activation, 0.5),
                                      lambda *t: composite(*t, activation, 0.5), inputs,
                                      unread=[2] if activation == "silu" else [0, 1, 2])
