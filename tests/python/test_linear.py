import pytest
import torch
import torch.nn.functional as F

import mirage
from common import DEVICES, DTYPES, assert_error, capture_graph, opcheck, randn, strided
from tolerances import tolerance

# (x shape, out_features): 1-D x, one row, odd widths (no 16-byte rows), 3-D x, a wide K.
SHAPES = [((7,), 5), ((1, 1), 1), ((3, 7), 5), ((2, 3, 13), 9), ((4, 769), 24), ((2, 5, 40), 320)]
LAYOUTS = ["contiguous", "strided", "row_stride", "weight_transposed"]


# The activations the op fuses, written here rather than taken from mirage.nn.conv (whose
# unfused path uses its own table): the reference must not follow an edit of the code under test.
ACTIVATIONS = {
    "none": lambda x: x,
    "relu": F.relu,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def composite(x, weight, bias, residual):
    """What the op replaces: F.linear, then the residual add."""
    y = F.linear(x, weight, bias)
    return y if residual is None else y + residual


def rows_aligned(t):
    """Whether t's rows start on 16-byte boundaries (what cuBLASLt's fast epilogues need)."""
    pitch = t.stride(-2) if t.dim() >= 2 and t.shape[-2] > 1 else t.shape[-1]
    return t.data_ptr() % 16 == 0 and (pitch * t.element_size()) % 16 == 0


def assert_linear_close(got, x, weight, bias, residual, activation="none"):
    """got == composite in float64, within the dtype's table (the output's rounding) plus the
    float32 summation's worst case, K * 2^-24 * sum of |terms| (outputs that cancel to ~0 keep it).
    On CUDA, operands not 16-byte aligned with both bias and residual take two roundings (the
    residual in a second pass, docs/ops.md): one more rounding of the linear part is allowed there.
    An input activation's output is rounded to the dtype before the matmul: one rounding of each
    activated x is allowed for."""
    dtype = x.dtype
    args = [None if t is None else t.detach().double().cpu() for t in (x, weight, bias, residual)]
    args[0] = ACTIVATIONS[activation](args[0])
    ref = composite(*args)
    two_roundings = (got.is_cuda and bias is not None and residual is not None
                     and not all(rows_aligned(t.contiguous() if t.stride(-1) != 1 else t)
                                 for t in (x, weight, residual, got)))
    terms = args[0].abs() @ args[1].abs().T
    if args[2] is not None:
        terms = terms + args[2].abs()
    if args[3] is not None:
        terms = terms + args[3].abs()
    k = x.shape[-1]
    tol = tolerance(dtype)
    bound = tol["atol"] + tol["rtol"] * ref.abs() + k * 2.0**-24 * terms
    if two_roundings:
        bound = bound + torch.finfo(dtype).eps * F.linear(*args[:3]).abs()
    if activation != "none":
        bound = bound + torch.finfo(dtype).eps * (args[0].abs() @ args[1].abs().T)
    assert got.dtype == dtype and got.shape == ref.shape and got.is_contiguous()
    error = (got.double().cpu() - ref).abs()
    worst = (error / bound).argmax()
    assert (error <= bound).all(), (f"error {error.flatten()[worst].item():.3g} > bound {bound.flatten()[worst].item():.3g} "
                                    f"(got {got.flatten()[worst].item():.6g}, expected {ref.flatten()[worst].item():.6g})")


def arrange(x, layout):
    if layout == "strided" and x.dim() > 0:
        return strided(x)
    if layout == "row_stride" and x.dim() >= 2:  # rows with a stride: a column slice of a wider tensor
        wide = torch.full(x.shape[:-1] + (x.shape[-1] + 3,), float("nan"), dtype=x.dtype, device=x.device)
        view = wide[..., 1:x.shape[-1] + 1]
        view.copy_(x)
        return view
    return x


def operands(x_shape, n, dtype, device, layout="contiguous"):
    k = x_shape[-1]
    x = arrange(randn(*x_shape, dtype=dtype, device=device), layout)
    if layout == "weight_transposed":
        weight = randn(k, n, dtype=dtype, device=device, std=k**-0.5).T  # column-major [n, k]
    else:
        weight = arrange(randn(n, k, dtype=dtype, device=device, std=k**-0.5), layout)
    bias = randn(n, dtype=dtype, device=device)
    residual = arrange(randn(*x_shape[:-1], n, dtype=dtype, device=device), layout)
    return x, weight, bias, residual


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_composite(device, dtype, layout, shape):
    x, weight, bias, residual = operands(*shape, dtype, device, layout)
    for b, r in [(bias, residual), (None, None), (bias, None), (None, residual)]:
        assert_linear_close(mirage.ops.linear(x, weight, b, r), x, weight, b, r)
        # After the first call, which on CUDA picks the shape's cuBLASLt algorithm for the process.
        opcheck(torch.ops.mirage.linear.default, (x, weight, b, r, "none"))


@pytest.mark.parametrize("device", DEVICES)
def test_float32_equals_pytorch_exactly_on_the_cpu_or_within_summation_error(device):
    x, weight, bias, residual = operands((6, 33), 17, torch.float32, device)
    got = mirage.ops.linear(x, weight, bias, residual)
    if device == "cpu":  # the CPU reference is F.linear, then the add
        assert torch.equal(got, composite(x, weight, bias, residual))
    else:
        assert_linear_close(got, x, weight, bias, residual)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_zero_width(device):
    weight, bias = randn(4, 3, device=device), randn(4, device=device)
    assert mirage.ops.linear(torch.empty(0, 3, device=device), weight, bias).shape == (0, 4)
    assert mirage.ops.linear(randn(2, 3, device=device), torch.empty(0, 3, device=device)).shape == (2, 0)
    # K = 0: no products, the output is bias + residual
    residual = randn(2, 4, device=device)
    got = mirage.ops.linear(torch.empty(2, 0, device=device), torch.empty(4, 0, device=device), bias, residual)
    torch.testing.assert_close(got, bias + residual, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_propagate(device):
    x, weight, bias, residual = operands((4, 16), 8, torch.float32, device)
    x[1, 3] = float("nan")
    residual[2, 5] = float("inf")
    y = mirage.ops.linear(x, weight, bias, residual)
    assert torch.isnan(y[1]).all()
    assert torch.isinf(y[2, 5])
    finite = torch.ones_like(y, dtype=torch.bool)
    finite[1] = False
    finite[2, 5] = False
    assert torch.isfinite(y[finite]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9])  # up to 8: the few-rows kernel on CUDA (two instances:
# up to 2 rows and up to 8); 9: cuBLASLt
def test_input_activation(device, dtype, activation, rows):
    x, weight, bias, residual = operands((rows, 40), 24, dtype, device)
    got = mirage.ops.linear(x, weight, bias, residual, activation)
    assert_linear_close(got, x, weight, bias, residual, activation)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
# No 16-byte rows, 16-byte rows, a time embedding's width, and past the 2,048 inputs a warp of the
# few-rows kernel loads before staging x (its main loop).
@pytest.mark.parametrize("k", [7, 40, 1280, 2560])
def test_few_rows(device, dtype, layout, k):
    x, weight, bias, residual = operands((2, k), 33, dtype, device, layout)
    for b, r in [(bias, residual), (None, None)]:
        assert_linear_close(mirage.ops.linear(x, weight, b, r, "silu"), x, weight, b, r, "silu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [2, 20])
def test_residual_with_repeated_rows(device, rows):
    # A bias broadcast over the batch (ResnetBlock2D folds conv1's bias into its time embedding so).
    x, weight, bias, _ = operands((rows, 64), 48, torch.float16, device)
    shared = randn(48, dtype=torch.float16, device=device)
    residual = shared.expand(rows, -1)
    assert residual.stride(0) == 0
    got = mirage.ops.linear(x, weight, bias, residual, "silu")
    assert_linear_close(got, x, weight, bias, residual.contiguous(), "silu")


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda d: mirage.ops.linear(torch.tensor(1.0, device=d), torch.randn(2, 1, device=d)),
         "mirage::linear: x must have at least one dimension, got a scalar"),
        (lambda d: mirage.ops.linear(torch.ones(2, 3, dtype=torch.int32, device=d), torch.ones(2, 3, device=d)),
         "mirage::linear: x must be float32, float16 or bfloat16"),
        (lambda d: mirage.ops.linear(torch.randn(2, 3, device=d), torch.randn(4, 5, device=d)),
         "mirage::linear: weight must have shape [out_features, 3] for x of shape [2, 3], got [4, 5]"),
        (lambda d: mirage.ops.linear(torch.randn(2, 3, device=d), torch.randn(3, device=d)),
         "mirage::linear: weight must have shape [out_features, 3] for x of shape [2, 3], got [3]"),
        (lambda d: mirage.ops.linear(torch.randn(2, 3, device=d), torch.randn(4, 3, device=d, dtype=torch.float16)),
         "mirage::linear: weight must have x's dtype (Float), got Half"),
        (lambda d: mirage.ops.linear(torch.randn(2, 3, device=d), torch.randn(4, 3, device=d), torch.randn(3, device=d)),
         "mirage::linear: bias must have shape [4], got [3]"),
        (lambda d: mirage.ops.linear(torch.randn(2, 3, device=d), torch.randn(4, 3, device=d),
                                     torch.randn(4, device=d, dtype=torch.bfloat16)),
         "mirage::linear: bias must have x's dtype (Float), got BFloat16"),
        (lambda d: mirage.ops.linear(torch.randn(2, 3, device=d), torch.randn(4, 3, device=d), None,
                                     torch.randn(2, 3, device=d)),
         "mirage::linear: residual must have the output's shape [2, 4], got [2, 3]"),
        (lambda d: mirage.ops.linear(torch.randn(2, 3, device=d), torch.randn(4, 3, device=d), None,
                                     torch.randn(4, device=d)),
         "mirage::linear: residual must have the output's shape [2, 4], got [4]"),
        (lambda d: mirage.ops.linear(torch.randn(2, 3, device=d), torch.randn(4, 3, device=d), None,
                                     torch.randn(2, 4, device=d, dtype=torch.float16)),
         "mirage::linear: residual must have x's dtype (Float), got Half"),
        (lambda d: mirage.ops.linear(torch.randn(2, 3, device=d), torch.randn(4, 3, device=d), None, None, "tanh"),
         "mirage::linear: input_activation must be one of \"none\", \"silu\", \"gelu\", \"gelu_tanh\", \"relu\", got \"tanh\""),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(call, message, device):
    assert_error(call, device, message)


@pytest.mark.cuda
def test_cuda_rejects_mixed_devices_and_float64():
    x = torch.randn(2, 3, device="cuda")
    assert_error(lambda d: mirage.ops.linear(x, torch.randn(4, 3)), "cuda",
                 "mirage::linear: weight must be on the same device as x (x on cuda:0, weight on cpu)")
    assert_error(lambda d: mirage.ops.linear(x, torch.randn(4, 3, device="cuda"), torch.randn(4)), "cuda",
                 "mirage::linear: bias must be on the same device as x (x on cuda:0, bias on cpu)")
    assert_error(lambda d: mirage.ops.linear(x, torch.randn(4, 3, device="cuda"), None, torch.randn(2, 4)), "cuda",
                 "mirage::linear: residual must be on the same device as x (x on cuda:0, residual on cpu)")
    assert_error(lambda d: mirage.ops.linear(x.double(), torch.randn(4, 3, device="cuda").double()), "cuda",
                 "mirage::linear: x must be float32, float16 or bfloat16 (float64 off the GPU)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, requires_grad):
    x, weight, bias, residual = (t.requires_grad_(requires_grad) for t in operands((2, 3, 6), 5, torch.float32, device))
    torch.library.opcheck(torch.ops.mirage.linear.default, (x, weight, bias, residual))
    torch.library.opcheck(torch.ops.mirage.linear.default, (x, weight, None, None))
    for activation in ("silu", "gelu_tanh"):
        torch.library.opcheck(torch.ops.mirage.linear.default, (x[0, :2], weight, bias, residual[0, :2], activation))


def test_gradcheck():
    x, weight, bias, residual = (t.requires_grad_() for t in operands((2, 3, 4), 5, torch.float64, "cpu"))
    assert torch.autograd.gradcheck(mirage.ops.linear, (x, weight, bias, residual))
    assert torch.autograd.gradgradcheck(mirage.ops.linear, (x, weight, bias, residual))
    assert torch.autograd.gradcheck(lambda x, w: mirage.ops.linear(x, w), (x, weight))
    silu = lambda x, w, b, r: mirage.ops.linear(x, w, b, r, "silu")  # noqa: E731
    assert torch.autograd.gradcheck(silu, (x, weight, bias, residual))
    assert torch.autograd.gradgradcheck(silu, (x, weight, bias, residual))


@pytest.mark.parametrize("device", DEVICES)
def test_bias_and_residual_changed_in_place_after_the_forward(device):
    # Their gradients read no value of theirs: the backward keeps neither (it kept both, and failed
    # with "modified by an inplace operation" where F.linear(x, w) + r goes through).
    x, weight, bias, residual = (t.requires_grad_() for t in operands((4, 6), 5, torch.float32, device))
    y = mirage.ops.linear(x, weight, bias, residual)
    with torch.no_grad():
        bias.add_(1.0)
        residual.mul_(2.0)
    grad = randn(4, 5, device=device)
    y.backward(grad)
    torch.testing.assert_close(bias.grad, grad.sum(0))
    torch.testing.assert_close(residual.grad, grad)
    torch.testing.assert_close(x.grad, grad @ weight.detach(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["none", "silu"])
# 6 rows: the few-rows kernel forward on CUDA; 12: cuBLASLt (a molecule's atoms, the shapes
# whose x gradient PyTorch's cuBLAS is slow at); 1-D x.
@pytest.mark.parametrize("x_shape", [(3, 2, 16), (12, 40), (16,)])
def test_gradients_match_pytorch(device, dtype, activation, x_shape):
    # x's gradient is mirage::linear with the transposed (column-major) weight.
    x, weight, bias, residual = (t.requires_grad_() for t in operands(x_shape, 8, dtype, device))
    grad = randn(*x_shape[:-1], 8, dtype=dtype, device=device)
    mirage.ops.linear(x, weight, bias, residual, activation).backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias, residual)]
    composite(ACTIVATIONS[activation](leaves[0]), *leaves[1:]).backward(grad.double())
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    for ours, theirs in zip((x, weight, bias, residual), leaves):
        assert ours.grad.dtype == dtype
        # Each gradient is a sum over outputs or rows rounded to the dtype two or three times (the
        # product, silu's derivative, their product): an element that cancels is off by a share of
        # the gradient's scale, not of its own value (bfloat16, 12 x 40, silu: 0.057 off on an
        # element of about 0.11, H200, 2026-11-29 10:20 UTC, torch seed 2973380879049769230).
        scale = max(1.0, theirs.grad.abs().max().item())
        torch.testing.assert_close(ours.grad.double(), theirs.grad, atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_of_a_sum_and_of_some_inputs_only(device):
    # energy = linear(...).sum(): the incoming gradient is an expanded (stride 0) tensor. Every
    # input requires grad, but a backward pass may ask for some only (forces: x's alone).
    x, weight, bias, _ = (t.requires_grad_() for t in operands((12, 24), 1, torch.float32, device))
    for asked in [(x,), (weight,), (bias, x), (x, weight, bias)]:
        grads = torch.autograd.grad(mirage.ops.linear(x, weight, bias).sum(), asked)
        ref = torch.autograd.grad(F.linear(x, weight, bias).sum(), asked)
        for ours, theirs in zip(grads, ref):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_double_backward_matches_pytorch(device):
    # Force training: forces are a first gradient, the loss on them is differentiated again.
    # The reference is float64: the second gradients reach ~1e4 here, where float32 (PyTorch's
    # own too) is off by ~1e-6 of the largest, so the tolerance scales with it.
    x, weight, bias, _ = operands((12, 24), 16, torch.float32, device)

    def forces_and_loss_gradients(fn, *inputs):
        x, weight, bias = (t.detach().requires_grad_() for t in inputs)
        energy = F.silu(fn(x, weight, bias)).square().sum()
        (forces,) = torch.autograd.grad(energy, x, create_graph=True)
        return (forces, *torch.autograd.grad(forces.square().sum(), (x, weight, bias)))

    got = forces_and_loss_gradients(mirage.ops.linear, x, weight, bias)
    expected = forces_and_loss_gradients(F.linear, x.double(), weight.double(), bias.double())
    for ours, theirs in zip(got, expected):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours.double(), theirs, atol=1e-5 * theirs.abs().max().item(), rtol=1e-4)


def test_nn_linear_fuses_a_plain_linear():
    module = torch.nn.Linear(24, 8)
    x, residual = randn(3, 24), randn(3, 8)
    with torch.no_grad():
        got = mirage.nn.linear(module, x, residual, "silu")
        assert torch.equal(got, mirage.ops.linear(x, module.weight, module.bias, residual, "silu"))


def test_nn_linear_under_autocast_activates_before_casting():
    # Under a casting autocast the op would cast x before its activation; PyTorch activates in
    # float32 and casts after. nn.linear must then run the unfused code, bit for bit.
    module = torch.nn.Linear(24, 8)
    x = randn(3, 24)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = mirage.nn.linear(module, x, None, "silu")
        expected = module(F.silu(x))
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def test_nn_linear_rejects_an_unknown_activation():
    with pytest.raises(ValueError, match="mirage.nn.linear: input_activation must be one of none, relu, silu"):
        mirage.nn.linear(torch.nn.Linear(4, 2), randn(1, 4), None, "tanh")


def test_autocast_runs_in_the_autocast_dtype():
    x, weight, bias, residual = operands((4, 24), 8, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mirage.ops.linear(x, weight, bias, residual)
    assert y.dtype == torch.bfloat16
    assert_linear_close(y, *(t.bfloat16() for t in (x, weight, bias, residual)))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    weight, bias = randn(12, 20, device=device, std=0.2), randn(12, device=device)

    def block(x, residual):
        return mirage.ops.linear(torch.relu(x), weight, bias, residual)

    compiled = torch.compile(block, fullgraph=True)
    for _ in range(2):  # new inputs each call: the compiled graph must not have baked them in
        x, residual = randn(3, 20, device=device), randn(3, 12, device=device)
        got = compiled(x, residual)
        torch.testing.assert_close(got, block(x, residual), atol=1e-5, rtol=1e-5)
        assert_linear_close(got, torch.relu(x), weight, bias, residual)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(8192, 320, 320), (8192, 1280, 320), (2048, 640, 5120), (2, 1280, 320)])
