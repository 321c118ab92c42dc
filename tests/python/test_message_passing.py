import pytest
import torch

import mirage
from common import DEVICES, DTYPES, assert_error, assert_matches, capture_graph, opcheck, randn, strided

# (N, F, P): one node, one feature, no pairs; odd widths (3, 7, 129: the scalar path on CUDA) and
# 128 (the vector path); benzene's sizes; more pairs than nodes squared (repeats guaranteed).
SHAPES = [(1, 1, 0), (1, 1, 5), (1, 3, 1), (7, 7, 20), (12, 128, 132), (5, 129, 40), (33, 3, 200),
          (4, 16, 64)]


def message_passing_composite(x, w, pairs):
    """docs/ops.md's definition in plain torch (float64 in the tests)."""
    return torch.zeros_like(x).index_add_(0, pairs[0], x[pairs[1]] * w)


def pair_product_composite(a, b, pairs):
    return a[pairs[0]] * b[pairs[1]]


def random_pairs(n, p, device="cpu"):
    """[2, P] int64 in random order; with P > N^2 (or small N) pairs repeat."""
    return torch.randint(0, max(n, 1), (2, p), device=device)


def sorted_pairs(pairs):
    """The same pairs grouped by receiver, as neighbor_list returns them."""
    return pairs[:, torch.argsort(pairs[0], stable=True)]


def inputs(n, f, p, dtype=torch.float32, device="cpu"):
    return (randn(n, f, dtype=dtype, device=device), randn(p, f, dtype=dtype, device=device),
            random_pairs(n, p, device))


