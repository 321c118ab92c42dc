"""mirage::cfconv (SchNet's continuous-filter convolution with the filter network fused in),
mirage::radial_cfconv (the same from the distances) and their backwards, against plain PyTorch."""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mirage
import mirage.ff
from mirage.ff.precision import matmul_precision
from common import (DEVICES, FF_ACTIVATIONS, OpCounter, ZERO_FILLS, assert_error, assert_first_order_only,
                    capture_graph, energy_forces_and_ops, strided)
from tolerances import REDUCTION_ERROR_FACTOR, tolerance

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

# name: (N, P, R, H, M, activation, biases, receiver-sorted pairs). The CUDA kernels take H == M of
# 64 or 128: schnet is the benchmark's filter network over several 64-pair tiles and a partial
# one, many_tiles* over more tiles than blocks; narrow the 64-wide kernels, unsorted pairs (one
# atomic per pair) and no biases; tiny a single short tile with one basis function. odd runs on the CPU only (H != M, widths that are no
# multiple of 4).
CONFIGS = {
    "schnet": (40, 700, 20, 128, 128, "shifted_softplus", True, True),
    # More tiles than an H200's 132 blocks of two teams take at once (each team loops over several).
    "many_tiles": (3000, 40077, 20, 128, 128, "shifted_softplus", True, True),
    "many_tiles_64": (500, 17021, 12, 64, 64, "softplus", True, True),
    "narrow": (17, 300, 7, 64, 64, "silu", False, False),
    "tiny": (5, 3, 1, 64, 64, "tanh", True, True),
    "gelu_relu": (9, 200, 33, 128, 128, "gelu", True, True),
    "relu": (9, 150, 64, 64, 64, "relu", True, False),
    "no_pairs": (4, 0, 20, 128, 128, "shifted_softplus", True, True),
    # Hopper's kernels (H == M == 128, R <= 23): the most basis functions they take, no biases,
    # unsorted pairs over several tiles; a single basis function.
    "hopper_widest_basis": (50, 1000, 23, 128, 128, "gelu", False, False),
    "hopper_one_basis": (9, 77, 1, 128, 128, "tanh", True, True),
    "odd": (7, 41, 3, 5, 6, "softplus", True, False),
}
CUDA_CONFIGS = [name for name in CONFIGS if name != "odd"]