def test_cuda_unet_shapes(dtype, m, k, n):
    x, weight, bias, residual = operands((m, k), n, dtype, "cuda")
    for b, r in [(bias, residual), (bias, None), (None, None)]:
        assert_linear_close(mirage.ops.linear(x, weight, b, r), x, weight, b, r)


@pytest.mark.cuda
def test_cuda_misaligned_operands():
    # Views one element into their storage: 2-byte (float16) alignment, and an odd-offset bias.
    m, k, n = 64, 40, 24
    storage = [randn(size + 1, dtype=torch.float16, device="cuda") for size in (m * k, n * k, n, m * n)]
    x, weight, bias, residual = (s[1:].view(shape) if len(shape) > 1 else s[1:]
                                 for s, shape in zip(storage, ((m, k), (n, k), (n,), (m, n))))
    assert x.data_ptr() % 16 != 0 and bias.data_ptr() % 16 != 0
    assert_linear_close(mirage.ops.linear(x, weight, bias, residual), x, weight, bias, residual)


@pytest.mark.cuda
def test_cuda_few_rows_misaligned_x_with_aligned_rows():
    # x one element into its storage: the pointer is off 16 bytes while its row pitch (80 bytes) is
    # not, so the few-rows kernel must check the pointer itself to stay off 16-byte loads.
    storage = randn(2 * 40 + 1, dtype=torch.float16, device="cuda")
    x = storage[1:].view(2, 40)
    _, weight, bias, residual = operands((2, 40), 24, torch.float16, "cuda")
    assert x.data_ptr() % 16 != 0 and (x.stride(0) * x.element_size()) % 16 == 0
    assert_linear_close(mirage.ops.linear(x, weight, bias, residual, "silu"), x, weight, bias, residual, "silu")


