import pytest
import torch
import torch.nn.functional as F

import mirage
from common import DEVICES, DTYPES, assert_error, assert_matches, opcheck, randn, strided

# (N, C, spatial, groups): C = 3 * groups, H*W of 1, 7 and 769, wide and narrow groups.
SHAPES = [
    ((2, 6, 1, 1), 2),
    ((3, 6, 7, 1), 2),
    ((1, 9, 769, 1), 3),
    ((2, 32, 8, 8), 8),
    ((2, 64, 24, 24), 32),
    ((1, 40, 64, 72), 4),
]
LAYOUTS = ["nchw", "channels_last", "strided"]


def composite(x, num_groups, weight, bias, eps, activation):
    y = F.group_norm(x, num_groups, weight, bias, eps)
    return F.silu(y) if activation == "silu" else y


def make_input(shape, layout, dtype, device):
    x = randn(*shape, dtype=dtype, device=device)
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "strided":
        return strided(x)
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape,groups", SHAPES)
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_matches_composite(device, dtype, layout, shape, groups, activation):
    x = make_input(shape, layout, dtype, device)
    c = shape[1]
    weight = randn(c, device=device, mean=1.0, std=0.5)  # float32 parameters beside any dtype
    bias = randn(c, device=device, mean=0.0, std=0.5)
    y = mirage.ops.group_norm(x, groups, weight, bias, 1e-5, activation)
    assert_matches(y, composite, (x, groups, weight, bias, 1e-5, activation),
                   dtype, reduction=True)
    opcheck(torch.ops.mirage.group_norm.default, (x, groups, weight, bias, 1e-5, activation))
    if layout == "channels_last":
        assert y.is_contiguous(memory_format=torch.channels_last)
    elif layout == "nchw":
        assert y.is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_without_affine_and_with_params_in_x_dtype(device, dtype):
    x = randn(2, 12, 5, 5, dtype=dtype, device=device)
    assert_matches(mirage.ops.group_norm(x, 4), composite, (x, 4, None, None, 1e-5, "none"), dtype,
                   reduction=True)
    w = randn(12, dtype=dtype, device=device)
    b = randn(12, dtype=dtype, device=device)
    assert_matches(mirage.ops.group_norm(x, 4, w, b, 1e-3, "silu"), composite,
                   (x, 4, w, b, 1e-3, "silu"), dtype, reduction=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
# The U-Net's shapes (3x2560x16x16: a batch of 3, as classifier-free guidance makes, puts the
# fused kernel at 8 vectors a thread), then odd ones that take the same paths (channels of one
# vector in several groups; rows that do not split evenly over the blocks; one sample; groups of
# scalars, 8 a thread).
@pytest.mark.parametrize("shape", [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 1280, 8, 8),
                                   (2, 2560, 8, 8), (3, 2560, 16, 16), (2, 960, 64, 64), (3, 96, 111, 113),
                                   (1, 64, 301, 7), (3, 96, 104, 120), (2, 96, 30, 30)])
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_cuda_unet_shapes(dtype, layout, shape, activation):
    x = make_input(shape, layout, dtype, "cuda")
    w = randn(shape[1], device="cuda", dtype=dtype)
    b = randn(shape[1], device="cuda", dtype=dtype)
    y = mirage.ops.group_norm(x, 32, w, b, 1e-5, activation)
    assert_matches(y, composite, (x, 32, w, b, 1e-5, activation), dtype, reduction=True)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_cuda_group_wider_than_the_block(layout):
    # One group of 2048 channels: more channels than the fused kernel's threads, so its weight and
    # bias are fetched in more than one round.
    x = make_input((2, 2048, 4, 2), layout, torch.float16, "cuda")
    w = randn(2048, device="cuda", dtype=torch.float16)
    b = randn(2048, device="cuda", dtype=torch.float16)
    y = mirage.ops.group_norm(x, 1, w, b, 1e-5, "silu")
    assert_matches(y, composite, (x, 1, w, b, 1e-5, "silu"), torch.float16, reduction=True)