# ---- equivalence ------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("order", ["random", "sorted"])
def test_message_passing_matches_composite(device, dtype, shape, order):
    x, w, pairs = inputs(*shape, dtype=dtype, device=device)
    if order == "sorted":
        pairs = sorted_pairs(pairs)
    out = mirage.ops.message_passing(x, w, pairs)
    assert out.shape == x.shape
    assert_matches(out, message_passing_composite, (x, w, pairs), dtype)
    if device == "cpu":  # CUDA's float atomics add in any order: runs need not agree to the bit
        opcheck(torch.ops.mirage.message_passing.default, (x, w, pairs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_pair_product_matches_composite(device, dtype, shape):
    n, f, p = shape
    a, b, pairs = randn(n, f, dtype=dtype, device=device), randn(n, f, dtype=dtype, device=device), \
        random_pairs(n, p, device)
    out = mirage.ops.pair_product(a, b, pairs)
    assert out.shape == (p, f)
    assert_matches(out, pair_product_composite, (a, b, pairs), dtype)
    opcheck(torch.ops.mirage.pair_product.default, (a, b, pairs))


@pytest.mark.parametrize("device", DEVICES)
def test_pairs_from_neighbor_list(device):
    # The real input: receiver-sorted pairs with padding (0, 0) entries past num_pairs.
    pos = torch.rand(40, 3, device=device) * 6.0
    pairs, _, distances, num_pairs = mirage.ops.neighbor_list(pos, 2.5, max_pairs=40 * 39)
    assert 0 < int(num_pairs) < pairs.shape[1]  # padding present
    x = randn(40, 64, device=device)
    w = randn(pairs.shape[1], 64, device=device) * (distances < 2.5).unsqueeze(-1)
    assert_matches(mirage.ops.message_passing(x, w, pairs), message_passing_composite, (x, w, pairs),
                   torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_pair(device):
    # One pair P times: every message lands in one row, the others stay exactly zero.
    x, w = randn(5, 9, device=device), randn(50, 9, device=device)
    pairs = torch.tensor([[2], [3]], device=device).expand(2, 50)
    out = mirage.ops.message_passing(x, w, pairs)
    torch.testing.assert_close(out[2].double(), (x[3].double() * w.double()).sum(0), atol=1e-4, rtol=1e-5)
    assert (out[[0, 1, 3, 4]] == 0).all()
    assert_matches(mirage.ops.pair_product(x, x, pairs), pair_product_composite, (x, x, pairs),
                   torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES + [pytest.param(torch.float64, id="float64")])
def test_strided_inputs(device, dtype):
    if dtype == torch.float64 and device == "cuda":
        pytest.skip("float64 is CPU-only")
    n, f, p = 11, 24, 70
    x, w = strided(randn(n, f, dtype=dtype, device=device)), strided(randn(p, f, dtype=dtype, device=device))
    pairs = random_pairs(n, p, device).t().contiguous().t()  # [2, P] with strides (1, 2)
    assert not pairs.is_contiguous()
    assert_matches(mirage.ops.message_passing(x, w, pairs), message_passing_composite, (x, w, pairs), dtype)
    b = randn(f, n, dtype=dtype, device=device).t()  # transposed
    assert_matches(mirage.ops.pair_product(x, b, pairs), pair_product_composite, (x, b, pairs), dtype)


def test_float64_on_cpu():
    x, w, pairs = inputs(9, 5, 30, dtype=torch.float64)
    assert_matches(mirage.ops.message_passing(x, w, pairs), message_passing_composite, (x, w, pairs),
                   torch.float64)
    assert_matches(mirage.ops.pair_product(x, x * 2, pairs), pair_product_composite, (x, x * 2, pairs),
                   torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty(device, dtype):
    x, w, pairs = inputs(6, 4, 0, dtype=dtype, device=device)
    out = mirage.ops.message_passing(x, w, pairs)
    assert out.shape == (6, 4) and out.dtype == dtype and (out == 0).all()
    assert mirage.ops.pair_product(x, x, pairs).shape == (0, 4)
    x0, w0, pairs0 = inputs(0, 4, 0, dtype=dtype, device=device)
    assert mirage.ops.message_passing(x0, w0, pairs0).shape == (0, 4)
    assert mirage.ops.pair_product(x0, x0, pairs0).shape == (0, 4)
    xf, wf, pairsf = inputs(3, 0, 5, dtype=dtype, device=device)
    assert mirage.ops.message_passing(xf, wf, pairsf).shape == (3, 0)
    assert mirage.ops.pair_product(xf, xf, pairsf).shape == (5, 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_propagates(device, dtype):
    x, w = randn(6, 8, dtype=dtype, device=device), randn(4, 8, dtype=dtype, device=device)
    pairs = torch.tensor([[0, 1, 1, 4], [2, 3, 5, 0]], device=device)
    x[3, 5] = float("nan")   # sender of pair 1 (receiver 1)
    w[3, 2] = float("inf")   # pair 3 (receiver 4)
    out = mirage.ops.message_passing(x, w, pairs)
    assert torch.isnan(out[1, 5]) and torch.isinf(out[4, 2])
    others = torch.ones_like(out, dtype=torch.bool)
    others[1, 5] = others[4, 2] = False
    assert torch.isfinite(out[others]).all()
    prod = mirage.ops.pair_product(x, x, pairs)
    assert torch.isnan(prod[1, 5]) and torch.isfinite(prod[[0, 2, 3]]).all()


# ---- bad input --------------------------------------------------------------------------------

def _pairs(d, p=4, n=3):
    return torch.randint(0, n, (2, p), device=d)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda d: mirage.ops.message_passing(torch.rand(3, device=d), torch.rand(4, 3, device=d), _pairs(d)),
         "mirage::message_passing: x must be 2-D [N, F], got shape [3]"),
        (lambda d: mirage.ops.message_passing(torch.rand(3, 5, device=d), torch.rand(4, 5, 1, device=d), _pairs(d)),
         "mirage::message_passing: filter must be 2-D [P, F], got shape [4, 5, 1]"),
        (lambda d: mirage.ops.message_passing(torch.rand(3, 5, device=d), torch.rand(4, 6, device=d), _pairs(d)),
         "mirage::message_passing: filter must have shape [P, F] = [4, 5] (P from pairs, F from x), got [4, 6]"),
        (lambda d: mirage.ops.message_passing(torch.rand(3, 5, device=d), torch.rand(3, 5, device=d), _pairs(d)),
         "mirage::message_passing: filter must have shape [P, F] = [4, 5] (P from pairs, F from x), got [3, 5]"),
        (lambda d: mirage.ops.message_passing(torch.rand(3, 5, device=d), torch.rand(4, 5, device=d),
                                              _pairs(d).int()),
         "mirage::message_passing: pairs must be int64, got Int"),
        (lambda d: mirage.ops.message_passing(torch.rand(3, 5, device=d), torch.rand(4, 5, device=d),
                                              torch.zeros(3, 4, dtype=torch.long, device=d)),
         "mirage::message_passing: pairs must have shape [2, P], got [3, 4]"),
        (lambda d: mirage.ops.message_passing(torch.rand(3, 5, device=d), torch.rand(4, 5, device=d),
                                              torch.zeros(8, dtype=torch.long, device=d)),
         "mirage::message_passing: pairs must have shape [2, P], got [8]"),
        (lambda d: mirage.ops.message_passing(torch.rand(3, 5, device=d), torch.rand(4, 5, device=d).half(), _pairs(d)),
         "mirage::message_passing: filter must have x's dtype (Float), got Half"),
        (lambda d: mirage.ops.message_passing(torch.ones(3, 5, dtype=torch.long, device=d),
                                              torch.ones(4, 5, dtype=torch.long, device=d), _pairs(d)),
         "mirage::message_passing: x must be float32, float16 or bfloat16 (float64 off the GPU), got Long"),
        (lambda d: mirage.ops.message_passing(torch.rand(0, 5, device=d), torch.rand(4, 5, device=d), _pairs(d)),
         "mirage::message_passing: x has no rows (N=0) for pairs to index (P=4)"),
        (lambda d: mirage.ops.pair_product(torch.rand(3, device=d), torch.rand(3, device=d), _pairs(d)),
         "mirage::pair_product: a must be 2-D [N, F], got shape [3]"),
        (lambda d: mirage.ops.pair_product(torch.rand(3, 5, device=d), torch.rand(4, 5, device=d), _pairs(d)),
         "mirage::pair_product: b must have a's shape [3, 5], got [4, 5]"),
        (lambda d: mirage.ops.pair_product(torch.rand(3, 5, device=d), torch.rand(3, 5, device=d).bfloat16(), _pairs(d)),
         "mirage::pair_product: b must have a's dtype (Float), got BFloat16"),
        (lambda d: mirage.ops.pair_product(torch.ones(3, 5, dtype=torch.int32, device=d),
                                           torch.ones(3, 5, dtype=torch.int32, device=d), _pairs(d)),
         "mirage::pair_product: a must be float32, float16 or bfloat16 (float64 off the GPU), got Int"),
        (lambda d: mirage.ops.pair_product(torch.rand(3, 5, device=d), torch.rand(3, 5, device=d),
                                           _pairs(d).double()),
         "mirage::pair_product: pairs must be int64, got Double"),
        (lambda d: mirage.ops.pair_product(torch.rand(0, 5, device=d), torch.rand(0, 5, device=d), _pairs(d)),
         "mirage::pair_product: a has no rows (N=0) for pairs to index (P=4)"),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(call, message, device):
    assert_error(call, device, message)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda x, w, pairs: mirage.ops.message_passing(x, w, pairs),
         "mirage::message_passing: pairs[1, 2] = 6 is out of range for N=6 rows"),
        (lambda x, w, pairs: mirage.ops.pair_product(x, x, pairs),
         "mirage::pair_product: pairs[1, 2] = 6 is out of range for N=6 rows"),
    ],
)
def test_out_of_range_raises_on_cpu(call, message):
    x, w, pairs = inputs(6, 4, 5)
    pairs[1, 2] = 6
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(x, w, pairs)
    pairs[1, 2] = 0
    pairs[0, 4] = -1
    with pytest.raises(RuntimeError, match=r"pairs\[0, 4\] = -1 is out of range for N=6 rows"):
        call(x, w, pairs)


@pytest.mark.cuda
def test_cuda_device_mismatch_and_float64():
    x, w, pairs = inputs(3, 5, 4, device="cuda")
    with pytest.raises(RuntimeError, match=r"mirage::message_passing: filter must be on x's device \(cuda:0\), got cpu"):
        mirage.ops.message_passing(x, w.cpu(), pairs)
    with pytest.raises(RuntimeError, match=r"mirage::message_passing: pairs must be on x's device \(cuda:0\), got cpu"):
        mirage.ops.message_passing(x, w, pairs.cpu())
    with pytest.raises(RuntimeError, match=r"mirage::message_passing: filter must be on x's device \(cpu\), got cuda:0"):
        mirage.ops.message_passing(x.cpu(), w, pairs.cpu())
    with pytest.raises(RuntimeError, match=r"mirage::pair_product: b must be on a's device \(cuda:0\), got cpu"):
        mirage.ops.pair_product(x, x.cpu(), pairs)
    with pytest.raises(RuntimeError, match=r"mirage::pair_product: pairs must be on a's device \(cuda:0\), got cpu"):
        mirage.ops.pair_product(x, x, pairs.cpu())
    with pytest.raises(RuntimeError, match=r"mirage::message_passing: x must be float32, float16 or bfloat16"):
        mirage.ops.message_passing(x.double(), w.double(), pairs)
    with pytest.raises(RuntimeError, match=r"mirage::pair_product: a must be float32, float16 or bfloat16"):
        mirage.ops.pair_product(x.double(), x.double(), pairs)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", [3, 128])
def test_cuda_out_of_range_is_visible_and_in_bounds(dtype, f):
    # Graph-safe handling: no host read, no out-of-bounds access (an illegal address would fail
    # the synchronize), and a result that cannot be mistaken for a real one.
    n, p = 10, 60
    x = randn(n, f, dtype=dtype, device="cuda")
    w = randn(p, f, dtype=dtype, device="cuda")
    for bad in [n, n + 3, -1, -(2**40)]:
        pairs = sorted_pairs(random_pairs(n, p, "cuda"))
        pairs[1, 7] = bad
        pairs[0, 30] = bad
        out = mirage.ops.message_passing(x, w, pairs)
        assert torch.isnan(out).all()
        prod = mirage.ops.pair_product(x, x, pairs)
        assert torch.isnan(prod[[7, 30]]).all()
        keep = [q for q in range(p) if q not in (7, 30)]
        assert_matches(prod[keep], pair_product_composite, (x, x, pairs[:, keep]), dtype)
        torch.cuda.synchronize()  # an illegal access would surface here
    # A later valid call is unaffected (the flag lives in a fresh workspace).
    pairs = random_pairs(n, p, "cuda")
    assert_matches(mirage.ops.message_passing(x, w, pairs), message_passing_composite, (x, w, pairs), dtype)


# ---- autograd, opcheck, autocast, compile -----------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("shape", [(5, 7, 12), (1, 1, 0), (12, 128, 30)])
def test_opcheck(device, requires_grad, shape):
    x, w, pairs = inputs(*shape, device=device)
    x.requires_grad_(requires_grad)
    w.requires_grad_(requires_grad)
    torch.library.opcheck(torch.ops.mirage.message_passing.default, (x, w, pairs))
    torch.library.opcheck(torch.ops.mirage.pair_product.default, (x, x.detach() * 2, pairs))


@pytest.mark.parametrize("shape", [(5, 3, 17), (1, 2, 4), (6, 1, 0)])
def test_gradcheck_and_gradgradcheck(shape):
    n, f, p = shape
    x = randn(n, f, dtype=torch.float64).requires_grad_()
    w = randn(p, f, dtype=torch.float64).requires_grad_()
    b = randn(n, f, dtype=torch.float64).requires_grad_()
    pairs = random_pairs(n, p)
    mp = lambda x, w: mirage.ops.message_passing(x, w, pairs)  # noqa: E731
    pp = lambda a, b: mirage.ops.pair_product(a, b, pairs)  # noqa: E731
    assert torch.autograd.gradcheck(mp, (x, w))
    assert torch.autograd.gradgradcheck(mp, (x, w))
    assert torch.autograd.gradcheck(pp, (x, b))
    assert torch.autograd.gradgradcheck(pp, (x, b))


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_match_composite_and_use_the_ops(device):
    # Forces through message passing: E(pos) with filter = g(distances); first and second
    # derivatives against the same model written with index_add.
    n, f = 8, 6
    dtype = torch.float64 if device == "cpu" else torch.float32  # float64 is CPU-only
    tol = dict(atol=1e-10, rtol=1e-10) if device == "cpu" else dict(atol=1e-3, rtol=1e-3)
    pos = (torch.rand(n, 3, dtype=dtype, device=device) * 3).requires_grad_()
    pairs = torch.tensor([(i, j) for i in range(n) for j in range(n) if i != j], device=device).t()
    h = randn(n, f, dtype=dtype, device=device)
    centers = torch.linspace(0.5, 4, f, dtype=dtype, device=device)

    def energy(op):
        d = (pos[pairs[1]] - pos[pairs[0]]).norm(dim=-1, keepdim=True)
        w = torch.exp(-((d - centers) ** 2))
        return (op(h, w, pairs).tanh() * h).sum()

    ours, ref = energy(mirage.ops.message_passing), energy(message_passing_composite)
    (g_ours,) = torch.autograd.grad(ours, pos, create_graph=True)
    (g_ref,) = torch.autograd.grad(ref, pos, create_graph=True)
    torch.testing.assert_close(g_ours, g_ref, **tol)
    v = torch.randn_like(pos)
    (hv_ours,) = torch.autograd.grad((g_ours * v).sum(), pos)
    (hv_ref,) = torch.autograd.grad((g_ref * v).sum(), pos)
    torch.testing.assert_close(hv_ours, hv_ref, **tol)
    assert not torch.equal(hv_ours, torch.zeros_like(hv_ours))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradients_flow(device, dtype):
    x, w, pairs = inputs(7, 16, 30, dtype=dtype, device=device)
    x.requires_grad_()
    w.requires_grad_()
    mirage.ops.message_passing(x, w, pairs).sum().backward()
    assert x.grad.dtype == dtype and w.grad.dtype == dtype
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_runs_in_the_autocast_dtype(device):
    x, w, pairs = inputs(9, 12, 40, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = mirage.ops.message_passing(x, w, pairs)
        prod = mirage.ops.pair_product(x, x, pairs)
    assert out.dtype == torch.bfloat16 and prod.dtype == torch.bfloat16
    assert_matches(out, message_passing_composite, (x.bfloat16(), w.bfloat16(), pairs), torch.bfloat16)
    assert_matches(prod, pair_product_composite, (x.bfloat16(), x.bfloat16(), pairs), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()

    def interaction(x, w, pairs):
        m = mirage.ops.message_passing(x, w, pairs)
        return mirage.ops.pair_product(m, x, pairs).sum(-1)

    compiled = torch.compile(interaction, fullgraph=True)
    for _ in range(2):
        x, w, pairs = inputs(10, 32, 50, device=device)
        got, want = compiled(x, w, pairs), interaction(x, w, pairs)
        # On CUDA the float32 atomic sums land in any order, so two runs differ by a few units of
        # rounding of the sum of |terms| (one element at 1.5e-5 on an H200, past the table's 1e-5).
        magnitude = interaction(x.abs(), w.abs(), pairs)
        allowed = 1e-5 + 1.3e-6 * want.abs() + 8 * torch.finfo(torch.float32).eps * magnitude
        assert ((got - want).abs() <= allowed).all(), ((got - want).abs() - allowed).max().item()
        assert not torch.equal(got, torch.zeros_like(got))


# ---- CUDA only --------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,p", [(3000, 130_000), (12, 132)])
@pytest.mark.parametrize("order", ["random", "sorted"])
def test_cuda_real_sizes(dtype, n, p, order):
    x, w, pairs = inputs(n, 128, p, dtype=dtype, device="cuda")
    # About p / n messages per row: a filter scaled by 1 / sqrt(p / n) keeps the sums O(1), the
    # scale the tolerance table is made for (float32 atomics round at the partial sums' scale).
    w = (w.float() * (n / p) ** 0.5).to(dtype)
    if order == "sorted":
        pairs = sorted_pairs(pairs)
    assert_matches(mirage.ops.message_passing(x, w, pairs), message_passing_composite, (x, w, pairs), dtype)
    assert_matches(mirage.ops.pair_product(x, x, pairs), pair_product_composite, (x, x, pairs), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_misaligned_inputs_take_the_scalar_path(dtype):
    n, f, p = 20, 128, 90
    x = torch.empty(n * f + 1, dtype=dtype, device="cuda")[1:].view(n, f)  # 16-byte misaligned
    x.copy_(randn(n, f, dtype=dtype, device="cuda"))
    w = torch.empty(p * f + 1, dtype=dtype, device="cuda")[1:].view(p, f)
    w.copy_(randn(p, f, dtype=dtype, device="cuda"))
    pairs = random_pairs(n, p, "cuda")
    assert_matches(mirage.ops.message_passing(x, w, pairs), message_passing_composite, (x, w, pairs), dtype)
    assert_matches(mirage.ops.pair_product(x, w[:n], pairs), pair_product_composite, (x, w[:n], pairs), dtype)


@pytest.mark.cuda
def test_cuda_agrees_with_cpu_reference():
    x, w, pairs = inputs(50, 130, 600)
    for op, args in [(mirage.ops.message_passing, (x, w, pairs)), (mirage.ops.pair_product, (x, x, pairs))]:
        cpu = op(*args)
        gpu = op(*[a.cuda() for a in args])
        torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=2e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_graph_capture_and_replay(dtype):
    n, f, p = 40, 128, 300
    x, w, pairs = inputs(n, f, p, dtype=dtype, device="cuda")
    x.requires_grad_()
    w.requires_grad_()

    def step():
        out = mirage.ops.message_passing(x, w, pairs)
        grad_x, grad_w = torch.autograd.grad((out.float() ** 2).sum(), (x, w))
        return out.detach(), mirage.ops.pair_product(x.detach(), x.detach(), pairs), grad_x, grad_w

    graph, captured = capture_graph(step)
    for _ in range(3):
        with torch.no_grad():
            x.copy_(randn(n, f, dtype=dtype, device="cuda"))
            w.copy_(randn(p, f, dtype=dtype, device="cuda"))
            pairs.copy_(random_pairs(n, p, "cuda"))
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = step()
        # Atomics add in a different order each run: equal up to the dtype's rounding of the
        # largest value (a float16/bfloat16 output may round the other way, and its gradients with it).
        scale = 2e-5 if dtype == torch.float32 else 2e-2
        for got, want in zip(captured, expected):
            assert (got.float() - want.float()).abs().max() <= scale * want.float().abs().max()
        assert_matches(captured[0], message_passing_composite, (x, w, pairs), dtype)