@pytest.mark.cuda
@pytest.mark.parametrize("k", [1536, 1544])  # 8 x 1536 = 12,288 values: the few-rows kernel's most; then cuBLASLt
def test_cuda_few_rows_size_limit(k):
    x, weight, bias, residual = operands((8, k), 40, torch.float16, "cuda")
    assert_linear_close(mirage.ops.linear(x, weight, bias, residual, "silu"), x, weight, bias, residual, "silu")


@pytest.mark.cuda
def test_cuda_agrees_with_cpu_reference():
    x, weight, bias, residual = operands((5, 3, 48), 36, torch.float32, "cpu")
    expected = mirage.ops.linear(x, weight, bias, residual)
    got = mirage.ops.linear(x.cuda(), weight.cuda(), bias.cuda(), residual.cuda())
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("warm_up", [True, False])
def test_cuda_graph_replays_new_inputs(warm_up):
    # Without an eager call first the shape is new inside the capture (no timing possible there):
    # the heuristic's first algorithm must be captured and give the same values.
    m, k, n = (256, 96, 80) if warm_up else (264, 104, 88)
    x, weight, bias, residual = (torch.empty_like(t).copy_(t) for t in operands((m, k), n, torch.float16, "cuda"))
    if warm_up:
        graph, y = capture_graph(lambda: mirage.ops.linear(x, weight, bias, residual))
    else:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = mirage.ops.linear(x, weight, bias, residual)
    for _ in range(3):
        for buf in (x, weight, bias, residual):
            buf.copy_(randn(*buf.shape, device="cuda", dtype=buf.dtype, std=0.3))
        graph.replay()
        torch.cuda.synchronize()
        assert_linear_close(y, x, weight, bias, residual)