def make_inputs(name, device="cpu", dtype=torch.float64, for_cfconv=True):
    """(x, basis, envelope, pairs, weight1, bias1, weight2, bias2, activation); the last fifth of the
    pairs is the neighbor list's padding: pair (0, 0) with envelope 0. On CUDA, for cfconv, skips
    the sizes this GPU's shared memory does not take."""
    n, p, r, h, m, activation, biases, sort = CONFIGS[name]
    if for_cfconv and str(device).startswith("cuda") and name in CUDA_CONFIGS and \
            not mirage.ops.cfconv_supported(r, h, m, "cuda"):
        # Width 128 needs 147-205 KiB a block: an A100 has 163 KiB, an sm_86/sm_89 GPU 99 KiB.
        pytest.skip(f"this GPU's shared memory does not hold cfconv's operands at R={r}, H=M={m}")
    pairs = torch.randint(0, n, (2, p))
    if sort:
        pairs = pairs[:, torch.argsort(pairs[0], stable=True)]
    envelope = torch.rand(p, dtype=torch.float64) * 0.9 + 0.1
    pairs[:, p - p // 5:] = 0
    envelope[p - p // 5:] = 0.0
    x = torch.randn(n, m, dtype=torch.float64)
    basis = torch.rand(p, r, dtype=torch.float64)
    weight1 = torch.randn(h, r, dtype=torch.float64) * 2 / math.sqrt(r)
    weight2 = torch.randn(m, h, dtype=torch.float64) / math.sqrt(h)
    bias1 = torch.randn(h, dtype=torch.float64) * 0.5 if biases else None
    if biases and "softplus" in activation:
        bias1[::4] += 25.0  # past softplus' threshold of 20, where it is the identity
    bias2 = torch.randn(m, dtype=torch.float64) * 0.5 if biases else None

    def to(t):
        return None if t is None else t.to(device=device, dtype=dtype)
    return (to(x), to(basis), to(envelope), pairs.to(device), to(weight1), to(bias1), to(weight2), to(bias2),
            activation)


def cfconv_composite(x, basis, envelope, pairs, weight1, bias1, weight2, bias2, activation):
    """docs/ops.md's definition in plain PyTorch."""
    filters = F.linear(FF_ACTIVATIONS[activation](F.linear(basis, weight1, bias1)), weight2, bias2)
    messages = x[pairs[1]] * filters * envelope[:, None]
    return torch.zeros_like(x).index_add_(0, pairs[0], messages)


def grads_of(function, args, grad_out):
    """(out, d out.grad_out / d (x, basis, envelope)) of function(*args)."""
    leaves = [args[k].detach().requires_grad_(True) for k in range(3)]
    out = function(*leaves, *args[3:])
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    return [out.detach()] + [torch.zeros_like(a) if g is None else g for g, a in zip(grads, leaves)]


def tf32_matmuls(allow):
    return matmul_precision("tf32" if allow else "fp32")


def max_error(got, ref):
    return (got.double() - ref).abs().max().item() if ref.numel() else 0.0


@pytest.fixture(params=["default", "portable"])
def cfconv_kernels(request, monkeypatch):
    """Runs a CUDA test with the kernels mirage picks for the GPU (Hopper's wgmma ones on an
    H100/H200 where the sizes allow) and with the portable ones (MIRAGE_CFCONV_PORTABLE=1)."""
    if request.param == "portable":
        monkeypatch.setenv("MIRAGE_CFCONV_PORTABLE", "1")
    return request.param


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float64), ("cpu", torch.float32),
                                           pytest.param("cuda", torch.float32, marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cfconv_matches_composite(device, dtype, name, cfconv_kernels):
    """Output and the three gradients. float32 (on CUDA with the operands split into two TF32
    parts): within a small factor of PyTorch's own float32 error against float64 (TF32 off)."""
    if device == "cuda" and name not in CUDA_CONFIGS:
        pytest.skip("the CUDA kernels take H == M of 64 or 128")
    if device == "cpu" and cfconv_kernels == "portable":
        pytest.skip("a choice of CUDA kernels")
    args = make_inputs(name, device, dtype)
    if device == "cpu":  # CUDA's float atomics add in any order: runs need not agree to the bit
        torch.library.opcheck(torch.ops.mirage.cfconv.default, (*args, False))
    grad_out = torch.randn_like(args[0])
    got = grads_of(lambda *a: mirage.ops.cfconv(*a, tf32=False), args, grad_out)
    args64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ref = grads_of(cfconv_composite, args64, grad_out.double())
    for g, r in zip(got, ref):
        assert g.dtype == dtype and g.shape == r.shape
    if dtype == torch.float64:
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, **tolerance(dtype))
        return
    with tf32_matmuls(False):
        theirs = grads_of(cfconv_composite, args, grad_out)
    for what, g, t, r in zip(("out", "grad_x", "grad_basis", "grad_envelope"), got, theirs, ref):
        scale = r.abs().max().item() if r.numel() else 0.0
        bound = REDUCTION_ERROR_FACTOR * max_error(t, r) + tolerance(dtype)["atol"] * max(scale, 1.0)
        assert max_error(g, r) <= bound, \
            (name, what, max_error(g, r), max_error(t, r), scale)


@pytest.mark.cuda
@pytest.mark.parametrize("name, hopper_sizes", [("schnet", True), ("hopper_widest_basis", True),
                                                ("gelu_relu", False), ("narrow", False)])
def test_cfconv_kernel_choice(name, hopper_sizes, cfconv_kernels):
    """Which kernels run (by name, from the profiler): Hopper's forward and backward where the GPU
    is an H100/H200 (9.0), the build has sm_90a and the sizes fit (H == M == 128, R <= 23),
    unless MIRAGE_CFCONV_PORTABLE=1; the portable ones otherwise. The other CUDA tests run under
    both choices."""
    from mirage.info import build_info

    hopper = (hopper_sizes and cfconv_kernels == "default" and torch.cuda.get_device_capability() == (9, 0)
              and "90a" in build_info()["cuda_archs"])
    args = make_inputs(name, "cuda", torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        grads_of(lambda *a: mirage.ops.cfconv(*a, tf32=False), args, torch.randn_like(args[0]))
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "cfconv" in e.name]
    forward = [n for n in names if "cfconv_kernel" in n]
    backward = [n for n in names if "cfconv_backward_kernel" in n]
    assert forward and backward, names
    assert all(("sm90::" in n) == hopper for n in forward + backward), (hopper, names)


@pytest.mark.cuda
def test_cfconv_tf32(cfconv_kernels):
    """tf32=True rounds the operands once: errors of TF32's size (10-bit mantissa), clearly above
    the default's and within a TF32 bound, in the output and the gradients; tf32=None follows
    PyTorch's float32 matmul setting."""
    args = make_inputs("schnet", "cuda", torch.float32)
    args64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    grad_out = torch.randn_like(args[0])
    ref = grads_of(cfconv_composite, args64, grad_out.double())

    def run(tf32):
        return grads_of(lambda *a: mirage.ops.cfconv(*a, tf32=tf32), args, grad_out)

    split, tf32 = run(False), run(True)
    for s, t, r in zip(split, tf32, ref):
        scale = r.abs().max().item()
        assert max_error(s, r) < 1e-5 * scale
        assert 10 * max_error(s, r) < max_error(t, r) < 1e-2 * scale
    for allow, want in ((True, tf32), (False, split)):
        with tf32_matmuls(allow):
            assert mirage.ops.tf32_matmuls() == allow
            followed = run(None)
        for f, w in zip(followed, want):
            torch.testing.assert_close(f, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())


def test_tf32_matmuls_reads_torchs_setting():
    for allow in (True, False, True):
        with tf32_matmuls(allow):
            assert mirage.ops.tf32_matmuls() == allow


def test_compiled_code_follows_the_tf32_setting():
    """torch.compile takes tf32_matmuls and cfconv_supported as constants of the graph (it
    cannot trace their C calls); the TF32 one stays right because dynamo guards its graphs on
    the setting: flipping it recompiles, flipping it back finds the first graph again."""
    from torch._dynamo.testing import CompileCounter

    def choose(x):
        supported = mirage.ops.cfconv_supported(20, 128, 128, x.device)
        return x * 2 if supported and mirage.ops.tf32_matmuls() else x * 3

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(choose, backend=counter, fullgraph=True)
    x = torch.ones(3)
    for allow, compiles in ((False, 1), (True, 2), (False, 2), (True, 2)):
        with tf32_matmuls(allow):
            torch.testing.assert_close(compiled(x), choose(x))
            assert compiled(x)[0].item() == (2.0 if allow else 3.0)
        assert counter.frame_count == compiles


def test_cfconv_gradcheck():
    x, basis, envelope, pairs, w1, b1, w2, b2, activation = make_inputs("odd")
    for t in (x, basis, envelope):
        t.requires_grad_(True)
    torch.autograd.gradcheck(
        lambda x, basis, envelope: mirage.ops.cfconv(x, basis, envelope, pairs, w1, b1, w2, b2, activation),
        (x, basis, envelope))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
# Without and with biases. On CUDA opcheck compares calls bit for bit nearly: few receivers per
# warp keep the float atomics' order from moving the last bits (tiny: one warp).
@pytest.mark.parametrize("name", ["narrow", "tiny"])
def test_cfconv_opcheck(device, requires_grad, name):
    dtype = torch.float32 if device == "cuda" else torch.float64
    args = make_inputs(name, device, dtype)
    for k in range(3):
        args[k].requires_grad_(requires_grad)
    torch.library.opcheck(torch.ops.mirage.cfconv.default, args)
    out, filters = torch.ops.mirage.cfconv(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
    x, basis, envelope, pairs, w1, b1, w2, _, activation = args
    backward_args = (torch.randn_like(out), x.detach(), basis.detach(), envelope.detach(), pairs, filters, w1, b1,
                     w2, activation)
    torch.library.opcheck(torch.ops.mirage.cfconv_backward.default, backward_args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cast", ["x and weight2", "all"])
def test_cfconv_runs_in_float32_under_autocast(device, cast):
    # x and the second weight in bfloat16, as a Linear under autocast hands them over; or every
    # floating input (biases included) in bfloat16.
    args = list(make_inputs("schnet", device, torch.float32))
    for k in (0, 6) if cast == "x and weight2" else (0, 1, 2, 4, 5, 6, 7):
        args[k] = args[k].bfloat16()
    upcast = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    x = args[0].requires_grad_(True)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = mirage.ops.cfconv(x, *args[1:])
    assert out.dtype == torch.float32
    x32 = upcast[0].requires_grad_(True)
    expected = mirage.ops.cfconv(x32, *upcast[1:])
    torch.testing.assert_close(out, expected)  # float32's tolerance: the same float32 kernel
    grad_out = torch.randn_like(out)
    (grad_x,) = torch.autograd.grad(out, x, grad_out)
    (expected_grad,) = torch.autograd.grad(expected, x32, grad_out)
    assert grad_x.dtype == torch.bfloat16
    torch.testing.assert_close(grad_x, expected_grad.bfloat16())


@pytest.mark.parametrize("device", DEVICES)
def test_cfconv_backward_fills_no_filters_gradient(device):
    # The filters output has no gradient: autograd must not write a [P, M] tensor of zeros for it
    # (a Function's default; ~20 us an interaction at 3,000 atoms on an H200).
    args = list(make_inputs("schnet", device, torch.float32))
    x = args[0].requires_grad_(True)
    out = mirage.ops.cfconv(x, *args[1:])
    with OpCounter() as ops:
        torch.autograd.grad(out.sum(), x)
    assert "mirage.cfconv_backward" in ops.calls
    assert not ZERO_FILLS & set(ops.calls), ops.calls


@pytest.mark.parametrize("device", DEVICES)
def test_cfconv_filters_output_is_the_filter_network(device):
    dtype = torch.float32 if device == "cuda" else torch.float64
    x, basis, envelope, pairs, w1, b1, w2, b2, activation = make_inputs("narrow", device, dtype)
    _, filters = torch.ops.mirage.cfconv(x, basis, envelope, pairs, w1, b1, w2, b2, activation)
    with tf32_matmuls(False):
        want = F.linear(FF_ACTIVATIONS[activation](F.linear(basis, w1, b1)), w2, b2)
    torch.testing.assert_close(filters, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_cfconv_strided_inputs(device):
    dtype = torch.float32 if device == "cuda" else torch.float64
    args = list(make_inputs("schnet", device, dtype))
    want = mirage.ops.cfconv(*args)
    for k in (0, 1, 2, 4, 5, 6, 7):
        args[k] = strided(args[k])
    # Not bitwise on CUDA: float atomics add in whatever order the blocks reach them.
    torch.testing.assert_close(mirage.ops.cfconv(*args), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.cuda
def test_cfconv_cuda_unaligned_inputs(cfconv_kernels):
    """Rows start 4 bytes off a 16-byte boundary: the op copies them to aligned storage."""
    args = list(make_inputs("schnet", "cuda", torch.float32))
    grad_out = torch.randn_like(args[0])
    want = grads_of(mirage.ops.cfconv, args, grad_out)
    for k in (0, 6):  # x and weight2 (float4 rows)
        shifted = torch.empty(args[k].numel() + 1, device="cuda")[1:].view_as(args[k]).copy_(args[k])
        assert shifted.data_ptr() % 16 != 0
        args[k] = shifted
    got = grads_of(mirage.ops.cfconv, args, grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_cfconv_cuda_graph_replays_new_inputs(cfconv_kernels):
    """Forward and backward in one graph; new inputs and new pairs between replays."""
    args = list(make_inputs("schnet", "cuda", torch.float32))
    static = [args[k].clone() for k in range(4)]
    grad_out = torch.randn_like(args[0])
    graph, outputs = capture_graph(lambda: grads_of(mirage.ops.cfconv, static + args[4:], grad_out))
    for _ in range(3):
        for s, a in zip(static[:3], args[:3]):
            s.copy_(a * (1 + 0.1 * torch.rand_like(a)))
        static[3].copy_(args[3][:, torch.randperm(args[3].shape[1], device="cuda")])
        graph.replay()
        # Not bitwise: float atomics add in whatever order the blocks reach them.
        for got, want in zip(outputs, grads_of(mirage.ops.cfconv, static + args[4:], grad_out)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(want.abs().max().item(), 1.0))


@pytest.mark.parametrize("device", DEVICES)
def test_cfconv_compile_fullgraph_matches_eager(device):
    dtype = torch.float32 if device == "cuda" else torch.float64
    args = make_inputs("narrow", device, dtype)

    def interaction(x, basis, envelope):  # tf32=None: PyTorch's setting, read at compile time
        return F.silu(mirage.ops.cfconv(x * 2, basis, envelope, *args[3:])).sum()

    compiled = torch.compile(interaction, fullgraph=True)
    for scale in (1.0, 0.5):
        x, basis, envelope = (a * scale for a in args[:3])
        torch.testing.assert_close(compiled(x, basis, envelope), interaction(x, basis, envelope), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_cfconv_non_finite_basis_reaches_its_receiver_only(device, value):
    """As in PyTorch, a non-finite basis value makes its receiver's row non-finite and no other
    (on CUDA an Inf may come out as NaN: docs/ops.md)."""
    dtype = torch.float32 if device == "cuda" else torch.float64
    args = list(make_inputs("narrow", device, dtype))
    n = args[0].shape[0]
    args[1] = args[1].clone()
    args[1][0, 0] = value  # pair 0's basis
    out = mirage.ops.cfconv(*args)
    receiver = args[3][0, 0].item()
    assert not torch.isfinite(out[receiver]).all()
    assert torch.isfinite(out[[i for i in range(n) if i != receiver]]).all()
    want = cfconv_composite(*args)
    assert (torch.isfinite(out) == torch.isfinite(want)).all()


# ---- gradients it does not give ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_cfconv_refuses_parameter_gradients_and_double_backward(device):
    dtype = torch.float32 if device == "cuda" else torch.float64
    x, basis, envelope, pairs, w1, b1, w2, b2, activation = make_inputs("narrow", device, dtype)
    w2.requires_grad_(True)
    basis.requires_grad_(True)
    out = mirage.ops.cfconv(x, basis, envelope, pairs, w1, b1, w2, b2, activation).square().sum()
    assert_first_order_only(out, basis, "no gradient in the filter network's parameters")


# ---- num_pairs: neighbor_list's padding skipped ------------------------------------------------

def cfconv_with_count(args, count, order=None):
    """(out, filters, grad_x, grad_basis, grad_envelope) of torch.ops.mirage.cfconv with num_pairs
    = count (None: without), the gradients of out . g for a fixed g."""
    leaves = [a.detach().requires_grad_() for a in args[:3]]
    num_pairs = None if count is None else torch.tensor([count], device=args[0].device)
    out, filters = torch.ops.mirage.cfconv(*leaves, *args[3:], False, order, num_pairs)
    grad_out = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view_as(out)
    return [out.detach(), filters, *torch.autograd.grad(out, leaves, grad_out)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["schnet", "many_tiles", "many_tiles_64"])  # list order; sender order from 8,192 pairs
@pytest.mark.parametrize("given_order", [False, True])
def test_cfconv_num_pairs_skips_the_padding(device, name, given_order, cfconv_kernels):
    """make_inputs' last fifth is neighbor_list's padding (pairs (0, 0), envelope 0): with its
    count the op skips it. The sums and the other pairs' values are those of the full list (the
    padding adds nothing there), the skipped pairs' filters and gradients are 0; a negative count
    or one past P (neighbor_list's NaN and overflow cases) walks every pair."""
    if device == "cpu" and (cfconv_kernels == "portable" or name == "many_tiles"):
        pytest.skip("a choice of CUDA kernels" if cfconv_kernels == "portable" else "CPU time")
    args = make_inputs(name, device, torch.float32)
    pairs, P = args[3], args[3].shape[1]
    count = P - P // 5
    order = mirage.ops.sender_order(pairs, args[0].shape[0], torch.tensor([count], device=device)) if given_order \
        else None
    full = cfconv_with_count(args, None)
    got = cfconv_with_count(args, count, order)
    # The same sums, in float32 atomics' order on CUDA.
    close = {} if device == "cpu" else dict(rtol=1e-4, atol=1e-4)
    for what, g, f in zip(("out", "filters", "grad_x", "grad_basis", "grad_envelope"), got, full):
        per_pair = what not in ("out", "grad_x")
        torch.testing.assert_close(g[:count] if per_pair else g, f[:count] if per_pair else f, **close, msg=what)
        if per_pair:
            assert torch.equal(g[count:], torch.zeros_like(g[count:])), what
    for every_pair in (-1, P, P + 7):
        for what, g, f in zip(("out", "filters", "grad_x", "grad_basis", "grad_envelope"),
                              cfconv_with_count(args, every_pair), full):
            torch.testing.assert_close(g, f, **close, msg=f"{what} with num_pairs={every_pair}")


@pytest.mark.cuda
def test_cfconv_cuda_order_formed_without_the_count_turns_the_gradients_nan(cfconv_kernels):
    # An order whose positions before the count do not hold the pairs before it (the padding,
    # sender 0, sits among sender 0's pairs) would make the walk stop short: its check fails.
    args = make_inputs("many_tiles", "cuda", torch.float32)
    P = args[3].shape[1]
    order = mirage.ops.sender_order(args[3], args[0].shape[0])
    got = cfconv_with_count(args, P - P // 5, order)
    assert torch.isfinite(got[0]).all()
    assert all(torch.isnan(g).all() for g in got[2:])


def test_cfconv_num_pairs_opcheck():
    args = make_inputs("narrow")
    torch.library.opcheck(torch.ops.mirage.cfconv.default, (*args, False, None, torch.tensor([250])))


@pytest.mark.parametrize("device", DEVICES)
def test_cfconv_bad_num_pairs(device):
    args = make_inputs("narrow", device, torch.float32 if device == "cuda" else torch.float64)
    for count, message in ((torch.tensor([3], dtype=torch.int32),
                            "one int64 (neighbor_list's count), got Int of shape [1]"),
                           (torch.tensor([3, 4]), "one int64 (neighbor_list's count), got Long of shape [2]"),
                           (torch.tensor([3], device="meta"), f"on pairs' device ({args[3].device}), got meta")):
        on = count if count.is_meta else count.to(device)
        assert_error(lambda d: torch.ops.mirage.cfconv(*args, False, None, on), device,
                     "mirage::cfconv: num_pairs must be " + message)


# ---- bad input --------------------------------------------------------------------------------

def _call(device, **changes):
    dtype = torch.float32 if device == "cuda" else torch.float64
    names = ["x", "basis", "envelope", "pairs", "weight1", "bias1", "weight2", "bias2", "activation"]
    args = dict(zip(names, make_inputs("narrow", device, dtype)))
    args["bias1"] = torch.zeros_like(args["weight1"][:, 0])
    args["bias2"] = torch.zeros_like(args["weight2"][:, 0])
    for key, change in changes.items():
        args[key] = change(args[key])
    return mirage.ops.cfconv(**args)


BAD = [
    (dict(x=lambda t: t.half()), "x must be float32 (or float64 off the GPU)"),
    (dict(x=lambda t: t[None]), "x must be 2-D [N, M]"),
    (dict(basis=lambda t: t.float() if t.dtype == torch.float64 else t.double()), "basis must have x's dtype"),
    (dict(basis=lambda t: t[:, :-1]), "basis must have shape [P, R] = [300, 7]"),
    (dict(envelope=lambda t: t[:-1]), "envelope must have shape [P] = [300]"),
    (dict(pairs=lambda t: t.int()), "pairs must be an int64 tensor of shape [2, P]"),
    (dict(pairs=lambda t: t[:1]), "pairs must be an int64 tensor of shape [2, P]"),
    (dict(weight1=lambda t: t[0]), "weight1 must be 2-D [H, R]"),
    (dict(weight2=lambda t: t[:, :-1]), "weight2 must have shape [M, H] = [64, 64]"),
    (dict(bias1=lambda t: t[:-1]), "bias1 must have shape [64]"),
    (dict(bias2=lambda t: t[:3]), "bias2 must have shape [64]"),
    (dict(bias1=lambda t: t.float() if t.dtype == torch.float64 else t.double()), "bias1 must have x's dtype"),
    (dict(activation=lambda a: "swish"), "activation \"swish\" is not one of"),
    (dict(x=lambda t: t[:0]), "x has no rows (N=0) for pairs to index"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("changes, message", BAD)
def test_cfconv_bad_input(device, changes, message):
    assert_error(lambda d: _call(d, **changes), device, "mirage::cfconv: " + message)


def test_cfconv_backward_bad_input_and_not_differentiable():
    x, basis, envelope, pairs, w1, b1, w2, b2, activation = make_inputs("narrow")
    out, filters = torch.ops.mirage.cfconv(x, basis, envelope, pairs, w1, b1, w2, b2, activation)
    with pytest.raises(RuntimeError, match=r"mirage::cfconv_backward: grad must have x's dtype"):
        torch.ops.mirage.cfconv_backward(out.float(), x, basis, envelope, pairs, filters, w1, b1, w2, activation, False)
    with pytest.raises(RuntimeError, match=r"mirage::cfconv_backward: filters must have x's dtype"):
        torch.ops.mirage.cfconv_backward(out, x, basis, envelope, pairs, filters.float(), w1, b1, w2, activation,
                                         False)
    grad = out.clone().requires_grad_(True)
    grads = torch.ops.mirage.cfconv_backward(grad, x, basis, envelope, pairs, filters, w1, b1, w2, activation, False)
    with pytest.raises(RuntimeError, match="cfconv_backward"):
        grads[0].sum().backward()
    with pytest.raises(RuntimeError, match=r"mirage::cfconv_backward: grad must have x's shape"):
        torch.ops.mirage.cfconv_backward(out[:-1], x, basis, envelope, pairs, filters, w1, b1, w2, activation, False)
    with pytest.raises(RuntimeError, match=r"mirage::cfconv_backward: filters must have shape \[P, M\]"):
        torch.ops.mirage.cfconv_backward(out, x, basis, envelope, pairs, filters[:, :-1], w1, b1, w2, activation,
                                         False)


def test_cfconv_cpu_checks_indices():
    with pytest.raises(RuntimeError, match=r"mirage::cfconv: pairs.*17"):
        _call("cpu", pairs=lambda t: t.clone().index_fill_(1, torch.tensor([3]), 17))


@pytest.mark.cuda
# list order, sender order (the bad sender last): 64 wide, then Hopper's sizes
@pytest.mark.parametrize("name", ["narrow", "many_tiles_64", "schnet", "many_tiles"])
def test_cfconv_cuda_bad_indices_give_nan(name, cfconv_kernels):
    args = list(make_inputs(name, "cuda", torch.float32))
    args[3] = args[3].clone()
    args[3][1, 5] = args[0].shape[0]  # one past the last node
    for k in range(3):
        args[k].requires_grad_(True)
    out = mirage.ops.cfconv(*args)
    assert torch.isnan(out).all()
    grads = torch.autograd.grad(out.sum(), args[:3])
    assert all(torch.isnan(g).all() for g in grads)


@pytest.mark.cuda
def test_cfconv_cuda_sizes_it_does_not_take():
    args = list(make_inputs("odd", "cuda", torch.float32))
    assert not mirage.ops.cfconv_supported(3, 5, 6, "cuda")
    with pytest.raises(RuntimeError, match="mirage::cfconv: the CUDA kernels take a filter network with H == M"):
        mirage.ops.cfconv(*args)
    # Width 64 with one basis function (63 KiB of shared memory) fits every GPU from sm_80 on.
    assert mirage.ops.cfconv_supported(1, 64, 64, "cuda") and mirage.ops.cfconv_supported(3, 5, 6, "cpu")


@pytest.mark.cuda
def test_cfconv_cuda_node_limit():
    x = torch.zeros(1, 64, device="cuda").expand(2**31, 64)  # no memory behind the rows
    args = list(make_inputs("narrow", "cuda", torch.float32))
    args[1], args[2], args[3] = args[1][:0], args[2][:0], args[3][:, :0]
    with pytest.raises(RuntimeError, match=r"mirage::cfconv: at most 2\^31 - 2 nodes on CUDA"):
        mirage.ops.cfconv(x, *args[1:])


@pytest.mark.cuda
def test_cfconv_backward_cuda_device_mismatch():
    x, basis, envelope, pairs, w1, b1, w2, b2, activation = make_inputs("narrow", "cuda", torch.float32)
    out, filters = torch.ops.mirage.cfconv(x, basis, envelope, pairs, w1, b1, w2, b2, activation)
    with pytest.raises(RuntimeError, match=r"mirage::cfconv_backward: grad must be on x's device"):
        torch.ops.mirage.cfconv_backward(out.cpu(), x, basis, envelope, pairs, filters, w1, b1, w2, activation, False)


@pytest.mark.cuda
def test_cfconv_cuda_device_mismatch():
    assert_error(lambda d: _call(d, basis=lambda t: t.cpu()), "cuda", "mirage::cfconv: basis must be on x's device")
    assert_error(lambda d: _call(d, pairs=lambda t: t.cpu()), "cuda", "mirage::cfconv: pairs must be on x's device")


# ---- mirage::radial_cfconv: the basis and envelope formed from the distances ----------------------

# name (sizes from CONFIGS): (basis, envelope). CUDA takes M a multiple of 4 (not "odd").
RADIAL = {
    "schnet": ("gaussian", "cosine"),
    "many_tiles": ("gaussian", "cosine"),
    "hopper_widest_basis": ("bessel", "polynomial"),
    "hopper_one_basis": ("gaussian", "cosine"),
    "no_pairs": ("bessel", "cosine"),
    "narrow": ("bessel", "cosine"),
    "tiny": ("bessel", "polynomial"),
    "odd": ("gaussian", "polynomial"),
}
RADIAL_CUDA = [name for name in RADIAL if name != "odd"]
RADIAL_CUTOFF = 5.0


def radial_inputs(name, device="cpu", dtype=torch.float64):
    """(x, distances, pairs, weight1, bias1, weight2, bias2, activation, basis, cutoff, envelope):
    make_inputs' network and pairs, distances in [0.3, 1.1 cutoff) (some past it) and, for the
    last fifth (the neighbor list's padding), at the cutoff."""
    x, _, _, pairs, w1, b1, w2, b2, activation = make_inputs(name, device, dtype, for_cfconv=False)
    p = pairs.shape[1]
    distances = torch.rand(p, dtype=torch.float64) * (1.1 * RADIAL_CUTOFF - 0.3) + 0.3
    distances[p - p // 5:] = RADIAL_CUTOFF
    return (x, distances.to(device=device, dtype=dtype), pairs, w1, b1, w2, b2, activation, *RADIAL[name][:1],
            RADIAL_CUTOFF, RADIAL[name][1])


def envelope_composite(d, fn, cutoff):
    x = d / cutoff
    if fn == "cosine":
        return torch.where(d < cutoff, 0.5 * (torch.cos(math.pi * x) + 1), 0.0)
    if fn == "polynomial":
        return torch.where(d < cutoff, 1 - 28 * x**6 + 48 * x**7 - 21 * x**8, 0.0)
    return torch.ones_like(d)


def radial_filters_composite(d, w1, b1, w2, b2, activation, basis, cutoff, envelope):
    from test_radial_basis import composite as basis_composite

    b = basis_composite(d, basis, w1.shape[1], cutoff, "none")
    filters = F.linear(FF_ACTIVATIONS[activation](F.linear(b, w1, b1)), w2, b2)
    return filters * envelope_composite(d, envelope, cutoff)[:, None]


def radial_cfconv_composite(x, d, pairs, w1, b1, w2, b2, activation, basis, cutoff, envelope):
    """docs/ops.md's definition: cfconv of the basis and envelope of the distances, in plain PyTorch."""
    messages = x[pairs[1]] * radial_filters_composite(d, w1, b1, w2, b2, activation, basis, cutoff, envelope)
    return torch.zeros_like(x).index_add_(0, pairs[0], messages)


def radial_grads_of(function, args, grad_out):
    """(out, d out.grad_out / d x, d out.grad_out / d distances) of function(*args)."""
    x, d = (args[k].detach().requires_grad_(True) for k in range(2))
    out = function(x, d, *args[2:])
    return (out.detach(), *torch.autograd.grad(out, (x, d), grad_out))


def table_filters(table, d, cutoff, slope=False):
    """The filters (or their derivatives in d) that radial_cfconv's table gives at distances d:
    piece floor(d K / c), Horner's rule in s = d K / c - piece; 0 from the cutoff on."""
    table, d = table.double(), d.double()
    intervals = table.shape[0]
    u = d.clamp(min=0) * (intervals / cutoff)
    piece = u.floor().clamp(max=intervals - 1)
    s = (u - piece)[:, None]
    c = table[piece.long()]
    f = torch.zeros_like(c[:, 0])
    for q in range(5, 0 if slope else -1, -1):
        f = f * s + c[:, q] * (q if slope else 1)
    f = f * (intervals / cutoff) if slope else f
    return torch.where((d < cutoff)[:, None], f, 0.0)


def radial_cfconv_of(*args):
    return mirage.ops.radial_cfconv(*args)


# The table's interpolation error against the network in float64, relative to the largest
# filter (derivative): the tests' weights are larger than trained ones (W1 ~ 2 randn / sqrt(R)).
# It peaks at the shortest distances drawn (0.3 A, where the Bessel basis of 23 functions is
# steepest): up to 2.3e-8 over 240 seeds of hopper_widest_basis (1e-8 failed about one run in a
# hundred); elsewhere under 1e-9. Still 200 times below the float32 tolerances.
RADIAL_TABLE_ERROR = 1e-7


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float64), ("cpu", torch.float32),
                                           pytest.param("cuda", torch.float32, marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", sorted(RADIAL))
def test_radial_cfconv_matches_composite(device, dtype, name):
    """Output, both gradients, and the table's filters and distance derivatives at the pairs
    (against forward-mode AD of the composite); float32 within a small factor of PyTorch's own
    float32 error against float64, float64 within the table's interpolation error."""
    if device == "cuda" and name not in RADIAL_CUDA:
        pytest.skip("the CUDA kernels take M a multiple of 4")
    args = radial_inputs(name, device, dtype)
    grad_out = torch.randn_like(args[0])
    got = radial_grads_of(radial_cfconv_of, args, grad_out)
    table = torch.ops.mirage.radial_cfconv(*args)[1]
    assert table.dtype == dtype and table.shape[1:] == (6, args[0].shape[1])
    filters, derivatives = (table_filters(table, args[1], RADIAL_CUTOFF, slope) for slope in (False, True))
    args64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ref = radial_grads_of(radial_cfconv_composite, args64, grad_out.double())
    with torch.autograd.forward_ad.dual_level():  # each filter depends on its own distance only
        dual = torch.autograd.forward_ad.make_dual(args64[1], torch.ones_like(args64[1]))
        ref_filters, ref_derivatives = torch.autograd.forward_ad.unpack_dual(
            radial_filters_composite(dual, *args64[3:]))
    with tf32_matmuls(False):
        theirs = radial_grads_of(radial_cfconv_composite, args, grad_out)
    for what, g, t, r in zip(("out", "grad_x", "grad_distances", "filters", "derivatives"),
                             (*got, filters, derivatives), (*theirs, None, None),
                             (*ref, ref_filters, ref_derivatives)):
        assert g.shape == r.shape, what
        if dtype == torch.float64:
            scale = r.abs().max().item() if r.numel() else 0.0
            assert max_error(g, r) <= RADIAL_TABLE_ERROR * max(scale, 1.0), (name, what, max_error(g, r), scale)
            continue
        assert g.dtype == dtype or what in ("filters", "derivatives"), what
        scale = r.abs().max().item() if r.numel() else 0.0
        floor = tolerance(dtype)["atol"] * max(scale, 1.0)
        bound = floor if t is None else REDUCTION_ERROR_FACTOR * max_error(t, r) + floor
        assert max_error(g, r) <= bound, (name, what, max_error(g, r), bound, scale)


def test_radial_cfconv_table_of_the_trained_schnet_is_within_float32_rounding():
    """The table radial_cfconv builds (float32 coefficients, as CUDA keeps them) for each filter
    network of the trained benzene SchNet, against the network in float64 at 20,000 distances:
    values and distance derivatives within 1e-7 of their largest (float32 rounding of the values
    alone is ~5e-8 here)."""
    from forcefield.train_student import STUDENT_PATHS, load_student

    student, _ = load_student(STUDENT_PATHS["schnet"])
    d = torch.rand(20000, dtype=torch.float64) * RADIAL_CUTOFF
    for layer in student.interactions:
        first, second = layer.filter[0], layer.filter[2]
        weights = (first.weight, first.bias, second.weight, second.bias)
        table = torch.ops.mirage.radial_cfconv(torch.zeros(1, second.out_features), torch.ones(1),
                                               torch.zeros(2, 1, dtype=torch.long), *weights, "shifted_softplus",
                                               "gaussian", RADIAL_CUTOFF, "cosine")[1]
        assert table.dtype == torch.float32 and table.shape == (1024, 6, second.out_features)
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(d, torch.ones_like(d))
            value, slope = torch.autograd.forward_ad.unpack_dual(radial_filters_composite(
                dual, *(w.detach().double() for w in weights), "shifted_softplus", "gaussian", RADIAL_CUTOFF, "cosine"))
        for got, want in ((table_filters(table, d, RADIAL_CUTOFF), value),
                          (table_filters(table, d, RADIAL_CUTOFF, slope=True), slope)):
            assert max_error(got, want) <= 1e-7 * want.abs().max().item()


def test_radial_cfconv_gradcheck():
    x, d, *rest = radial_inputs("odd")
    torch.autograd.gradcheck(lambda x, d: mirage.ops.radial_cfconv(x, d, *rest),
                             (x.requires_grad_(True), d.requires_grad_(True)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_radial_cfconv_opcheck(device):
    dtype = torch.float32 if device == "cuda" else torch.float64
    # One short tile on CUDA: few receivers a warp keep the float atomics' order from moving bits.
    args = list(radial_inputs("hopper_one_basis", device, dtype))
    args[2] = args[2][:, :8]
    args[1] = args[1][:8]
    for requires_grad in (False, True):
        args[0].requires_grad_(requires_grad)
        args[1].requires_grad_(requires_grad)
        torch.library.opcheck(torch.ops.mirage.radial_cfconv.default, tuple(args))
    out, table = torch.ops.mirage.radial_cfconv(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
    torch.library.opcheck(torch.ops.mirage.radial_cfconv_backward.default,
                          (torch.randn_like(out), args[0].detach(), args[1].detach(), args[2], table, RADIAL_CUTOFF))


@pytest.mark.cuda
@pytest.mark.parametrize("width", [4, 64, 200])
@pytest.mark.parametrize("num_pairs", [50, 9000])
def test_radial_cfconv_backward_cuda_matches_the_reference(width, num_pairs):
    """The backward kernel (any M a multiple of 4) on a random table against the float64 CPU
    reference: a short list walked in its own order, a long one (past pair_order.cuh's 8,192) in
    sender order; unsorted pairs, so runs of equal senders come from the order alone; widths over
    and under a warp's 128 columns; distances past the cutoff among them.

    A random table is not continuous where pieces meet, so the distances keep 1% of a piece away
    from the pieces' ends and the cutoff: float32's rounding of d or d K / c there could pick the
    neighbouring piece, whose filter differs by O(1): the likely cause of this test's one failure,
    on an H200 on 2026-11-30 (distances drawn uniformly then), a row of grad_x 3.9 off."""
    n, intervals = 300, 37
    pairs = torch.randint(0, n, (2, num_pairs))
    x, grad = torch.randn(n, width, dtype=torch.float64), torch.randn(n, width, dtype=torch.float64)
    piece = torch.randint(0, intervals + 4, (num_pairs,), dtype=torch.float64)  # the last 4: past the cutoff
    piece[:4] = intervals + torch.arange(4.0, dtype=torch.float64)  # some past it in every draw
    distances = (piece + 0.01 + 0.98 * torch.rand(num_pairs, dtype=torch.float64)) * RADIAL_CUTOFF / intervals
    # Coefficient q of a real table is ~ h^q F^(q) / q!: small past the first (a random one's
    # second derivative would make float32's rounding of s = d K / c an error of ~1e-3).
    scale = 0.05 ** torch.arange(6.0, dtype=torch.float64)[:, None]
    table = torch.randn(intervals, 6, width, dtype=torch.float64) * scale
    backward = torch.ops.mirage.radial_cfconv_backward
    ref = backward(grad, x, distances, pairs, table, RADIAL_CUTOFF)
    got = backward(*(t.to("cuda", torch.float32) if t.is_floating_point() else t.cuda()
                     for t in (grad, x, distances, pairs, table)), RADIAL_CUTOFF)
    for g, r in zip(got, ref):  # float32 sums of up to ~60 products
        torch.testing.assert_close(g.double().cpu(), r, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_radial_cfconv_runs_in_float32_under_autocast(device):
    args = list(radial_inputs("schnet", device, torch.float32))
    low = [a.bfloat16() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    with torch.autocast(device, dtype=torch.bfloat16):
        out = mirage.ops.radial_cfconv(*low)
    assert out.dtype == torch.float32
    upcast = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in low]
    torch.testing.assert_close(out, mirage.ops.radial_cfconv(*upcast))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_radial_cfconv_strided_inputs_and_no_zero_fills(device):
    dtype = torch.float32 if device == "cuda" else torch.float64
    args = list(radial_inputs("schnet", device, dtype))
    want = mirage.ops.radial_cfconv(*args)
    for k in (0, 1, 3, 4, 5, 6):
        args[k] = strided(args[k])
    got = mirage.ops.radial_cfconv(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    x = args[0].detach().requires_grad_(True)
    out = mirage.ops.radial_cfconv(x, *args[1:])
    with OpCounter() as ops:
        torch.autograd.grad(out.sum(), x)
    assert "mirage.radial_cfconv_backward" in ops.calls
    assert not ZERO_FILLS & set(ops.calls), ops.calls


@pytest.mark.parametrize("device", DEVICES)
def test_radial_cfconv_refuses_parameter_gradients_and_double_backward(device):
    dtype = torch.float32 if device == "cuda" else torch.float64
    x, d, pairs, w1, b1, w2, b2, *rest = radial_inputs("schnet", device, dtype)
    w1.requires_grad_(True)
    d.requires_grad_(True)
    out = mirage.ops.radial_cfconv(x, d, pairs, w1, b1, w2, b2, *rest).square().sum()
    assert_first_order_only(out, d, "no gradient in the filter network's parameters")


def _radial_call(device, **changes):
    dtype = torch.float32 if device == "cuda" else torch.float64
    names = ["x", "distances", "pairs", "weight1", "bias1", "weight2", "bias2", "activation", "basis", "cutoff",
             "envelope"]
    args = dict(zip(names, radial_inputs("schnet", device, dtype)))
    for key, change in changes.items():
        args[key] = change(args[key])
    return mirage.ops.radial_cfconv(**args)


RADIAL_BAD = [
    (dict(x=lambda t: t.half()), "x must be float32 (or float64 off the GPU)"),
    (dict(distances=lambda t: t[:-1]), "distances must have shape [P] = [700] (P from pairs)"),
    (dict(distances=lambda t: t[:, None]), "distances must have shape [P] = [700]"),
    (dict(distances=lambda t: t.float() if t.dtype == torch.float64 else t.double()),
     "distances must have x's dtype"),
    (dict(pairs=lambda t: t.int()), "pairs must be an int64 tensor of shape [2, P]"),
    (dict(weight2=lambda t: t[:, :-1]), "weight2 must have shape [M, H] = [128, 128]"),
    (dict(bias1=lambda t: t[:-1]), "bias1 must have shape [128]"),
    (dict(activation=lambda a: "swish"), "activation \"swish\" is not one of"),
    (dict(activation=lambda a: "relu"), "activation \"relu\" is not smooth, and the filters' table interpolates"),
    (dict(basis=lambda a: "chebyshev"), "basis must be \"gaussian\" or \"bessel\", got \"chebyshev\""),
    (dict(basis=lambda a: "none"), "basis must be \"gaussian\" or \"bessel\", got \"none\""),
    (dict(envelope=lambda a: "smooth"), "cutoff_fn must be \"cosine\", \"polynomial\" or \"none\""),
    (dict(envelope=lambda a: "none"), "envelope must be \"cosine\" or \"polynomial\" (the filters' table covers"),
    (dict(cutoff=lambda c: -1.0), "cutoff must be finite and > 0"),
    (dict(cutoff=lambda c: 1e200), "cutoff must be finite and > 0, in float32's normal range"),  # NaN tables before
    (dict(x=lambda t: t[:0]), "x has no rows (N=0) for pairs to index"),
    # The table's pieces grow with R (a count past 2^58 once made their doubling loop run for ever).
    (dict(weight1=lambda t: t[:, :1].expand(-1, 2**50)), "weight1 must have at most 1024 columns R"),
]


@pytest.mark.parametrize("device", DEVICES + ["meta"])
@pytest.mark.parametrize("changes, message", RADIAL_BAD)
def test_radial_cfconv_bad_input(device, changes, message):
    assert_error(lambda d: _radial_call(d, **changes), device, "mirage::radial_cfconv: " + message)


def test_radial_cfconv_backward_bad_input_and_not_differentiable():
    x, d, pairs, *rest = radial_inputs("narrow")
    out, table = torch.ops.mirage.radial_cfconv(x, d, pairs, *rest)
    backward = torch.ops.mirage.radial_cfconv_backward
    c = RADIAL_CUTOFF
    for args, message in [((out.float(), x, d, pairs, table, c), "grad must have x's dtype"),
                          ((out[:-1], x, d, pairs, table, c), "grad must have x's shape"),
                          ((out, x, d[:-1], pairs, table, c), r"distances must have shape \[P\] = \[300\]"),
                          ((out, x, d, pairs, table[:, :5], c), r"table must have shape \[intervals, 6, M\]"),
                          ((out, x, d, pairs, table[..., :-1], c), r"table must have shape \[intervals, 6, M\]"),
                          ((out, x, d, pairs, table, -1.0), "cutoff must be finite and > 0"),
                          ((out, x, d, pairs[:1], table, c), "pairs must be an int64 tensor")]:
        with pytest.raises(RuntimeError, match="mirage::radial_cfconv_backward: " + message):
            backward(*args)
    grad = out.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="radial_cfconv_backward"):
        backward(grad, x, d, pairs, table, c)[0].sum().backward()


def test_radial_cfconv_cpu_checks_indices():
    with pytest.raises(RuntimeError, match=r"mirage::radial_cfconv: pairs.*700"):
        _radial_call("cpu", pairs=lambda t: t.clone().index_fill_(1, torch.tensor([3]), 700))


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["schnet", "many_tiles"])  # list order; sender order
def test_radial_cfconv_cuda_bad_indices_give_nan(name):
    args = list(radial_inputs(name, "cuda", torch.float32))
    args[2] = args[2].clone()
    args[2][1, 5] = args[0].shape[0]  # one past the last node
    x, d = args[0].requires_grad_(True), args[1].requires_grad_(True)
    out = mirage.ops.radial_cfconv(*args)
    assert torch.isnan(out).all()
    assert all(torch.isnan(g).all() for g in torch.autograd.grad(out.sum(), (x, d)))


@pytest.mark.parametrize("device", DEVICES)
def test_radial_cfconv_nan_and_negative_distances_give_nan(device):
    """A NaN or negative distance gives its receiver's row NaN, as the network's NaN filters would;
    the other rows stay finite."""
    dtype = torch.float32 if device == "cuda" else torch.float64
    args = list(radial_inputs("schnet", device, dtype))
    args[1] = args[1].clone()
    args[1][3], args[1][4] = float("nan"), -0.5
    out = mirage.ops.radial_cfconv(*args)
    bad = torch.zeros(out.shape[0], dtype=torch.bool, device=device)
    bad[args[2][0, 3:5]] = True
    assert torch.isnan(out[bad]).all() and torch.isfinite(out[~bad]).all()


def test_radial_cfconv_supported_follows_the_tables_bound_on_every_device():
    assert mirage.ops.radial_cfconv_supported(1024, 8, 8, "cpu")
    assert not mirage.ops.radial_cfconv_supported(1025, 8, 8, "cpu")  # the op would refuse it
    for sizes in [(0, 8, 8), (8, 0, 8), (8, 8, -1)]:  # no filter network at all
        assert not mirage.ops.radial_cfconv_supported(*sizes, "cpu") and not mirage.ops.cfconv_supported(*sizes, "cpu")


@pytest.mark.cuda
def test_radial_cfconv_cuda_sizes_it_does_not_take():
    args = list(radial_inputs("odd", "cuda", torch.float32))
    assert not mirage.ops.radial_cfconv_supported(3, 5, 6, "cuda")
    message = r"mirage::radial_cfconv: the CUDA kernels take M \(x's columns\) a multiple of 4"
    with pytest.raises(RuntimeError, match=message):
        mirage.ops.radial_cfconv(*args)
    assert mirage.ops.radial_cfconv_supported(3, 5, 6, "cpu")
    # About 77 KiB of shared memory (216 (R + H) + 45,000 bytes): every GPU from sm_80 on.
    assert mirage.ops.radial_cfconv_supported(20, 128, 128, "cuda")


@pytest.mark.cuda
def test_radial_cfconv_cuda_graph_replays_new_inputs():
    args = list(radial_inputs("schnet", "cuda", torch.float32))
    x, d = args[0].clone(), args[1].clone()
    graph, out = capture_graph(lambda: mirage.ops.radial_cfconv(x, d, *args[2:]))
    for _ in range(2):  # new inputs and new weights: the replay builds the table again
        x.copy_(torch.randn_like(x))
        d.copy_(torch.rand_like(d) * RADIAL_CUTOFF)
        args[5].mul_(1.5)  # weight2
        graph.replay()
        want = mirage.ops.radial_cfconv(x, d, *args[2:])
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


# ---- the fused SchNet takes it in eval mode beyond the one-kernel limit -------------------------

def fused_schnet_beyond_the_whole_model_limits():
    """(model, numbers, positions): the fused reference SchNet and 60 atoms (~40 neighbours each),
    whose neighbor capacity is past SchNet.whole_model_max_pairs."""
    from forcefield.models import SchNet

    torch.manual_seed(0)
    model = mirage.ff.optimize(SchNet().cuda())
    n = 60
    numbers = torch.randint(1, 9, (n,), device="cuda")
    positions = (torch.rand(n, 3, device="cuda") * 9.0).requires_grad_(True)
    return model, numbers, positions


def interaction_op(model):
    """The op the fused SchNet's interactions run as on this GPU in eval mode."""
    supported = mirage.ops.radial_cfconv_supported(model.num_rbf, 128, 128, "cuda")
    return "mirage.radial_cfconv" if model.radial_interactions and supported else "mirage.cfconv"


@pytest.mark.cuda
@pytest.mark.parametrize("radial", [True, False])
def test_fused_schnet_eval_mode_runs_cfconv_with_the_same_forces(cfconv_kernels, radial):
    if radial and cfconv_kernels == "portable":
        pytest.skip("a choice of cfconv's kernels")
    model, numbers, positions = fused_schnet_beyond_the_whole_model_limits()
    model.radial_interactions = radial
    op = interaction_op(model)
    layered_energy, layered_forces, layered_ops = energy_forces_and_ops(model, numbers, positions, True)
    energy, forces, calls = energy_forces_and_ops(model, numbers, positions, False)
    assert model.max_pairs > model.whole_model_max_pairs
    assert calls.count(op) == len(model.interactions) and op not in layered_ops
    assert op + "_backward" in calls
    scale = layered_forces.abs().max().item()
    torch.testing.assert_close(energy, layered_energy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(forces, layered_forces, rtol=1e-4, atol=1e-5 * scale)
    model.fused_interactions = False
    _, _, calls = energy_forces_and_ops(model, numbers, positions, False)
    assert "mirage.cfconv" not in calls and "mirage.radial_cfconv" not in calls


@pytest.mark.cuda
def test_fused_schnet_keeps_its_float32_kernels_under_autocast():
    # bf16-mixed: the atom-wise Linears in bfloat16, the interactions' cfconv in float32 (its
    # autocast policy) instead of the layers' bfloat16 filters; forces within bfloat16's error.
    model, numbers, positions = fused_schnet_beyond_the_whole_model_limits()
    reference_energy, reference_forces, _ = energy_forces_and_ops(model, numbers, positions, False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        energy, forces, calls = energy_forces_and_ops(model, numbers, positions, False)
    op = interaction_op(model)
    assert model.max_pairs > model.whole_model_max_pairs
    assert calls.count(op) == len(model.interactions) and op + "_backward" in calls
    assert "mirage.message_passing" not in calls
    scale = reference_forces.abs().max().item()
    torch.testing.assert_close(forces.float(), reference_forces, rtol=0, atol=5e-2 * scale)
    torch.testing.assert_close(energy.float(), reference_energy, rtol=2e-2, atol=1e-2)
    # Within the whole-model limits the float32 whole-model op runs under autocast too: fp32's results.
    small = positions[:12].detach().clone().requires_grad_(True)
    model.max_pairs = None  # the next call sizes it for 12 atoms
    energy32, forces32, _ = energy_forces_and_ops(model, numbers[:12], small, False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        energy, forces, calls = energy_forces_and_ops(model, numbers[:12], small, False)
    assert model.max_pairs <= model.whole_model_max_pairs
    assert "mirage.schnet_energy_all_pairs" in calls and "mirage.cfconv" not in calls
    assert "mirage.radial_cfconv" not in calls
    torch.testing.assert_close(energy, energy32)
    torch.testing.assert_close(forces, forces32)


@pytest.mark.cuda
def test_fused_schnet_compiles_with_fullgraph():
    """The eval-mode choices (cfconv_supported, the TF32 setting) do not break the graph: energy
    and forces through the compiled model. Parameters frozen (docs/ff.md): AOTAutograd traces a
    backward for every input that requires grad, and cfconv refuses parameter gradients."""
    from forcefield.models import SchNet

    torch.manual_seed(0)
    model = mirage.ff.optimize(SchNet().cuda()).eval().requires_grad_(False)
    n = 60
    numbers = torch.randint(1, 9, (n,), device="cuda")
    positions = (torch.rand(n, 3, device="cuda") * 9.0).requires_grad_(True)
    assert model._interaction_op(positions) in ("radial_cfconv", "cfconv")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    for function in (model, compiled):
        energy = function(numbers, positions)
        forces, = torch.autograd.grad(-energy, positions)
        if function is model:
            expected = energy.detach(), forces
    torch.testing.assert_close(energy.detach(), expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(forces, expected[1], rtol=1e-4, atol=1e-5 * expected[1].abs().max().item())
