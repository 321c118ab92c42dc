"""mirage.ops.subpixel_shuffle / subpixel_weight and mirage.nn.Upsample2D: nearest 2x upsampling
followed by a 3x3 convolution, computed as 2x2 convolutions of the small image."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import mirage
from common import (DEVICES, DTYPES, GraphStandIn, assert_error, assert_matches, capture_graph, opcheck, randn,
                    assert_backward_reads_no_value_of, strided)
from tolerances import REDUCTION_ERROR_FACTOR, tolerance

# (N, C, H, W) of the small image: out is (N, C, 2H, 2W). C = 3 and 13 take the kernel's scalar
# path (not a multiple of the 16-byte vector), 1x1 and 1-wide images the edges.
SHAPES = [(1, 1, 1, 1), (2, 3, 4, 5), (1, 13, 1, 7), (2, 8, 3, 3), (2, 64, 9, 6), (1, 320, 5, 4)]


def composite(x, bias):
    """subpixel_shuffle written out parity by parity: out[:, :, 2i+p, 2j+q] = x[parity, i+p, j+q]."""
    n, c4, h1, w1 = x.shape
    c, h, w = c4 // 4, h1 - 1, w1 - 1
    out = x.new_empty(n, c, 2 * h, 2 * w)
    for p in (0, 1):
        for q in (0, 1):
            g = 2 * p + q
            out[:, :, p::2, q::2] = x[:, g * c:(g + 1) * c, p:p + h, q:q + w]
    return out if bias is None else out + bias.view(-1, 1, 1)


def layout(x, kind):
    if kind == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if kind == "strided":
        return strided(x)
    return x.contiguous()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias_dtype", [None, "same", torch.float32])
@pytest.mark.parametrize("kind", ["channels_last", "contiguous", "strided"])
def test_shuffle_matches_composite(device, dtype, shape, bias_dtype, kind):
    n, c, h, w = shape
    x = layout(randn(n, 4 * c, h + 1, w + 1, dtype=dtype, device=device), kind)
    bias = None if bias_dtype is None else randn(c, dtype=dtype if bias_dtype == "same" else bias_dtype, device=device)
    got = mirage.ops.subpixel_shuffle(x, bias)
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert_matches(got, composite, (x, bias), dtype)
    opcheck(torch.ops.mirage.subpixel_shuffle.default, (x, bias))
    if bias is None:  # a copy: bit for bit
        assert torch.equal(got, composite(x, None))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_offset", [1, 4])
def test_cuda_misaligned_operands_take_the_scalar_path(dtype, bias_offset):
    # 16 channels allow 16-byte vectors, but not a float32 bias 4 bytes into its storage, nor one
    # 16 bytes in (a float32 vector of 8 needs 32), nor an x one element into its storage.
    c = 16
    x = randn(2, 4 * c, 6, 7, dtype=dtype, device="cuda").contiguous(memory_format=torch.channels_last)
    bias = randn(c + bias_offset, device="cuda")[bias_offset:]
    assert_matches(mirage.ops.subpixel_shuffle(x, bias), composite, (x, bias), dtype)
    flat = torch.empty(x.numel() + 1, dtype=dtype, device="cuda")[1:]
    shifted = flat.view(2, 6, 7, 4 * c).permute(0, 3, 1, 2)  # channels-last, misaligned
    shifted.copy_(x)
    assert shifted.is_contiguous(memory_format=torch.channels_last)
    assert_matches(mirage.ops.subpixel_shuffle(shifted, bias), composite, (x, bias), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 1280, 8, 8), (2, 1280, 16, 16), (2, 640, 32, 32), (1, 4, 64, 64)])
def test_cuda_unet_shapes(dtype, shape):
    n, c, h, w = shape
    x = randn(n, 4 * c, h + 1, w + 1, dtype=dtype, device="cuda").contiguous(memory_format=torch.channels_last)
    bias = randn(c, device="cuda")
    assert_matches(mirage.ops.subpixel_shuffle(x, bias), composite, (x, bias), dtype)


def reference_upsample_conv(x, weight, bias):
    return F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), weight, bias, padding=1)


def subpixel_upsample_conv(x, weight, bias):
    return mirage.ops.subpixel_shuffle(F.conv2d(x, mirage.ops.subpixel_weight(weight), None, padding=1), bias)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (2, 3, 4, 5, 6), (1, 8, 7, 3, 5)])
def test_subpixel_form_equals_upsampling_then_conv_float64(shape):
    n, c_in, c_out, h, w = shape
    x = randn(n, c_in, h, w, dtype=torch.float64)
    weight, bias = randn(c_out, c_in, 3, 3, dtype=torch.float64), randn(c_out, dtype=torch.float64)
    torch.testing.assert_close(subpixel_upsample_conv(x, weight, bias), reference_upsample_conv(x, weight, bias),
                               **tolerance(torch.float64))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 64, 48, 9, 7), (2, 320, 320, 16, 16)])
def test_cuda_subpixel_form_error_is_pytorchs_own(dtype, shape):
    # Against float64, within REDUCTION_ERROR_FACTOR of PyTorch's own same-dtype error (the folded
    # taps are rounded to dtype once, and the sums run over 4 instead of 9 taps).
    n, c_in, c_out, h, w = shape
    x = randn(n, c_in, h, w, device="cuda", mean=0.0, std=1.0).contiguous(memory_format=torch.channels_last)
    weight = (randn(c_out, c_in, 3, 3, device="cuda", mean=0.0, std=1.0) / (3 * c_in ** 0.5))
    weight = weight.contiguous(memory_format=torch.channels_last)
    bias = randn(c_out, device="cuda")
    exact = reference_upsample_conv(x.double(), weight.double(), bias.double())
    ours = (subpixel_upsample_conv(x.to(dtype), weight.to(dtype), bias.to(dtype)).double() - exact).abs().max()
    theirs = (reference_upsample_conv(x.to(dtype), weight.to(dtype), bias.to(dtype)).double() - exact).abs().max()
    assert ours <= REDUCTION_ERROR_FACTOR * theirs + tolerance(dtype)["atol"], (ours.item(), theirs.item())


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_nan(device):
    assert mirage.ops.subpixel_shuffle(torch.empty(0, 8, 3, 3, device=device)).shape == (0, 2, 4, 4)
    assert mirage.ops.subpixel_shuffle(torch.empty(2, 8, 1, 3, device=device)).shape == (2, 2, 0, 4)
    assert mirage.ops.subpixel_shuffle(torch.empty(2, 0, 3, 3, device=device)).shape == (2, 0, 4, 4)
    x = randn(1, 8, 3, 3, device=device)
    x[0, 2, 1, 1] = float("nan")  # parity (0, 1), channel 0, at (i+0, j+1) = (1, 1): out[0, 0, 2, 1]
    out = mirage.ops.subpixel_shuffle(x, randn(2, device=device))
    assert torch.isnan(out[0, 0, 2, 1]) and torch.isnan(out).sum() == 1


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda d: mirage.ops.subpixel_shuffle(torch.randn(8, 3, 3, device=d)),
         "mirage::subpixel_shuffle: x must be 4-D [N, 4C, H+1, W+1], got shape [8, 3, 3]"),
        (lambda d: mirage.ops.subpixel_shuffle(torch.randn(1, 6, 3, 3, device=d)),
         "mirage::subpixel_shuffle: x's channels must be a multiple of 4 (four parities of C channels), got 6"),
        (lambda d: mirage.ops.subpixel_shuffle(torch.randn(1, 8, 0, 3, device=d)),
         "mirage::subpixel_shuffle: x's height and width must be at least 1 (H+1 and W+1), got shape [1, 8, 0, 3]"),
        (lambda d: mirage.ops.subpixel_shuffle(torch.ones(1, 8, 3, 3, dtype=torch.int32, device=d)),
         "mirage::subpixel_shuffle: x must be float32, float16 or bfloat16"),
        (lambda d: mirage.ops.subpixel_shuffle(torch.randn(1, 8, 3, 3, device=d), torch.randn(3, device=d)),
         "mirage::subpixel_shuffle: bias must have shape [2], got [3]"),
        (lambda d: mirage.ops.subpixel_shuffle(torch.randn(1, 8, 3, 3, device=d).half(), torch.randn(2, device=d).bfloat16()),
         "mirage::subpixel_shuffle: bias must have x's dtype (Half) or float32, got BFloat16"),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(call, message, device):
    assert_error(call, device, message)


@pytest.mark.cuda
def test_bias_on_another_device():
    assert_error(lambda d: mirage.ops.subpixel_shuffle(torch.randn(1, 8, 3, 3, device=d), torch.randn(2)), "cuda",
                 "mirage::subpixel_shuffle: bias")


def test_subpixel_weight_bad_shape():
    with pytest.raises(RuntimeError, match=r"mirage.ops.subpixel_weight: weight must be \(C_out, C_in, 3, 3\), got \(4, 2, 2, 2\)"):
        mirage.ops.subpixel_weight(torch.randn(4, 2, 2, 2))
    with pytest.raises(RuntimeError, match=r"mirage.ops.subpixel_weight: weight must be floating point, got torch.int64"):
        mirage.ops.subpixel_weight(torch.ones(4, 2, 3, 3, dtype=torch.int64))


@pytest.mark.parametrize("device", DEVICES)
def test_subpixel_shuffle_sums_a_float32_bias_gradient_in_float32(device):
    # 4 x 256 x 256 outputs of one channel: 262,144 ones, past float16's largest value.
    x = torch.zeros(1, 4, 257, 257, dtype=torch.float16, device=device, requires_grad=True)
    bias = torch.zeros(1, device=device, requires_grad=True)
    mirage.ops.subpixel_shuffle(x, bias).sum().backward()
    assert bias.grad.dtype == torch.float32 and bias.grad.item() == 4 * 256 * 256
    assert x.grad.dtype == torch.float16


def test_subpixel_weight_sums_in_float32_under_autocast():
    weight = randn(6, 5, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        folded = mirage.ops.subpixel_weight(weight)
    assert folded.dtype == torch.float32
    torch.testing.assert_close(folded, mirage.ops.subpixel_weight(weight), atol=0, rtol=0)


def test_subpixel_weight_keeps_dtype_and_layout():
    weight = randn(6, 5, 3, 3).half().contiguous(memory_format=torch.channels_last)
    folded = mirage.ops.subpixel_weight(weight)
    assert folded.shape == (24, 5, 2, 2) and folded.dtype == torch.float16
    assert folded.is_contiguous(memory_format=torch.channels_last)
    # Parity (1, 1)'s bottom-right tap reads only the 3x3 kernel's bottom-right tap.
    assert torch.equal(folded[18:, :, 1, 1], weight[:, :, 2, 2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck(device, requires_grad, with_bias):
    x = randn(2, 12, 4, 3, device=device).requires_grad_(requires_grad)
    bias = randn(3, device=device).requires_grad_(requires_grad) if with_bias else None
    torch.library.opcheck(torch.ops.mirage.subpixel_shuffle.default, (x, bias))


def test_gradcheck():
    x = randn(2, 12, 4, 3, dtype=torch.float64).requires_grad_()
    bias = randn(3, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(mirage.ops.subpixel_shuffle, (x, bias))
    assert torch.autograd.gradgradcheck(mirage.ops.subpixel_shuffle, (x, bias))
    weight = randn(3, 2, 3, 3, dtype=torch.float64).requires_grad_()
    image = randn(1, 2, 3, 4, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda i, w, b: subpixel_upsample_conv(i, w, b), (image, weight, bias))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    x = randn(2, 32, 5, 6, device=device)
    bias = randn(8, device=device)
    compiled = torch.compile(mirage.ops.subpixel_shuffle, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    torch.testing.assert_close(compiled(x, bias), composite(x, bias), **tolerance(torch.float32))
    x2 = randn(2, 32, 5, 6, device=device)
    torch.testing.assert_close(compiled(x2, bias), composite(x2, bias), **tolerance(torch.float32))


@pytest.mark.cuda
def test_cuda_graph_replays_new_inputs():
    x = randn(2, 64, 9, 9, dtype=torch.float16, device="cuda").contiguous(memory_format=torch.channels_last)
    bias = randn(16, device="cuda")
    graph, out = capture_graph(lambda: mirage.ops.subpixel_shuffle(x, bias))
    for _ in range(2):
        x.copy_(randn(2, 64, 9, 9, dtype=torch.float16, device="cuda"))
        graph.replay()
        assert torch.equal(out, mirage.ops.subpixel_shuffle(x, bias))
        assert_matches(out, composite, (x, bias), torch.float16)


# ----------------------------------------------------------------------------------------------
# mirage.nn.Upsample2D

diffusers_upsampling = pytest.importorskip("diffusers.models.upsampling")
DiffusersUpsample2D = diffusers_upsampling.Upsample2D


def diffusers_block(**config):
    torch.manual_seed(1)
    config.setdefault("use_conv", True)
    return DiffusersUpsample2D(8, **config).double()


@pytest.mark.parametrize("config", [{}, dict(out_channels=6), dict(bias=False), dict(name="Conv2d_0"),
                                    dict(norm_type="ln_norm", eps=1e-5, elementwise_affine=True)])
@pytest.mark.parametrize("output_size", [None, "twice", (11, 15)])
def test_upsample2d_matches_diffusers(config, output_size):
    block = diffusers_block(**config)
    fused = mirage.nn.Upsample2D.from_diffusers(copy.deepcopy(block))
    assert sorted(fused.state_dict()) == sorted(block.state_dict())
    x = randn(2, 8, 5, 7, dtype=torch.float64)
    size = (10, 14) if output_size == "twice" else output_size
    with torch.no_grad():
        torch.testing.assert_close(fused(x, size), block(x, size), **tolerance(torch.float64))


@pytest.mark.parametrize(
    "config,reason",
    [
        (dict(use_conv=False), "no convolution follows the upsampling"),
        (dict(use_conv_transpose=True), "a transposed convolution upsamples by itself"),
        (dict(interpolate=False), "interpolate=False"),
        (dict(kernel_size=5, padding=2), "is not a plain 3x3 nn.Conv2d"),
        (dict(padding=0), "is not a plain 3x3 nn.Conv2d"),
    ],
)
def test_upsample2d_refuses_other_configurations(config, reason):
    with pytest.raises(ValueError, match=reason):
        mirage.nn.Upsample2D.from_diffusers(diffusers_block(**config))


def test_upsample2d_refuses_wrong_channels():
    fused = mirage.nn.Upsample2D.from_diffusers(diffusers_block())
    with pytest.raises(ValueError, match=r"mirage.nn.Upsample2D: hidden_states must be \(N, 8, H, W\), got \(2, 4, 3, 3\)"):
        fused(torch.randn(2, 4, 3, 3, dtype=torch.float64))


def test_upsample2d_refolds_after_in_place_and_replacing_changes():
    block = diffusers_block()
    fused = mirage.nn.Upsample2D.from_diffusers(copy.deepcopy(block))
    x = randn(1, 8, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        fused(x)
        folded = fused._folded
        state = {k: v * 1.5 for k, v in block.state_dict().items()}
        block.load_state_dict(state)
        fused.load_state_dict(state)  # in place: the same tensor is refolded
        torch.testing.assert_close(fused(x), block(x), **tolerance(torch.float64))
        assert fused._folded is folded
        fused.float()  # replaced: a new tensor
        assert fused._folded is None  # dropped with the conversion, not left on the old device
        torch.testing.assert_close(fused(x.float()), block.float()(x.float()), **tolerance(torch.float32))
        # A new Parameter (assign=True) is refolded, whatever its address and version.
        state = {k: v.float() * 0.5 for k, v in block.state_dict().items()}
        block.load_state_dict(state)
        fused.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
        torch.testing.assert_close(fused(x.float()), block(x.float()), **tolerance(torch.float32))
        # Writes through .data escape the version counter: seen after a forced refresh.
        block.conv.weight.data += 1
        fused.conv.weight.data += 1
        fused.refresh_derived_weights(force=True)
        torch.testing.assert_close(fused(x.float()), block(x.float()), **tolerance(torch.float32))
    copy.deepcopy(fused)  # the folded kernels are a plain tensor, no autograd graph
    assert not fused._folded.requires_grad


def test_upsample2d_keeps_its_folded_kernels_through_a_conversion_that_changes_nothing():
    """accelerate's offload calls .to(device) before every forward, and OptimizedModule keeps its
    CUDA graphs through one that leaves the weights where they are: the graphs read the folded
    kernels at their address, so those must stay too (they were dropped, and the graphs kept
    replaying from freed memory)."""
    fused = mirage.nn.Upsample2D.from_diffusers(diffusers_block())
    x = randn(1, 8, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        fused(x)
        folded = fused._folded
        fused.to("cpu")
        fused.double()
        fused(x)
        assert fused._folded is folded
        fused.float()
        assert fused._folded is None  # converted: folded again at the next call


@pytest.mark.parametrize("assign", [False, True])
def test_optimized_graphs_follow_weights_loaded_by_the_wrapper(assign):
    """load_state_dict on the optimized model: in place, its graphs stay (and read the new values);
    with assign=True the parameters are new tensors, so graphs captured reading the old ones go."""
    optimized = mirage.optimize(torch.nn.Sequential(DiffusersUpsample2D(8, use_conv=True)), dtype=torch.float32,
                                cuda_graph=False, verbose=False)
    optimized.graphs = mirage.graphs.GraphCache(optimized._run, 2, capture=GraphStandIn, new_pool=object,
                                                verbose=False)
    x = randn(2, 8, 3, 5)
    with torch.no_grad():
        optimized(x)
        optimized.load_state_dict({k: v * 2 for k, v in optimized.state_dict().items()}, assign=assign)
        held = len(optimized.graphs)
        optimized(x)
    stats = optimized.graphs.stats()
    # Released by assign=True (then paused: the model is off CUDA here), kept and replayed in place.
    assert (held, stats.misses, stats.hits) == ((0, 1, 0) if assign else (1, 1, 1))


def test_upsample2d_pickles_after_a_call():
    # torch.save of a model: the folded kernels' weakref cannot be pickled; they are folded again.
    fused = mirage.nn.Upsample2D.from_diffusers(diffusers_block())
    x = randn(2, 8, 5, 7, dtype=torch.float64)
    with torch.no_grad():
        expected = fused(x)  # folds the kernels
        buffer = io.BytesIO()
        torch.save(fused, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        torch.testing.assert_close(loaded(x), expected, rtol=0, atol=0)


def test_upsample2d_with_a_replaced_convolution_runs_it():
    # A LoRA wrapper (or any module) in place of the convolution: its weight is not what it
    # computes, so the module interpolates and calls it, as diffusers does.
    class Wrapped(torch.nn.Module):
        def __init__(self, conv):
            super().__init__()
            self.base = conv
            self.weight = conv.weight

        def forward(self, x):
            return self.base(x) + 1.0

    block = diffusers_block()
    fused = mirage.nn.Upsample2D.from_diffusers(copy.deepcopy(block))
    fused.conv = Wrapped(fused.conv)
    block.conv = Wrapped(block.conv)
    x = randn(1, 8, 3, 4, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), block(x), **tolerance(torch.float64))


def test_upsample2d_built_under_inference_mode():
    # Weights made under torch.inference_mode have no version counter (optimize(dtype=None)
    # keeps them as they are).
    with torch.inference_mode():
        model = torch.nn.Sequential(DiffusersUpsample2D(8, use_conv=True))
        reference = copy.deepcopy(model)
        optimized = mirage.optimize(model, dtype=None, verbose=False)
        x = randn(2, 8, 3, 3)
        got = optimized(x)
        assert got.dtype == torch.float16  # autocast on the CPU
        torch.testing.assert_close(got.float(), reference(x), atol=2e-2, rtol=2e-2)


def test_optimized_module_refreshes_and_compiles():
    model = torch.nn.Sequential(DiffusersUpsample2D(8, use_conv=True))
    reference = copy.deepcopy(model)
    optimized = mirage.optimize(model, dtype=torch.float32, verbose=False)
    x = randn(2, 8, 3, 5)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), reference(x), **tolerance(torch.float32))
        for m in (reference, optimized.module):
            m[0].conv.weight.mul_(-2)  # in place: the next call refolds
        torch.testing.assert_close(optimized(x), reference(x), **tolerance(torch.float32))
        compiled = torch.compile(optimized, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x), reference(x), **tolerance(torch.float32))


def test_upsample2d_gradients_reach_the_3x3_weight():
    block = diffusers_block()
    fused = mirage.nn.Upsample2D.from_diffusers(copy.deepcopy(block))
    x = randn(2, 8, 3, 4, dtype=torch.float64)
    grad = randn(2, 8, 6, 8, dtype=torch.float64)
    fused(x).backward(grad)
    block(x).backward(grad)
    for name, parameter in fused.named_parameters():
        torch.testing.assert_close(parameter.grad, dict(block.named_parameters())[name].grad)


@pytest.mark.cuda
def test_optimized_graph_replay_sees_weights_loaded_in_place():
    torch.manual_seed(2)
    model = torch.nn.Sequential(DiffusersUpsample2D(16, use_conv=True)).cuda()
    reference = copy.deepcopy(model).half()
    optimized = mirage.optimize(model, verbose=False)
    assert mirage.report(optimized).counts == {"Upsample2D": 1}
    x = randn(2, 16, 6, 6, dtype=torch.float16, device="cuda", mean=0.0, std=1.0)
    with torch.no_grad():
        assert_close_fp16 = dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(optimized(x), reference(x), **assert_close_fp16)
        state = {k: v * 0.5 - 0.1 for k, v in reference.state_dict().items()}
        reference.load_state_dict(state)
        optimized.module.load_state_dict(state)
        torch.testing.assert_close(optimized(x), reference(x), **assert_close_fp16)
    assert mirage.report(optimized).graphs.misses == 1  # the second call replayed the first graph


def test_upsample2d_compiles_fullgraph():
    # Under torch.compile the 2x2 kernels are folded inside the graph (no cache to consult).
    block = diffusers_block()
    fused = mirage.nn.Upsample2D.from_diffusers(copy.deepcopy(block))
    x = randn(2, 8, 5, 7, dtype=torch.float64)
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), block(x), **tolerance(torch.float64))


@pytest.mark.parametrize("device", DEVICES)
def test_shuffle_backward_keeps_neither_input(device):
    # Linear in both: the backward reads their shapes only (it kept both, x an image).
    inputs = (randn(2, 12, 4, 5, device=device), randn(3, device=device))
    assert_backward_reads_no_value_of(mirage.ops.subpixel_shuffle, composite, inputs, unread=[0, 1])