@pytest.mark.cuda
def test_cuda_tf32_follows_pytorch_setting():
    x, weight, bias, residual = operands((512, 256), 128, torch.float32, "cuda")
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert_linear_close(mirage.ops.linear(x, weight, bias, residual), x, weight, bias, residual)
        torch.backends.cuda.matmul.allow_tf32 = True
        got = mirage.ops.linear(x, weight, bias, residual)
        expected = composite(*(t.double() for t in (x, weight, bias, residual)))
        torch.testing.assert_close(got.double(), expected, atol=0.05, rtol=0.01)
        # TF32 taken, not float32 kept: float32 ignoring the flag would pass the bound above.
        assert (got.double() - expected).abs().max() > 1e-3
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


# ---- few outputs of many rows: the narrow kernel (float32, TF32 parts) ----------------------

NARROW_MIN_ROWS = 131072  # csrc/ops/linear_cuda.cpp, kNarrowLinearMinRows


def narrow_kernel_ran(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, any("narrow_linear_kernel" in e.name for e in prof.events())


@pytest.mark.cuda
@pytest.mark.parametrize("m,k,n,layout", [(NARROW_MIN_ROWS, 384, 21, "weight_transposed"), (139_046, 384, 21, "weight_transposed"),
                                          (NARROW_MIN_ROWS + 3, 4, 1, "contiguous"), (NARROW_MIN_ROWS + 5, 1024, 32, "contiguous"),
                                          (NARROW_MIN_ROWS + 9, 36, 7, "strided"), (NARROW_MIN_ROWS + 1, 388, 32, "row_stride"),
                                          (NARROW_MIN_ROWS + 2, 64, 12, "contiguous")])  # 1, 2, 3 and 4 n8 tiles
@pytest.mark.parametrize("with_bias", [False, True])
def test_cuda_narrow_outputs(m, k, n, layout, with_bias):
    """float32 outputs of up to 32 features from 131,072 rows on (k % 4 == 0 and 16-byte aligned x
    rows, no residual or activation) run on the narrow kernel: float32's accuracy from three TF32
    products; rows with a stride of k + 3 take cuBLASLt."""
    x, weight, bias, _ = operands((m, k), n, torch.float32, "cuda", layout)
    bias = bias if with_bias else None
    y, ran = narrow_kernel_ran(lambda: mirage.ops.linear(x, weight, bias))
    # The kernel stages the weight in shared memory, k padded to 64 in rows of 34 floats: k = 1024
    # (136 KiB) is more than an sm_86/sm_89 GPU's 99 KiB, and cuBLASLt runs there.
    shared = torch.cuda.get_device_properties(x.device).shared_memory_per_block_optin
    assert ran == (layout != "row_stride" and -(-k // 64) * 64 * 34 * 4 <= shared)
    assert_linear_close(y, x, weight, bias, None)


@pytest.mark.cuda
def test_cuda_narrow_kernel_only_where_it_applies():
    x, weight, bias, residual = operands((NARROW_MIN_ROWS, 64), 32, torch.float32, "cuda")
    assert narrow_kernel_ran(lambda: mirage.ops.linear(x, weight))[1]
    _, wide, _, _ = operands((NARROW_MIN_ROWS, 64), 33, torch.float32, "cuda")
    cases = [lambda: mirage.ops.linear(x[1:], weight),  # one row too few
             lambda: mirage.ops.linear(x, wide),  # 33 outputs
             lambda: mirage.ops.linear(x, weight, bias, residual),
             lambda: mirage.ops.linear(x, weight, input_activation="silu"),
             lambda: mirage.ops.linear(x[:, :63], weight[:, :63]),  # k % 4 != 0
             lambda: mirage.ops.linear(x.half(), weight.half())]
    for case in cases:
        y, ran = narrow_kernel_ran(case)
        assert not ran


@pytest.mark.cuda
def test_cuda_narrow_outputs_propagate_nan_and_inf():
    x, weight, _, _ = operands((NARROW_MIN_ROWS, 16), 8, torch.float32, "cuda")
    x[5, 3], x[9, 0] = float("nan"), float("inf")
    y = mirage.ops.linear(x, weight)
    assert torch.isnan(y[5]).all() and not torch.isfinite(y[9]).any() and torch.isfinite(y[10]).all()


# ---- float32 in 64 x 64 tiles: the tiled kernel (TF32 parts), timed against cuBLASLt ---------

def tiled_kernel_ran(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, any("tiled_linear_kernel" in e.name for e in prof.events())


# A force field's atom-wise products and their x gradients, edges of the 32 x 32 tiles and the
# 32-wide slices of k, one output, 9 rows (up to 8 take the few-rows kernel); 64 x 64 tiles take
# problems of at least four such tiles a multiprocessor: 70,000 rows of 8 outputs (one slice of
# k) and 20,000 rows of 256 (seven slices, the last one partial).
TILED_SHAPES = [(3000, 128, 128), (9000, 128, 128), (3000, 256, 384), (9, 4, 1), (63, 36, 65), (65, 260, 130),
                (129, 32, 4), (9, 1028, 64), (70_000, 12, 8), (20_000, 200, 256)]


@pytest.mark.cuda
@pytest.mark.parametrize("m,k,n", TILED_SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "weight_transposed", "strided"])
def test_cuda_tiled_matches_float64(monkeypatch, m, k, n, layout):
    """MIRAGE_LINEAR_TILED=1: float32 products whose rows are 16-byte aligned (k % 4 == 0, and
    n % 4 == 0 for a column-major weight) run on the tiled kernel, with float32's accuracy from three
    TF32 products, bias and residual in its epilogue."""
    monkeypatch.setenv("MIRAGE_LINEAR_TILED", "1")
    x, weight, bias, residual = operands((m, k), n, torch.float32, "cuda", layout)
    if layout == "strided":  # rows 4 floats wider than k: a column slice, still 16-byte aligned
        x = torch.empty(m, k + 4, device="cuda")[:, :k].copy_(x)
    for b, r in [(bias, residual), (None, None), (bias, None), (None, residual)]:
        y, ran = tiled_kernel_ran(lambda: mirage.ops.linear(x, weight, b, r))
        # A transposed [k, 1] weight is also a row-major [1, k] one.
        assert ran == (layout != "weight_transposed" or n % 4 == 0 or n == 1)
        assert_linear_close(y, x, weight, b, r)


@pytest.mark.cuda
def test_cuda_tiled_gradients(monkeypatch):
    """The x gradient is linear itself with a column-major weight: the tiled kernel's other layout."""
    monkeypatch.setenv("MIRAGE_LINEAR_TILED", "1")
    x, weight, bias, residual = (t.requires_grad_() for t in operands((300, 128), 96, torch.float32, "cuda"))
    grad = randn(300, 96, device="cuda")
    y = mirage.ops.linear(x, weight, bias, residual)
    got, ran = tiled_kernel_ran(lambda: torch.autograd.grad(y, (x, weight, bias, residual), grad))
    assert ran  # x's gradient: grad @ weight, the weight passed column-major
    expected = torch.autograd.grad(composite(*(t.double() for t in (x, weight, bias, residual))),
                                   (x, weight, bias, residual), grad.double())
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-5)  # both float32: e's float64 sums rounded


@pytest.mark.cuda
def test_cuda_tiled_only_where_it_applies(monkeypatch):
    monkeypatch.setenv("MIRAGE_LINEAR_TILED", "1")
    x, weight, bias, residual = operands((256, 64), 48, torch.float32, "cuda")
    assert tiled_kernel_ran(lambda: mirage.ops.linear(x, weight))[1]
    storage = randn(256 * 64 + 1, device="cuda")
    cases = [lambda: mirage.ops.linear(x[:, :63], weight[:, :63]),  # k % 4 != 0
             lambda: mirage.ops.linear(storage[1:].view(256, 64), weight),  # x not 16-byte aligned
             lambda: mirage.ops.linear(x, randn(64, 46, device="cuda").T),  # column-major, n % 4 != 0
             lambda: mirage.ops.linear(x.half(), weight.half(), bias.half(), residual.half()),
             lambda: mirage.ops.linear(x[:4], weight)]  # few rows: the few-rows kernel
    for case in cases:
        y, ran = tiled_kernel_ran(case)
        assert not ran
    monkeypatch.setenv("MIRAGE_LINEAR_TILED", "0")
    y, ran = tiled_kernel_ran(lambda: mirage.ops.linear(x, weight, bias, residual))
    assert not ran
    assert_linear_close(y, x, weight, bias, residual)


@pytest.mark.cuda
def test_cuda_tiled_setting_must_be_0_or_1(monkeypatch):
    """A bad setting is refused on every call past the few-rows kernel, float16 ones included."""
    monkeypatch.setenv("MIRAGE_LINEAR_TILED", "yes")
    x, weight, _, _ = operands((256, 64), 48, torch.float32, "cuda")
    for dtype in (torch.float32, torch.float16):
        with pytest.raises(RuntimeError, match="mirage::linear: MIRAGE_LINEAR_TILED must be 0, 1 or unset"):
            mirage.ops.linear(x.to(dtype), weight.to(dtype))


@pytest.mark.cuda
def test_cuda_tiled_tf32_and_non_finite(monkeypatch):
    """With TF32 allowed the kernel makes one TF32 product (as cuBLAS's TF32 kernels); a NaN reaches
    its row, an infinity gives NaN or an infinity there (the split of an infinity is NaN)."""
    monkeypatch.setenv("MIRAGE_LINEAR_TILED", "1")
    x, weight, bias, residual = operands((512, 256), 128, torch.float32, "cuda")
    expected = composite(*(t.double() for t in (x, weight, bias, residual)))
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        y, ran = tiled_kernel_ran(lambda: mirage.ops.linear(x, weight, bias, residual))
        assert ran
        torch.testing.assert_close(y.double(), expected, atol=0.05, rtol=0.01)
        # One TF32 product: operands rounded to 10-bit mantissas (~4e-3 at worst here, outputs
        # ~20), against ~1e-5 for three products.
        assert (y.double() - expected).abs().max() > 1e-3
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    three_products = mirage.ops.linear(x, weight, bias, residual)
    assert (three_products.double() - expected).abs().max() < 1e-3
    x[5, 3], x[9, 0] = float("nan"), float("inf")
    y = mirage.ops.linear(x, weight, bias, residual)
    assert torch.isnan(y[5]).all() and not torch.isfinite(y[9]).any() and torch.isfinite(y[10]).all()


@pytest.mark.cuda
def test_cuda_tiled_takes_a_residual_cublaslt_would_add_after(monkeypatch):
    """Unset, with bias and a residual that is not 16-byte aligned (cuBLASLt's kernels would add it
    in a second pass, a second rounding) the tiled kernel runs without timing: one pass, one rounding."""
    monkeypatch.delenv("MIRAGE_LINEAR_TILED", raising=False)
    x, weight, bias, residual = operands((300, 128), 96, torch.float32, "cuda")
    unaligned = randn(300 * 96 + 1, device="cuda")[1:].view(300, 96).copy_(residual)
    y, ran = tiled_kernel_ran(lambda: mirage.ops.linear(x, weight, bias, unaligned))
    assert ran
    assert_linear_close(y, x, weight, bias, unaligned)
    monkeypatch.setenv("MIRAGE_LINEAR_TILED", "0")  # still cuBLASLt and the second pass when asked
    y, ran = tiled_kernel_ran(lambda: mirage.ops.linear(x, weight, bias, unaligned))
    assert not ran
    assert_linear_close(y, x, weight, bias, unaligned)


@pytest.mark.cuda
def test_cuda_timed_choice_and_graph_capture(monkeypatch):
    """Unset, the tiled kernel is one of the timed candidates: whichever wins, the result and a
    CUDA graph's replays with new inputs are right."""
    monkeypatch.delenv("MIRAGE_LINEAR_TILED", raising=False)
    x, weight, bias, residual = (torch.empty_like(t).copy_(t) for t in operands((3000, 128), 128, torch.float32, "cuda"))
    graph, y = capture_graph(lambda: mirage.ops.linear(x, weight, bias, residual))
    for _ in range(2):
        for buf in (x, residual):
            buf.copy_(randn(*buf.shape, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert_linear_close(y, x, weight, bias, residual)