@pytest.mark.cuda
def test_cuda_spans_at_the_shared_memory_limit():
    """NCHW groups split over two blocks each, every block's tile sized to end within the resident
    kernel's own __shared__ bytes (264) of the device's per-block limit: the plan counted the tile
    alone, so the launch failed ("invalid argument") where the tile fits and the kernel does not.
    On an H200 (132 SMs, 232,448 bytes) the shape is (2, 1280, 5800, 1)."""
    properties = torch.cuda.get_device_properties(0)
    sms, limit = properties.multi_processor_count, properties.shared_memory_per_block_optin
    if sms < 128:
        pytest.skip("needs 128 multiprocessors: two blocks for each of 64 groups")
    # 2 x 32 groups of 40 channels: (5 HW) 16-byte vectors a group, ceil(5 HW / (sms // 64)) a block.
    blocks = sms // 64
    hw = ((limit - 320) // 16 * blocks // 5) // 8 * 8
    tile = -(-5 * hw // blocks) * 16 + 40 * 8
    assert limit - 264 < tile <= limit, (hw, tile, limit)
    x = randn(2, 1280, hw, 1, device="cuda", dtype=torch.float16)
    w, b = randn(1280, device="cuda", dtype=torch.float16), randn(1280, device="cuda", dtype=torch.float16)
    assert_matches(mirage.ops.group_norm(x, 32, w, b, 1e-5, "silu"), composite, (x, 32, w, b, 1e-5, "silu"),
                   torch.float16, reduction=True)


@pytest.mark.cuda
def test_cuda_agrees_with_cpu_reference():
    x = randn(2, 48, 9, 11).contiguous(memory_format=torch.channels_last)
    w, b = randn(48), randn(48)
    cpu = mirage.ops.group_norm(x, 6, w, b, 1e-5, "silu")
    gpu = mirage.ops.group_norm(x.cuda(), 6, w.cuda(), b.cuda(), 1e-5, "silu")
    torch.testing.assert_close(gpu.cpu(), cpu, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_large_offset_keeps_precision(device):
    # mean >> std: sum-of-squares variance would cancel catastrophically in float32.
    x = randn(2, 32, 40, 40, device=device, mean=100.0, std=1.0).contiguous(memory_format=torch.channels_last)
    assert_matches(mirage.ops.group_norm(x, 8), composite, (x, 8, None, None, 1e-5, "none"),
                   torch.float32, reduction=True)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("shape", [(2, 320, 64, 64), (3, 96, 111, 113)])
@pytest.mark.parametrize("outliers", ["first pixel", "first rows"])
def test_cuda_large_offset_and_outliers_keep_precision(layout, shape, outliers):
    # Shapes of the whole-GPU kernels, which sum around an estimate of each group's mean: an
    # offset 100x the spread, and every group's first pixel 40 spreads out (where an estimate
    # from one value would sit), or its first two rows of pixels (whole blocks of the
    # channels-last kernel, whose estimates are per block), must not cost float32 its precision.
    # (At 1000x the float32 outputs are off by up to 5.4e-5 on every path: the normalize step
    # is one FMA, x * scale + shift, whose terms are ~mean / std; docs/ops.md.)
    x = randn(*shape, device="cuda", mean=100.0, std=1.0)
    if outliers == "first pixel":
        x[:, :, 0, 0] += 40.0
    else:
        x[:, :, :2, :] += 40.0
    x = make_input(shape, layout, torch.float32, "cuda").copy_(x)
    assert_matches(mirage.ops.group_norm(x, 32), composite, (x, 32, None, None, 1e-5, "none"),
                   torch.float32, reduction=True)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_nan(device):
    empty = torch.empty(0, 8, 4, 4, device=device)
    assert mirage.ops.group_norm(empty, 4).shape == empty.shape
    no_pixels = torch.empty(2, 8, 0, 3, device=device)
    assert mirage.ops.group_norm(no_pixels, 4).shape == no_pixels.shape
    # C = 0 passes any num_groups; the reference once walked all of its empty groups (a hang).
    no_channels = torch.empty(1, 0, 3, device=device)
    assert mirage.ops.group_norm(no_channels, 2**62).shape == no_channels.shape
    x = randn(2, 8, 4, 4, device=device)
    x[1, 0, 2, 2] = float("nan")
    y = mirage.ops.group_norm(x, 4, activation="silu")
    assert torch.isnan(y[1, :2]).all()  # the poisoned group
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[1, 2:]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,groups", [((0, 8, 4, 4), 4), ((2, 8, 0, 3), 4), ((1, 0, 3), 2), ((1, 0, 3), 2**62)])
def test_empty_input_backward(device, shape, groups):
    # PyTorch's group_norm backward, which the op's backward differentiated, refuses empty input
    # ("Expected number of channels to be greater than 0"): empty and zero gradients instead.
    x = torch.empty(shape, device=device, requires_grad=True)
    w, b = (torch.ones(shape[1], device=device, requires_grad=True) for _ in range(2))
    mirage.ops.group_norm(x, groups, w, b, 1e-5, "silu").sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == b.grad.shape == (shape[1],)
    assert not w.grad.any() and not b.grad.any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("shape", [(2, 64, 8, 8), (2, 1280, 8, 8), (2, 320, 64, 64)])
@pytest.mark.parametrize("pixel", [(2, 2), (0, 0)])
def test_inf_makes_its_group_nan_as_in_pytorch(device, layout, shape, pixel):
    # Inf - Inf in the statistics: NaN for the whole group in PyTorch, whatever path runs (the
    # one-block-a-group kernel for the first two shapes, a whole-GPU one for the last, whose
    # channels-last blocks take their shift from samples that include pixel (0, 0)).
    x = make_input(shape, layout, torch.float32, device)
    x[1, 3, pixel[0], pixel[1]] = float("inf")
    y = mirage.ops.group_norm(x, 32, activation="silu")
    expected = composite(x, 32, None, None, 1e-5, "silu")
    assert torch.isnan(expected).any()
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda d: mirage.ops.group_norm(torch.randn(8, device=d), 2),
         "mirage::group_norm: x must have shape (N, C, *), got 1 dimension(s)"),
        (lambda d: mirage.ops.group_norm(torch.randn(2, 30, 4, 4, device=d), 32),
         "mirage::group_norm: x must have C divisible by num_groups (C=30, num_groups=32)"),
        (lambda d: mirage.ops.group_norm(torch.randn(2, 8, 4, device=d), 0),
         "mirage::group_norm: num_groups must be positive, got 0"),
        (lambda d: mirage.ops.group_norm(torch.randn(2, 8, 4, device=d), 2, torch.ones(4, device=d)),
         "mirage::group_norm: weight must have shape [8], got [4]"),
        (lambda d: mirage.ops.group_norm(torch.randn(2, 8, 4, device=d), 2, None, torch.ones(8, 1, device=d)),
         "mirage::group_norm: bias must have shape [8], got [8, 1]"),
        (lambda d: mirage.ops.group_norm(torch.ones(2, 8, 4, dtype=torch.int32, device=d), 2),
         "mirage::group_norm: x must be float32, float16 or bfloat16"),
        (lambda d: mirage.ops.group_norm(torch.randn(2, 8, 4, device=d, dtype=torch.half), 2,
                                         torch.ones(8, device=d, dtype=torch.bfloat16)),
         "mirage::group_norm: weight must have x's dtype (Half) or float32, got BFloat16"),
        (lambda d: mirage.ops.group_norm(torch.randn(2, 8, 4, device=d), 2, torch.ones(8, device=d),
                                         torch.ones(8, device=d, dtype=torch.half)),
         "mirage::group_norm: bias must have x's dtype (Float) or float32, got Half"),
        (lambda d: mirage.ops.group_norm(torch.randn(2, 8, 4, device=d, dtype=torch.half), 2,
                                         torch.ones(8, device=d), torch.ones(8, device=d, dtype=torch.half)),
         "mirage::group_norm: weight and bias must have the same dtype, got Float and Half"),
        (lambda d: mirage.ops.group_norm(torch.randn(2, 8, 4, device=d), 2, activation="gelu"),
         "mirage::group_norm: activation must be \"none\" or \"silu\", got \"gelu\""),
        (lambda d: mirage.ops.group_norm(torch.randn(2, 8, 4, device=d), 2, eps=-1.0),
         "mirage::group_norm: eps must be finite and >= 0 as a float32, got -1"),
        (lambda d: mirage.ops.group_norm(torch.randn(2, 8, 4, device=d), 2, eps=1e39),  # inf in the kernels' float32
         "mirage::group_norm: eps must be finite and >= 0 as a float32, got 1e+39"),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(call, message, device):
    assert_error(call, device, message)


@pytest.mark.cuda
def test_cuda_rejects_mixed_devices_and_float64():
    x = torch.randn(2, 8, 4, device="cuda")
    with pytest.raises(RuntimeError, match=r"mirage::group_norm: weight must be on the same device as x \(x on cuda:0, weight on cpu\)"):
        mirage.ops.group_norm(x, 2, torch.ones(8))
    with pytest.raises(RuntimeError, match="mirage::group_norm: x must be float32, float16 or bfloat16"):
        mirage.ops.group_norm(x.double(), 2)


SAMPLES = [
    ((2, 6, 3, 3), 3, True, "silu", "channels_last"),
    ((2, 4, 5), 2, False, "none", "nchw"),
    ((1, 6, 2, 2), 2, True, "none", "strided"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,groups,affine,activation,layout", SAMPLES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, shape, groups, affine, activation, layout, requires_grad):
    x = make_input(shape, layout, torch.float32, device).requires_grad_(requires_grad)
    w = randn(shape[1], device=device).requires_grad_(requires_grad) if affine else None
    b = randn(shape[1], device=device).requires_grad_(requires_grad) if affine else None
    torch.library.opcheck(torch.ops.mirage.group_norm.default, (x, groups, w, b, 1e-5, activation))


@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gradcheck(activation, layout):
    x = make_input((2, 6, 3, 2), layout, torch.float64, "cpu").requires_grad_()
    w = randn(6, dtype=torch.float64).requires_grad_()
    b = randn(6, dtype=torch.float64).requires_grad_()
    fn = lambda x, w, b: mirage.ops.group_norm(x, 3, w, b, 1e-5, activation)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b))
    assert torch.autograd.gradgradcheck(fn, (x, w, b))


@pytest.mark.parametrize("device", DEVICES)
def test_float32_params_get_float32_grads(device):
    x = randn(2, 8, 4, 4, dtype=torch.bfloat16, device=device).requires_grad_()
    w = randn(8, device=device).requires_grad_()
    mirage.ops.group_norm(x, 2, w, None, 1e-5, "silu").sum().backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_params_gradients_are_summed_in_float32(device, dtype):
    # Sums over 65,536 pixels: the bias's gradient was inf in float16 (past 65,504) and the
    # weight's off by the rounding of a bfloat16 sum, when the parameters joined x's dtype.
    x = randn(1, 4, 256, 256, dtype=dtype, device=device).requires_grad_()
    w, b = randn(4, device=device).requires_grad_(), randn(4, device=device).requires_grad_()
    grad = torch.ones(1, 4, 256, 256, dtype=dtype, device=device)
    mirage.ops.group_norm(x, 2, w, b, 1e-5).backward(grad)
    reference = [t.detach().float().requires_grad_() for t in (x, w, b)]
    F.group_norm(reference[0], 2, reference[1], reference[2], 1e-5).backward(grad.float())
    torch.testing.assert_close(b.grad, reference[2].grad)
    torch.testing.assert_close(w.grad, reference[1].grad, rtol=1e-3, atol=1.0)  # a sum of +-1s: 0 +- ~300
    torch.testing.assert_close(x.grad, reference[0].grad.to(dtype))


def test_autocast_runs_in_the_autocast_dtype():
    x = randn(2, 8, 4, 4)
    w = randn(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mirage.ops.group_norm(x, 2, w, None, 1e-5, "silu")
    assert y.dtype == torch.bfloat16
    xb = x.to(torch.bfloat16)
    assert_matches(y, composite, (xb, 2, w, None, 1e-5, "silu"), torch.bfloat16)


def test_autocast_reads_parameters_of_a_third_dtype_in_float32():
    # float16 parameters under bfloat16 autocast: PyTorch's GroupNorm accepts them; read in float32.
    x, w, b = randn(2, 8, 4, 4).half(), randn(8).half(), randn(8).half()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mirage.ops.group_norm(x, 2, w, b, 1e-5, "silu")
    assert y.dtype == torch.bfloat16
    assert_matches(y, composite, (x.bfloat16(), 2, w.float(), b.float(), 1e-5, "silu"), torch.bfloat16)


def test_autocast_leaves_float64_in_float64():
    # Autocast does not cast float64 input; its float64 parameters must not be read in float32.
    x, w, b = randn(2, 8, 4, 4, dtype=torch.float64), randn(8, dtype=torch.float64), randn(8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mirage.ops.group_norm(x, 2, w, b, 1e-5, "silu")
    assert y.dtype == torch.float64
    assert_matches(y, composite, (x, 2, w, b, 1e-5, "silu"), torch.float64)


@pytest.mark.cuda
def test_cuda_autocast_runs_in_the_autocast_dtype():
    x = randn(2, 64, 16, 16, device="cuda").contiguous(memory_format=torch.channels_last)
    w = randn(64, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        y = mirage.ops.group_norm(x, 32, w, None, 1e-5, "silu")
    assert y.dtype == torch.float16
    assert_matches(y, composite, (x.half(), 32, w, None, 1e-5, "silu"), torch.float16)
