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


def _overlapped_chain(x, w, b, bias, rounds, sync_each_op):
    """Rounds of mirage ops, each reading what the one before it wrote (on sm_90 they are launched
    overlapped: each must wait for its predecessor). Intermediates are dropped as soon as they are
    read, so the caching allocator hands their blocks to later outputs while a kernel that read them
    may still be finishing. sync_each_op puts the host between the launches: no overlap at all."""
    def done(t):
        if sync_each_op:
            torch.cuda.synchronize()
        return t

    n, c, height, width = x.shape
    side = []
    for _ in range(rounds):
        g = done(mirage.ops.group_norm(x, 32, w, b, 1e-5, "silu"))  # the resident kernel at this size
        h = done(mirage.ops.bias_act(g, bias, residual=x, scale=0.5))
        tokens = h.permute(0, 2, 3, 1).reshape(n, height * width, c)  # channels-last: a view
        normed, _ = done(mirage.ops.layer_norm(tokens, w, b, 1e-5, residual=tokens))
        side.append(done(mirage.ops.geglu(normed)).float().sum())
        x = normed.reshape(n, height, width, c).permute(0, 3, 1, 2)
    return x, torch.stack(side)


@pytest.mark.cuda
def test_overlapped_launches_keep_stream_order():
    # Without the wait at the top of each kernel, a kernel would read its input before the one
    # ahead had written it (or write a block another is still reading): results would differ from
    # the same chain run one op at a time.
    c = 640
    x = randn(2, c, 32, 32, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w, b = randn(c, device="cuda", std=0.2, mean=1.0), randn(c, device="cuda", std=0.2)
    bias = randn(c, device="cuda", dtype=torch.float16, std=0.2)
    expected = _overlapped_chain(x, w, b, bias, 40, sync_each_op=True)
    got = _overlapped_chain(x, w, b, bias, 40, sync_each_op=False)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    graph, outputs = capture_graph(lambda: _overlapped_chain(x, w, b, bias, 40, sync_each_op=False))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(outputs, expected, atol=0, rtol=0)
