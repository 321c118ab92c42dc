import os

import pytest
import torch

import mirage
from common import capture_graph, randn


@pytest.mark.cuda
def test_capture_and_replay_with_new_inputs():
    c = 320
    x = randn(2, c, 32, 32, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    t = randn(2, 1024, c, device="cuda", dtype=torch.float16)
    r = randn(2, 1024, c, device="cuda", dtype=torch.float16)
    w = randn(c, device="cuda")
    f = randn(2, 1024, 2 * c, device="cuda", dtype=torch.float16)

    def step():
        return (mirage.ops.group_norm(x, 32, w, w, 1e-5, "silu"),
                mirage.ops.layer_norm(t, w, w, 1e-5, residual=r),
                mirage.ops.geglu(f))

    graph, outputs = capture_graph(step)
    for _ in range(3):
        for buf in (x, t, r, f):
            buf.copy_(randn(*buf.shape, device="cuda", dtype=buf.dtype))
        graph.replay()
        torch.cuda.synchronize()
        gn, (ln, total), gg = outputs
        torch.testing.assert_close(gn, mirage.ops.group_norm(x, 32, w, w, 1e-5, "silu"), atol=0, rtol=0)
        torch.testing.assert_close(ln, mirage.ops.layer_norm(t, w, w, 1e-5, residual=r)[0], atol=0, rtol=0)
        torch.testing.assert_close(total, t + r, atol=0, rtol=0)
        torch.testing.assert_close(gg, mirage.ops.geglu(f), atol=0, rtol=0)



@pytest.mark.cuda
@pytest.mark.parametrize("cached", [False, True])
def test_calls_on_two_streams_are_ordered(cached):
    # A call on another stream than the last one's waits for it: the graphs' static inputs and
    # pool are shared, and a copy into them on a second stream once overwrote the inputs of a
    # replay still queued on the first.
    w = randn(1024, 1024, device="cuda") / 32

    def slow(x):
        for _ in range(100):
            x = torch.tanh(x @ w)
        return x

    a, b = randn(1024, 1024, device="cuda"), randn(1024, 1024, device="cuda")
    run = mirage.graphs.GraphCache(slow, 2, verbose=False) if cached else mirage.graphs.capture(slow, a)
    expected_a, expected_b = run(a), run(b)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    for _ in range(3):
        with torch.cuda.stream(first):
            got_a = run(a)
        with torch.cuda.stream(second):
            got_b = run(b)
        torch.cuda.synchronize()
        torch.testing.assert_close(got_a, expected_a, atol=0, rtol=0)
        torch.testing.assert_close(got_b, expected_b, atol=0, rtol=0)


def _group_norm_op(channels, groups):
    w = randn(channels, device="cuda", std=0.2, mean=1.0)
    b = randn(channels, device="cuda", std=0.2)
    return lambda x: mirage.ops.group_norm(x, groups, w, b, 1e-5, "silu")


def _norms_ops(n, c, h, w_):
    """GroupNorm (the resident kernel at 2x640x32x32), bias_act with its input as the residual,
    LayerNorm, LayerNorm with its input as the residual; images channels-last, tokens their views."""
    w, b = randn(c, device="cuda", std=0.2, mean=1.0), randn(c, device="cuda", std=0.2)
    bias = randn(c, device="cuda", dtype=torch.float16, std=0.2)
    return [
        _group_norm_op(c, 32),
        lambda x: mirage.ops.bias_act(x, bias, residual=x, scale=0.5),
        lambda x: mirage.ops.layer_norm(x.permute(0, 2, 3, 1).reshape(n, h * w_, c), w, b, 1e-5),
        lambda t: mirage.ops.layer_norm(t, w, b, 1e-5, residual=t)[0].reshape(n, h, w_, c).permute(0, 3, 1, 2),
    ]


def _image(*shape, channels_last=True):
    x = randn(*shape, device="cuda", dtype=torch.float16)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def _md_ops():
    """An MD step's chain of overlapped kernels on 12 atoms: the drift writes the positions the
    one-block neighbor search reads, whose pairs the pair vectors read (float64 state, float32 model
    positions; every kernel deterministic: no atomics)."""
    velocities = torch.full((12, 3), 0.1, dtype=torch.float64, device="cuda")
    forces, inverse_masses = torch.zeros_like(velocities), torch.ones(12, 1, dtype=torch.float64, device="cuda")

    def step(x):
        state = x.clone()  # verlet_kick_drift moves it in place (by drift * velocities: a kick of 0)
        model_positions = mirage.ops.verlet_kick_drift(state, velocities, forces, inverse_masses, 0.0, 0.5)
        found = mirage.ops.neighbor_list(model_positions, 3.0, max_pairs=132)
        vectors, distances = mirage.ops.pair_vectors(model_positions, found.pairs, found.shifts)
        return state + 1e-3 * (vectors[:12] * distances[:12, None]).double()
    return [step]


# name: (input, the ops of one round, rounds)
_CHAINS = {
    "md_step": (lambda: randn(12, 3, device="cuda", dtype=torch.float64, std=2.0), _md_ops, 40),
    "norms": (lambda: _image(2, 640, 32, 32), lambda: _norms_ops(2, 640, 32, 32), 40),
    "group_norm_fused": (lambda: _image(2, 1280, 8, 8), lambda: [_group_norm_op(1280, 32)], 40),
    "group_norm_nhwc": (lambda: _image(2, 300, 45, 45), lambda: [_group_norm_op(300, 30)], 20),  # C % 8 != 0
    "group_norm_groups": (lambda: _image(2, 320, 45, 45, channels_last=False),  # H * W % 8 != 0
                          lambda: [_group_norm_op(320, 32)], 20),
    # Widths 8192 -> 64; near 1.15, where x * gelu(x) = x, the values stay of order 1 through the
    # seven (from random values around 0 they die out to zeros, now and then inf * 0 = NaN).
    "geglu": (lambda: randn(1024, 8192, device="cuda", dtype=torch.float16, mean=1.15, std=0.02),
              lambda: [mirage.ops.geglu] * 7, 1),
}


def _run_chain(x, ops, rounds, sync_each_op):
    """Each op reads what the op ahead of it wrote; each intermediate is dropped as soon as the op
    after it is launched, so the caching allocator may hand its block to a later output while the
    kernel reading it is still running. sync_each_op: the host waits for the GPU after every op."""
    for _ in range(rounds):
        for op in ops:
            x = op(x)
            if sync_each_op:
                torch.cuda.synchronize()
    return x


@pytest.mark.cuda
@pytest.mark.parametrize("chain", sorted(_CHAINS))
def test_overlapped_launches_keep_stream_order(chain):
    # On sm_90 mirage's kernels are launched overlapped (docs/ops.md): each may be scheduled while
    # the kernel ahead finishes, and must wait for it before touching memory. A missing wait would
    # read an input before it was written, or write a block that a kernel still reads: the chain
    # would differ from the same chain run one op at a time.
    if torch.cuda.get_device_capability() < (9, 0) or os.environ.get("MIRAGE_OVERLAP_LAUNCHES") == "0":
        pytest.skip("launches are overlapped on compute capability 9.0 and later, unless MIRAGE_OVERLAP_LAUNCHES=0")
    make_input, make_ops, rounds = _CHAINS[chain]
    x, ops = make_input(), make_ops()
    expected = _run_chain(x, ops, rounds, sync_each_op=True)
    assert expected.isfinite().all() and expected.abs().max() > 0.1  # a chain of values, not of zeros
    torch.testing.assert_close(_run_chain(x, ops, rounds, sync_each_op=False), expected, atol=0, rtol=0)
    graph, output = capture_graph(lambda: _run_chain(x, ops, rounds, sync_each_op=False))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(output, expected, atol=0, rtol=0)
